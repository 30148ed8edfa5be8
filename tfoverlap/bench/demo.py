"""``make demo``: short runs of both benchmarks on the emulated testbed.

TicTac: one PS and two workers, each in its own network namespace behind a tbf-shaped
link; TicTac's seq-32 in inference and training and Keras ResNet-50 in inference, with
TensorFlow's default, TensorFlow's recv scheduling, TIC and TAC interleaved.
Caramel: two Horovod ranks (Gloo) behind 1 Gbit/s links training ResNet-50, with
Horovod's defaults, DDP-style buckets and Caramel interleaved.
Emulated accelerators: four workers and one PS training ResNet-50 on emulated V100s behind
emulated 10 Gbit/s links (dilation chosen for the host), TensorFlow's default and TIC.
Root is needed for the namespaces; without it the runs fall back to loopback and say so.
Prints the tables and writes CSV, Markdown and plots under ``out/demo``.
``docs/benchmarks.md`` has the full benchmarks.
"""
from __future__ import annotations

import argparse
import os
import sys

DEMO_MODELS = "seq32,resnet50:inference"
DEMO_HOROVOD_MODEL = "resnet50"


def main(argv=None) -> int:
    parser = argparse.ArgumentParser(prog="python -m tfoverlap.bench.demo",
                                     description=__doc__.splitlines()[0])
    parser.add_argument("--models", default=DEMO_MODELS)
    parser.add_argument("--horovod-model", default=DEMO_HOROVOD_MODEL)
    parser.add_argument("--rounds", type=int, default=3)
    parser.add_argument("--out", default="out/demo")
    parser.add_argument("--skip-emulated", action="store_true",
                        help="leave out the emulated-accelerator run")
    args = parser.parse_args(argv)

    import tensorflow as tf
    import tfoverlap
    from tfoverlap.bench import allreduce, ps
    print(f"tfoverlap {tfoverlap.__version__} with TensorFlow {tf.__version__}: a short PS "
          f"benchmark ({args.models}, {args.rounds} rounds), then a short Horovod one "
          f"({args.horovod_model}), then one on emulated accelerators (4 workers); progress on "
          "stderr", flush=True)
    status = ps.main(["--models", args.models, "--rounds", str(args.rounds), "--steps", "2",
                      "--traces", "2", "--out", args.out])
    if status:
        return status
    status = allreduce.main(["--models", args.horovod_model, "--bandwidths", "1Gbit",
                             "--rounds", str(args.rounds), "--steps", "2", "--no-autotune",
                             "--out", os.path.join(args.out, "horovod")])
    if status or args.skip_emulated:
        return status
    return ps.main(["--models", "resnet50:training", "--emulate", "v100", "--link", "10Gbit",
                    "--workers", "4", "--variants", "default,tic", "--rounds", "2",
                    "--steps", "2", "--traces", "1", "--out", os.path.join(args.out, "emulated")])


if __name__ == "__main__":
    sys.exit(main())
