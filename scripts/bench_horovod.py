"""The full Horovod (Caramel) benchmark (docs/benchmarks.md); see tfoverlap/bench/allreduce.py.

    sudo .venv/bin/python scripts/bench_horovod.py --out out/horovod
"""
import sys

from tfoverlap.bench.allreduce import main

if __name__ == "__main__":
    sys.exit(main())
