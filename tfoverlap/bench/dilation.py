"""Time dilation of emulated runs: how busy the host's CPUs are, and which dilation K keeps
them below about 60%.

With emulated accelerators every emulated duration is multiplied by K and every link rate
divided by K; what the host itself spends per step (moving bytes, the ops that stay real,
the runtime) does not scale, so a large enough K makes it small against the step, as on a
cluster whose compute runs on accelerators. The benchmarks start from a small K, measure
the host's CPU over a few steps (from /proc/stat: all processes, steal time counted as
busy, since it is time this machine's jobs could not have) and raise K until the CPUs are
at most :data:`BUSY_LIMIT` busy.
"""
from __future__ import annotations

import math

__all__ = ["BUSY_LIMIT", "FIRST_DILATION", "cpu_sample", "busy_fraction", "next_dilation",
           "parse_dilation"]

BUSY_LIMIT = 0.6
BUSY_TARGET = 0.45
FIRST_DILATION = 4.0
MAX_DILATION = 400.0


def cpu_sample() -> tuple[int, int]:
    """(busy, total) jiffies of all CPUs since boot."""
    with open("/proc/stat") as stream:
        fields = [int(v) for v in stream.readline().split()[1:]]
    idle = fields[3] + (fields[4] if len(fields) > 4 else 0)       # idle + iowait
    total = sum(fields[:8])                                           # up to steal
    return total - idle, total


def busy_fraction(before: tuple[int, int], after: tuple[int, int]) -> float:
    """Share of the CPUs' time between two samples that was busy."""
    total = after[1] - before[1]
    return (after[0] - before[0]) / total if total > 0 else 0.0


def next_dilation(dilation: float, busy: float) -> float | None:
    """The dilation to try after one that left the CPUs ``busy``; None when it is fine.

    Below saturation the host's work per step is about constant, so the busy share falls
    as 1/K; saturated (over 90%), it says nothing about how far, so K grows fourfold."""
    if busy <= BUSY_LIMIT or dilation >= MAX_DILATION:
        return None
    factor = 4.0 if busy > 0.9 else busy / BUSY_TARGET
    return float(min(MAX_DILATION, _round_up(dilation * factor)))


def _round_up(value: float) -> float:
    """Up to two significant digits (a dilation that reads well in a table)."""
    scale = 10 ** max(0, math.floor(math.log10(value)) - 1)
    return math.ceil(value / scale) * scale


def parse_dilation(text: str, emulate: str) -> float | None:
    """--dilation: None for "auto" (emulated runs), else a number >= 1; ValueError also
    names a bad --emulate (before any process starts)."""
    if emulate:
        from tfoverlap.costs.accelerators import load_device_model
        load_device_model(emulate)
    if text == "auto":
        return None if emulate else 1.0
    try:
        dilation = float(text)
    except ValueError:
        dilation = float("nan")
    if not dilation >= 1 or dilation == float("inf"):
        raise ValueError(f"--dilation must be 'auto' or a number >= 1, got {text!r}")
    return dilation
