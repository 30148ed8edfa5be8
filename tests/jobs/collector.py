"""Python's cyclic garbage collector for the test processes that build many TensorFlow
graphs: the pytest process itself and the Horovod job processes (in_sequence.py).

At its default threshold (700 allocations) the collector ran some 7,400 times in a rank
of the suite's 2-rank job (run alone), 22 of them over the whole heap of traced graphs:
14-15 of the rank's 216-226 CPU-seconds. At 50,000 it ran 80 times, in 4 CPU-seconds,
and the rank's peak memory stayed 2.5 GB. In the pytest process of the unit tier it took
6.3 of 44 CPU-seconds, and 1.9 at 50,000.
"""
import gc

THRESHOLD = (50_000, 20, 10)


def collect_less_often() -> None:
    gc.set_threshold(*THRESHOLD)
