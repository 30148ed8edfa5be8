"""``make demo``: a short run of the parameter-server benchmark on the emulated testbed.

One PS and two workers, each in its own network namespace behind a tbf-shaped link
(root needed; without it the run falls back to loopback and says so). TicTac's seq-32 in
inference and training and Keras ResNet-50 in inference, with TensorFlow's default,
TensorFlow's recv scheduling, TIC and TAC interleaved. Prints the table and writes the
CSV, the Markdown table and the plots. ``docs/benchmarks.md`` has the full benchmark.
"""
from __future__ import annotations

import argparse
import sys

DEMO_MODELS = "seq32,resnet50:inference"


def main(argv=None) -> int:
    parser = argparse.ArgumentParser(prog="python -m tfoverlap.demo",
                                     description=__doc__.splitlines()[0])
    parser.add_argument("--models", default=DEMO_MODELS)
    parser.add_argument("--rounds", type=int, default=3)
    parser.add_argument("--out", default="out/demo")
    args = parser.parse_args(argv)

    import tensorflow as tf
    import tfoverlap
    from tfoverlap.bench import ps
    print(f"tfoverlap {tfoverlap.__version__} with TensorFlow {tf.__version__}: a short PS "
          f"benchmark ({args.models}, {args.rounds} rounds); progress on stderr",
          flush=True)
    return ps.main(["--models", args.models, "--rounds", str(args.rounds), "--steps", "2",
                    "--traces", "2", "--out", args.out])


if __name__ == "__main__":
    sys.exit(main())
