"""One rank of the Horovod benchmark: builds every variant's graph, then times them in turns.

Run by :mod:`tfoverlap.bench.allreduce` as a Horovod job (one rank per emulated host). All
ranks run the same schedule, so the AllReduces keep them in step; rank 0 prints one JSON
line with every variant's step times and what Caramel planned.

Variants (each its own graph and session, same model, batch and seed):
  horovod       ``hvd.DistributedOptimizer`` as is (Horovod's cycle/buffer fusion).
  horovod_again the same graph again: the A/A row, how far apart two identical variants
                measure in this run.
  autotune      the same graph; meant for a job with ``HOROVOD_AUTOTUNE=1`` (process-wide).
  ddp25         explicit groups as PyTorch DDP buckets them: reverse parameter order,
                25 MiB per bucket, the first 1 MiB.
  caramel       ``tfoverlap.horovod.DistributedOptimizer`` (network measured at start-up),
                default options: cross-step overlap where the plan predicts a gain, the
                in-step plan where that predicts one, else Horovod's own fusion.
  caramel_forced    the same, planning even where it predicts no gain (force=True).
  caramel_finished  forced, each bucket issued only once the one before is reduced.
  caramel_profiled  forced, planned with op times from a profiled warm-up of 3 steps
                (``configure(profile_steps=3)``) instead of static estimates.
  caramel_cross_step  forced, the plan's best deferral reduced under the next step's
                forward pass wherever one fits (``configure(cross_step=True)``; its
                report says what was deferred).
  caramel_decoupled  forced, the gradients reduce-scattered under the backward pass, each
                rank's shard updated, the parameters all-gathered under the next forward
                pass (``configure(decouple=True)``; its report says what was decoupled).
  compute_only  the same model with a local optimizer: the step without communication.
  comm_only     only the AllReduces of the model's gradients (Horovod's default fusion).

With ``--trace-timeline PATH`` (and ``HOROVOD_TIMELINE=DYNAMIC``), after the timed rounds every
variant that reduces gradients runs ``--traced-steps`` more steps traced by TensorFlow while
Horovod's timeline records to PATH; rank 0 reports each traced step's bounds, when each
gradient reached Horovod, and its compute, for :mod:`tfoverlap.costs.horovod_timeline`.
The benchmark runs that as a job of its own (``--rounds 0``): wherever the timeline is
enabled, Horovod's writer thread spins on rank 0 for the whole job (see
:func:`calm_timeline_writer`).

With ``--emulate`` every variant's session runs the emulate pass (the heavy compute on
emulated accelerators, durations times ``--dilation``), and Caramel plans with the
emulated op times. Rank 0 also reports its CPU time per step and how busy the host's CPUs
were while it timed (all ranks share this host).
"""
from __future__ import annotations

import argparse
import json
import os
import sys
import threading
import time

__all__ = ["ddp_groups", "main"]

#: the Caramel variants and the options each configures the wrappers with.
CARAMEL_VARIANTS = {"caramel": {}, "caramel_forced": {"force": True},
                    "caramel_finished": {"force": True, "bucket_chain": "finished"},
                    "caramel_profiled": {"force": True, "profile_steps": 3},
                    "caramel_cross_step": {"force": True, "cross_step": True},
                    "caramel_decoupled": {"force": True, "decouple": True}}
VARIANT_NAMES = ("horovod", "horovod_again", "autotune", "ddp25", *CARAMEL_VARIANTS, "compute_only",
                 "comm_only")
MIB = 2 ** 20


def ddp_groups(variables, bucket_bytes: int = 25 * MIB, first_bytes: int = 1 * MIB):
    """PyTorch DDP's buckets: parameters in reverse order (roughly the order their
    gradients become ready), cut at ``bucket_bytes`` (the first bucket at ``first_bytes``)."""
    groups, current, size = [], [], 0
    limit = first_bytes
    for variable in reversed(list(variables)):
        current.append(variable)
        size += variable.shape.num_elements() * variable.dtype.size
        if size >= limit:
            groups.append(current)
            current, size, limit = [], 0, bucket_bytes
    if current:
        groups.append(current)
    return groups


