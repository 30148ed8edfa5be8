"""How far the cross-step plan's choice is from a wider search of the same model.

``plan_cross_step`` simulates a few dozen deferral sets: up to 16 sizes of the gradients
the next forward pass needs last, each cut into growing runs, alone and with the
readiness suffix. This script simulates many more with the same simulation: every such
set up to ``--forward-passes`` forward passes of ring time, each cut into 1 to
``--chunks`` requests at up to ``--cut-positions`` evenly spaced places. It prints the
plan's candidates beside the best set found. Where the two are close, what limits the
plan is the exact bound (what can be reduced before each variable's next read), not
which sets it tries.

    python scripts/cross_step_search.py --model transformer --batch 32 --workers 8 \\
        --bandwidth 25Gbit --emulate v100
    python scripts/cross_step_search.py --graph step.pb --workers 8 --bandwidth 10Gbit

``--model`` builds one of the benchmark's models (tfoverlap.testbed.models) with
tfoverlap's DistributedOptimizer in a one-rank Horovod process; ``--graph`` reads a
GraphDef with HorovodAllreduce ops (``tfoverlap schedule --algo cross_step`` plans the
same one).
"""
from __future__ import annotations

import argparse
import itertools
import json
import os
import sys
import time

import numpy as np

ROOT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
if ROOT not in sys.path:
    sys.path.insert(0, ROOT)


def need_ordered_sets(plan, rings, forward_passes: float) -> list[list[int]]:
    """The sets of gradients the next forward pass needs last (positions in
    ``plan.nodes``), one per size, up to ``forward_passes`` forward passes of ring time;
    each in need order (the first needed first), never every gradient."""
    known = sorted((p for p in range(len(plan.nodes)) if plan.needers[p] and plan.needs[p] > 0),
                   key=lambda p: (-plan.needs[p], p))
    forward = max((plan.needs[p] for p in known), default=0.0)
    total = np.cumsum([rings[p] for p in known])
    count = int(np.searchsorted(total, forward_passes * forward, side="right"))
    count = min(count, len(known), len(plan.nodes) - 1)
    return [sorted(known[:size], key=lambda p: (plan.needs[p], -p))
            for size in range(1, count + 1)]


def chunkings(ordered: list[int], chunks: int, cut_positions: int) -> list[list[list[int]]]:
    """``ordered`` cut, in order, into 1 to ``chunks`` runs at up to ``cut_positions``
    evenly spaced places."""
    places = sorted({int(round(x)) for x in np.linspace(1, len(ordered) - 1,
                                                        min(len(ordered) - 1, cut_positions))}
                    ) if len(ordered) > 1 else []
    result = []
    for cuts in range(chunks):
        for chosen in itertools.combinations(places, cuts):
            bounds = [0, *chosen, len(ordered)]
            result.append([ordered[a:b] for a, b in zip(bounds, bounds[1:])])
    return result


def search(graph_def, options, forward_passes: float = 2.0, chunks: int = 3,
           cut_positions: int = 8) -> dict:
    """The plan's choice and candidates, and the best of the wider search (seconds of a
    step; chunks as gradient names), for ``graph_def`` under ``options``."""
    from tfoverlap.costs.network import ring_allreduce_seconds
    from tfoverlap.options import link_bandwidth
    from tfoverlap.planning import caramel
    from tfoverlap.sim.engine import simulate
    if options.emulate:     # the emulated kernels' op, which the plan's cost model imports
        from tfoverlap.integrations.emulated_kernel import load_emulated_ops
        load_emulated_ops()
    plan, inputs, op_seconds = caramel._planned(graph_def, options)  # noqa: SLF001
    bandwidth, latency = link_bandwidth(options), inputs.request_latency(options)
    fuse_queued = options.bucket_chain != "finished"
    cross = caramel.plan_cross_step(plan, op_seconds, inputs.ranks, bandwidth, latency,
                                    inputs.threads, fuse_queued=fuse_queued)

    def step(candidate) -> float:
        return simulate(caramel.bucket_problem(
            plan, op_seconds, inputs.ranks, bandwidth, latency, inputs.threads,
            fuse_queued=fuse_queued, deferred=candidate)).makespan

    rings = [float(ring_allreduce_seconds(size, inputs.ranks, bandwidth, 0.0))
             for size in plan.sizes]
    chosen_step = step(cross.chunks) if cross.chunks else cross.in_step
    best, best_chunks, evaluated = chosen_step, cross.chunks, 0
    for ordered in need_ordered_sets(plan, rings, forward_passes):
        for candidate in chunkings(ordered, chunks, cut_positions):
            evaluated += 1
            predicted = step(candidate)
            if predicted < best - 1e-12:
                best, best_chunks = predicted, candidate

    def named(candidate):
        return [[plan.model.names[plan.nodes[p]] for p in chunk] for chunk in candidate]

    def megabytes(candidate):
        return round(sum(plan.sizes[p] for chunk in candidate for p in chunk) / 1e6, 3)
    return {"candidates_s": cross.candidates, "order": cross.order,
            "chosen_s": chosen_step, "chosen": named(cross.chunks),
            "chosen_mb": megabytes(cross.chunks), "best_s": best, "best": named(best_chunks),
            "best_mb": megabytes(best_chunks), "evaluated": evaluated,
            "forward_s": max(plan.needs, default=0.0)}


