"""When a Horovod step hands its gradients to Horovod, from Horovod's own timeline (root).

Runs the Horovod benchmark's workers (graph mode: :mod:`tfoverlap.bench.allreduce_worker`;
Keras ``model.fit``: :mod:`tfoverlap.bench.keras_worker`) on emulated hosts with
``HOROVOD_TIMELINE`` set, and prints for each step of rank 0's timeline (in emulated
milliseconds): how long after the first request the gradients reached Horovod (a
quarter, half, three quarters and all of the bytes, on every rank), the ring's busy
time, and the tail from the last request to the end of the last reduction. This is how
the Keras step was found to hand its large weight gradients to Horovod 30 ms later than
graph mode does (docs/benchmarks.md, "Keras' weight gradients gated").

    sudo .venv/bin/python scripts/horovod_gradient_timeline.py --apis keras,graph \\
        --variant horovod --ranks 8 --link 25Gbit --dilation 32 --out out/timelines
"""
from __future__ import annotations

import argparse
import os
import sys

import numpy as np

sys.path.insert(0, os.path.join(os.path.dirname(__file__), ".."))

WORKERS = {"graph": "tfoverlap.bench.allreduce_worker", "keras": "tfoverlap.bench.keras_worker"}


def step_table(records: dict, dilation: float) -> list[dict]:
    """Per step (the k-th negotiation and reduction of every tensor): the times, in
    emulated ms after the step's first request, by which each quarter of the bytes had
    been requested by every rank; the ring's busy time; the tail after the last request."""
    from tfoverlap.costs.horovod_timeline import covered_micros
    steps = min(min(len(r.negotiations), len(r.reductions)) for r in records.values())
    table = []
    for step in range(steps):
        first = min(r.negotiations[step][0] for r in records.values())
        asked = np.array([r.negotiations[step][1] for r in records.values()], float)
        sizes = np.array([r.bytes for r in records.values()], float)
        order = np.argsort(asked)
        cumulative = np.cumsum(sizes[order]) / max(sizes.sum(), 1.0)
        end = max(r.reductions[step][1] for r in records.values())
        busy = covered_micros([r.reductions[step] for r in records.values()], (first, end))

        def ms(micros):
            return round(micros / 1e3 / dilation, 1)

        table.append({"step": step, **{
            f"bytes_{int(q * 100)}pct_ms": ms(asked[order][np.searchsorted(cumulative, q - 1e-9)]
                                              - first) for q in (0.25, 0.5, 0.75, 1.0)},
            "ring_busy_ms": ms(busy), "tail_after_last_request_ms": ms(end - asked.max())})
    return table


def main(argv=None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--apis", default="keras,graph")
    parser.add_argument("--variant", default="horovod")
    parser.add_argument("--model", default="resnet50")
    parser.add_argument("--batch", type=int, default=64)
    parser.add_argument("--ranks", type=int, default=8)
    parser.add_argument("--link", default="25Gbit")
    parser.add_argument("--emulate", default="v100")
    parser.add_argument("--dilation", type=float, default=32.0)
    parser.add_argument("--out", default="out/timelines")
    args = parser.parse_args(argv)
    from tfoverlap.bench.allreduce import dilated_horovod_env
    from tfoverlap.costs.horovod_timeline import read_timeline
    from tfoverlap.options import parse_bandwidth
    from tfoverlap.testbed.horovod_launch import run_horovod
    from tfoverlap.testbed.network import EmulatedNetwork
    os.makedirs(args.out, exist_ok=True)
    common = ["--model", args.model, "--batch", str(args.batch), "--emulate", args.emulate,
              "--dilation", str(args.dilation), "--variants", args.variant, "--rounds", "1"]
    extra = {"graph": ["--steps", "6", "--warmup", "2"],
             "keras": ["--calls", "3", "--warmup", "1", "--steps-per-execution", "4"]}
    with EmulatedNetwork(args.ranks,
                         bandwidth=parse_bandwidth(args.link) / args.dilation) as network:
        for api in args.apis.split(","):
            path = os.path.abspath(os.path.join(args.out, f"timeline-{api}.json"))
            env = {**dilated_horovod_env(args.dilation), "HOROVOD_TIMELINE": path,
                   "HOROVOD_GLOO_TIMEOUT_SECONDS": "900"}
            result = run_horovod(network, network.num_hosts,
                                 [sys.executable, "-m", WORKERS[api]] + common + extra[api],
                                 "gloo", env=env, timeout=3600)
            if not os.path.exists(path):
                print(f"{api}: no timeline; rank 0 said:\n{result.outputs[0][-2000:]}")
                return 1
            with open(path) as stream:
                rows = step_table(read_timeline(stream.read()), args.dilation)
            print(f"{api} ({args.variant}): first step left out (warm-up)")
            for row in rows[1:]:
                print("  " + "  ".join(f"{k} {v}" for k, v in row.items()))
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