def _build(variant: str, args):
    import horovod.tensorflow as hvd
    import tensorflow as tf

    import tfoverlap.horovod as tfo_hvd
    from tfoverlap.testbed.models import build_model

    # Embedding gradients are reduced dense in every variant (Horovod's explicit groups
    # cannot take IndexedSlices).
    def wrap(optimizer):
        if variant in ("horovod", "horovod_again", "autotune"):
            return hvd.DistributedOptimizer(optimizer, sparse_as_dense=True)
        if variant in CARAMEL_VARIANTS:
            return tfo_hvd.DistributedOptimizer(optimizer, sparse_as_dense=True)
        return optimizer

    tfo_hvd.configure(**CARAMEL_VARIANTS.get(variant, {}), **_emulation(args))
    try:
        model = build_model(args.model, args.batch, 0, "/cpu:0", True, seed=args.seed,
                            wrap_optimizer=None if variant == "ddp25" else wrap)
    finally:
        tfo_hvd.configure()
    fetch = model.fetch
    if variant == "ddp25":
        with model.graph.as_default():
            optimizer = hvd.DistributedOptimizer(
                tf.compat.v1.train.GradientDescentOptimizer(0.01),
                groups=ddp_groups(model.variables), sparse_as_dense=True)
            fetch = optimizer.minimize(model.loss, var_list=model.variables)
            model.init = tf.compat.v1.global_variables_initializer()
    elif variant == "comm_only":
        with model.graph.as_default():
            # Reading the variables keeps Grappler's constant folding from running the
            # AllReduces at optimization time; the sums keep them alive.
            fetch = tf.add_n([tf.reduce_sum(hvd.allreduce(tf.identity(v), op=hvd.Sum,
                                                          name=f"comm_only_{i}"))
                              for i, v in enumerate(model.variables)])
    config = tf.compat.v1.ConfigProto(intra_op_parallelism_threads=args.intra_op,
                                      inter_op_parallelism_threads=args.inter_op)
    if args.emulate:
        import tfoverlap
        config = tfoverlap.session_config(config, schedule="none", **_emulation(args))
    session = tf.compat.v1.Session(graph=model.graph, config=config)
    session.run(model.init)
    return session, fetch, model


def _emulation(args) -> dict:
    return {"emulate": args.emulate, "dilation": args.dilation} if args.emulate else {}


def calm_timeline_writer(window_seconds: float = 1.0, busy_share: float = 0.05) -> int:
    """Horovod 0.28's timeline writer thread loops on ``sched_yield`` from ``hvd.init()``
    until shutdown on rank 0 whenever HOROVOD_TIMELINE is set, recording or not: one
    core of a 2-core host gone. Called while this process is otherwise idle (just after
    ``hvd.init()``), it moves every thread that used at least ``busy_share`` of a CPU over
    ``window_seconds`` to SCHED_IDLE (it then runs only when nothing else wants a CPU;
    under 8 ranks starting on 2 cores the spinner gets a fraction of one); returns how
    many threads it moved."""
    def cpu_ticks() -> dict[int, int]:
        ticks = {}
        for tid in os.listdir("/proc/self/task"):
            try:
                with open(f"/proc/self/task/{tid}/stat") as stream:
                    fields = stream.read().rsplit(")", 1)[1].split()
                ticks[int(tid)] = int(fields[11]) + int(fields[12])   # utime + stime
            except (OSError, IndexError, ValueError):
                continue
        return ticks
    before = cpu_ticks()
    time.sleep(window_seconds)
    after = cpu_ticks()
    busy = max(1.0, busy_share * window_seconds * os.sysconf("SC_CLK_TCK"))
    calmed = 0
    for tid, ticks in after.items():
        if tid != threading.get_native_id() and ticks - before.get(tid, ticks) >= busy:
            os.sched_setscheduler(tid, os.SCHED_IDLE, os.sched_param(0))
            calmed += 1
    return calmed


