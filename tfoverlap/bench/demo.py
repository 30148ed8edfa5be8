"""``make demo``: short runs of both benchmarks on the emulated testbed.

1. Parameter server, CPU workers: one PS and two workers, each in its own network
   namespace behind a tbf-shaped link; TicTac's seq-32 in inference and training and Keras
   ResNet-50 in inference, with TensorFlow's default (twice: the A/A row), TensorFlow's
   recv scheduling, TIC and TAC interleaved.
2. Parameter server, emulated accelerators: four workers and one PS training ResNet-50
   on emulated V100s behind emulated 10 Gbit/s links, the default (twice) and TIC, measured
   until the intervals are within about +-5% or the part's time budget is spent.
3. Horovod, emulated accelerators: four ranks (Gloo) training Keras ResNet-50 with
   ``model.fit(steps_per_execution=4)`` on emulated V100s behind emulated 25 Gbit/s links,
   Horovod's defaults (twice) and tfoverlap's wrappers with default options, whose
   cross-step overlap reduces some gradients under the next step's forward pass.

Root is needed for the namespaces; without it the runs fall back to loopback and say so.
Prints each part's table, a summary line per configuration (a variant that stepped aside
says so, and its number is the run's noise beside the A/A row) and each part's time;
writes CSV, Markdown and plots under ``out/demo``. ``docs/benchmarks.md`` has the full
benchmarks.
"""
from __future__ import annotations

import argparse
import os
import sys
import time

DEMO_MODELS = "seq32,resnet50:inference"
DEMO_HOROVOD_MODEL = "resnet50"


def main(argv=None) -> int:
    parser = argparse.ArgumentParser(prog="python -m tfoverlap.bench.demo",
                                     description=__doc__.splitlines()[0])
    parser.add_argument("--models", default=DEMO_MODELS)
    parser.add_argument("--horovod-model", default=DEMO_HOROVOD_MODEL)
    parser.add_argument("--rounds", type=int, default=3)
    parser.add_argument("--emulated-budget-s", type=float, default=90.0,
                        help="part 2: seconds of measuring after which it stops short of "
                             "+-5%% intervals")
    parser.add_argument("--out", default="out/demo")
    parser.add_argument("--skip-emulated", action="store_true",
                        help="leave out the parts on emulated accelerators (2 and 3)")
    args = parser.parse_args(argv)

    import tensorflow as tf
    import tfoverlap
    from tfoverlap.bench import allreduce, ps
    print(f"tfoverlap {tfoverlap.__version__} with TensorFlow {tf.__version__}: a short PS "
          f"benchmark ({args.models}, {args.rounds} rounds), then PS and Horovod training on "
          "emulated V100s (4 workers, 4 ranks); progress on stderr", flush=True)
    parts = [("parameter server, CPU workers", ps.main, [
        "--models", args.models,
        "--variants", "default,default_again,tf_recv_scheduling,tic,tac",
        "--rounds", str(args.rounds), "--steps", "2", "--traces", "2", "--out", args.out])]
    if not args.skip_emulated:
        parts += [
            ("parameter server, emulated V100 workers", ps.main, [
                "--models", "resnet50:training", "--emulate", "v100", "--link", "10Gbit",
                "--workers", "4", "--variants", "default,default_again,tic", "--rounds", "2",
                "--steps", "2", "--traces", "1", "--until-ci", "0.05",
                "--budget-s", str(args.emulated_budget_s),
                "--out", os.path.join(args.out, "emulated")]),
            ("Horovod, emulated V100 ranks, Keras fit", allreduce.main, [
                "--api", "keras", "--models", args.horovod_model, "--links", "25Gbit",
                "--workers", "4", "--emulate", "v100", "--steps-per-execution", "4",
                "--variants", "horovod,horovod_again,caramel", "--rounds", "2",
                "--steps", "2", "--no-autotune", "--no-breakdown",
                "--out", os.path.join(args.out, "horovod")])]
    timings = []
    for title, part, part_argv in parts:
        print(f"\n== {title}", flush=True)
        began = time.monotonic()
        status = part(part_argv)
        timings.append((title, time.monotonic() - began))
        if status:
            return status
    print("\n" + "; ".join(f"{title}: {seconds / 60:.1f} min" for title, seconds in timings))
    return 0


if __name__ == "__main__":
    sys.exit(main())
