"""The full parameter-server benchmark (docs/benchmarks.md); see tfoverlap/bench/ps.py.

    sudo .venv/bin/python scripts/bench_ps.py --out out/benchmarks
"""
import sys

from tfoverlap.bench.ps import main

if __name__ == "__main__":
    sys.exit(main())