def _traced_steps(built: dict, args) -> dict:
    """Variant -> one record per traced step (rank 0's clock, µs since the epoch): the
    step's span, when each gradient reached Horovod, and (for the median step) its
    compute."""
    import horovod.tensorflow as hvd
    import tensorflow as tf

    import tfoverlap.horovod as tfo_hvd
    from tfoverlap.costs.trace import op_type_starts, step_span, step_timeline
    from tfoverlap.planning.caramel import gradient_submissions
    options = tf.compat.v1.RunOptions(trace_level=tf.compat.v1.RunOptions.FULL_TRACE,
                                      output_partition_graphs=True)
    traced = {}
    hvd.start_timeline(args.trace_timeline)
    try:
        for variant, (session, fetch, model) in built.items():
            if variant in ("compute_only", "comm_only"):
                continue
            steps = []
            for _ in range(args.traced_steps):
                metadata = tf.compat.v1.RunMetadata()
                session.run(fetch, options=options, run_metadata=metadata)
                start, end = step_span(metadata)
                ready, collectives = gradient_submissions(metadata)
                # A collective op lasts until its collective is done, and an op that waits
                # for a background run's results (cross-step, decoupled) until they
                # arrive: neither is compute.
                waiting = collectives | {name for _, name in
                                         op_type_starts(metadata, ("QueueDequeueV2",))}
                compute = [entry for entry in step_timeline(metadata, origin=start)["compute"]
                           if entry[0] not in waiting]
                steps.append({"span": [start, end], "ready": ready, "compute": compute})
            flush = tfo_hvd.flush_op(model.graph)   # its last reductions: not the next's
            if flush is not None:
                session.run(flush)
            # The compute of the median step only (the figure's step): thousands of ops.
            lengths = sorted(steps, key=lambda step: step["span"][1] - step["span"][0])
            for step in lengths[:len(lengths) // 2] + lengths[len(lengths) // 2 + 1:]:
                step["compute"] = []
            traced[variant] = steps
    finally:
        hvd.stop_timeline()
    return traced


def main(argv=None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--model", required=True)
    parser.add_argument("--batch", type=int, required=True)
    parser.add_argument("--variants", default="horovod,ddp25,caramel,compute_only,comm_only")
    parser.add_argument("--rounds", type=int, default=3)
    parser.add_argument("--steps", type=int, default=3, help="steps per variant per round")
    parser.add_argument("--warmup", type=int, default=2)
    parser.add_argument("--intra-op", type=int, default=1)
    parser.add_argument("--inter-op", type=int, default=2)
    parser.add_argument("--seed", type=int, default=0)
    parser.add_argument("--emulate", default="", help="a device model or file")
    parser.add_argument("--dilation", type=float, default=1.0)
    parser.add_argument("--trace-timeline", default="",
                        help="trace steps with Horovod's timeline at this path (rank 0)")
    parser.add_argument("--traced-steps", type=int, default=3)
    args = parser.parse_args(argv)
    variants = args.variants.split(",")
    unknown = [v for v in variants if v not in VARIANT_NAMES]
    if unknown:
        print(f"unknown variant {unknown[0]!r}; choose from {', '.join(VARIANT_NAMES)}",
              file=sys.stderr)
        return 2
    import horovod.tensorflow as hvd
    import tensorflow as tf
    tf.compat.v1.disable_eager_execution()
    hvd.init()
    calmed = calm_timeline_writer() if args.trace_timeline and hvd.rank() == 0 else 0
    import tfoverlap
    import tfoverlap.horovod as tfo_hvd
    from tfoverlap.horovod.session.decoupling import decoupling_summary
    from tfoverlap.horovod.session.deferral import deferral_summary
    began = time.perf_counter()
    built, caramel = {}, {}
    for variant in variants:
        mark = tfoverlap.report_count()
        built[variant] = _build(variant, args)
        if variant in CARAMEL_VARIANTS:
            caramel[variant] = next((p.summary for r in tfoverlap.recent_reports(since=mark)
                                     for p in r.passes if p.name == "caramel"), None)
            deferral = deferral_summary(built[variant][2].graph)
            if caramel[variant] is not None and deferral:
                caramel[variant] = {**caramel[variant], "cross_step": {
                    **caramel[variant].get("cross_step", {}), **deferral}}
            decoupled = decoupling_summary(built[variant][2].graph)
            if caramel[variant] is not None and decoupled:
                caramel[variant] = {**caramel[variant], "decouple": {
                    **caramel[variant].get("decouple", {}), **decoupled}}
    build_seconds = time.perf_counter() - began
    for variant, (session, fetch, _) in built.items():
        for _ in range(args.warmup):
            session.run(fetch)
    from tfoverlap.bench.dilation import busy_fraction, cpu_sample
    times = {variant: [] for variant in variants}
    cpu = {variant: [] for variant in variants}
    before = cpu_sample()
    flushes = {variant: tfo_hvd.flush_op(model.graph)
               for variant, (_, _, model) in built.items()}
    for round_number in range(args.rounds):
        shift = round_number % len(variants)
        for variant in variants[shift:] + variants[:shift]:
            session, fetch, _ = built[variant]
            # Steady state: one untimed step first, so that every timed step of a variant
            # with deferred reductions waits for the step before it; after the block its
            # last reductions finish untimed, not under the next variant's steps.
            session.run(fetch)
            for _ in range(args.steps):
                start, start_cpu = time.perf_counter(), time.process_time()
                session.run(fetch)
                times[variant].append(time.perf_counter() - start)
                cpu[variant].append(time.process_time() - start_cpu)
            if flushes[variant] is not None:
                session.run(flushes[variant])
    host_busy = busy_fraction(before, cpu_sample())
    traced = _traced_steps(built, args) if args.trace_timeline else {}
    model = next(iter(built.values()))[2]
    if hvd.rank() == 0:
        print(json.dumps({
            "model": args.model, "batch": args.batch, "ranks": hvd.size(),
            "parameter_bytes": model.parameter_bytes, "tensors": len(model.variables),
            "times": times, "cpu": cpu, "host_busy": host_busy,
            "build_seconds": build_seconds, "traced": traced, "calmed_threads": calmed,
            "network_model": tfo_hvd.network_model(),
            "caramel": caramel}), flush=True)
    for session, _, _ in built.values():
        session.close()
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