def model_graph(model: str, batch: int):
    """The benchmark's ``model`` at ``batch`` with tfoverlap's DistributedOptimizer (no
    cross-step rewrite: the graph the plan starts from), built on one Horovod rank."""
    os.environ.setdefault("HOROVOD_CONTROLLER", "gloo")
    os.environ.setdefault("HOROVOD_CPU_OPERATIONS", "gloo")
    import horovod.tensorflow as hvd
    import tfoverlap.horovod as tfo_hvd
    from tfoverlap.testbed.models import build_model
    hvd.init()
    tfo_hvd.configure(cross_step=False)
    try:
        built = build_model(model, batch, 0, "/cpu:0", True, wrap_optimizer=lambda optimizer:
                            tfo_hvd.DistributedOptimizer(optimizer, sparse_as_dense=True))
    finally:
        tfo_hvd.configure()
    return built.graph.as_graph_def()


def main(argv=None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    source = parser.add_mutually_exclusive_group(required=True)
    source.add_argument("--graph", help="a GraphDef (.pb or .pbtxt) with HorovodAllreduce ops")
    source.add_argument("--model", help="a benchmark model (tfoverlap.testbed.models)")
    parser.add_argument("--batch", type=int, default=32)
    parser.add_argument("--workers", type=int, default=8)
    parser.add_argument("--bandwidth", default="25Gbit")
    parser.add_argument("--latency-us", type=float, default=50.0)
    parser.add_argument("--emulate", default="", help="a device model, as the option")
    parser.add_argument("--threads", type=int, default=2,
                        help="TensorFlow's inter-op threads the plan assumes")
    parser.add_argument("--forward-passes", type=float, default=2.0)
    parser.add_argument("--chunks", type=int, default=3)
    parser.add_argument("--cut-positions", type=int, default=8)
    parser.add_argument("--json", action="store_true")
    args = parser.parse_args(argv)
    from tfoverlap.cli import load_graph
    from tfoverlap.options import parse_options
    try:
        options = parse_options({"allreduce": "caramel", "ranks": args.workers,
                                 "bandwidth": args.bandwidth,
                                 "latency": args.latency_us * 1e-6, "emulate": args.emulate,
                                 "threads": args.threads})
    except ValueError as error:
        parser.error(str(error))
    graph_def = load_graph(args.graph) if args.graph else model_graph(args.model, args.batch)
    began = time.monotonic()
    found = search(graph_def, options, args.forward_passes, args.chunks, args.cut_positions)
    found["seconds"] = time.monotonic() - began
    if args.json:
        print(json.dumps(found, indent=1))
        return 0
    print("plan's candidates: " + ", ".join(f"{name} {seconds * 1e3:.2f} ms" for name, seconds
                                             in found["candidates_s"].items()))
    print(f"plan's choice: {found['order'] or 'nothing deferred'}, {found['chosen_mb']} MB in "
          f"{len(found['chosen'])} request(s), {found['chosen_s'] * 1e3:.2f} ms")
    print(f"wider search ({found['evaluated']} sets, {found['seconds']:.0f} s): "
          f"{found['best_mb']} MB in {len(found['best'])} request(s), "
          f"{found['best_s'] * 1e3:.2f} ms, "
          f"{(1 - found['best_s'] / found['chosen_s']) * 100:.1f}% below the plan's choice; "
          f"forward pass {found['forward_s'] * 1e3:.2f} ms")
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
