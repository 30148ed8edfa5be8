"""Benchmark metrics on plain numbers (seconds, orders); no TensorFlow here.

Definitions, as reported in ``docs/benchmarks.md``:

- iteration time: median of the per-step wall times of all workers; spread: p10-p90.
- speed-up over a baseline: ratio of medians, with a 95% bootstrap confidence interval
  (over single steps), and the range of the ratios of the rounds (each round's steps of
  the variant against the baseline's of the same round: what a round's shared state, the
  network and the host, does to a ratio, which the steps' interval does not see).
- scheduling efficiency (TicTac): ``E = (U_max - U) / (U_max - U_min)`` with
  ``U_max = comm + comp`` (no overlap) and ``U_min = max(comm, comp)`` (full overlap).
- straggler effect: per block of steps run together, the slowest worker's mean step time
  over the fastest's, minus one; the median over blocks.
- order consistency: how many traced steps followed the most common transfer order.
"""
from __future__ import annotations

import collections
import dataclasses
import math
from typing import Sequence

import numpy as np

__all__ = ["Spread", "spread", "speedup", "round_ratios", "after_first_steps", "efficiency",
           "straggler_effect", "order_consistency"]


@dataclasses.dataclass(frozen=True)
class Spread:
    median: float
    p10: float
    p90: float
    count: int


def spread(values: Sequence[float]) -> Spread:
    """Median and 10th/90th percentiles of ``values`` (at least one)."""
    data = np.asarray(values, dtype=float)
    if data.size == 0:
        raise ValueError("spread of no values")
    p10, median, p90 = np.percentile(data, [10, 50, 90])
    return Spread(float(median), float(p10), float(p90), int(data.size))


def speedup(baseline: Sequence[float], variant: Sequence[float], resamples: int = 2000,
            confidence: float = 0.95, seed: int = 0) -> tuple[float, float, float]:
    """``median(baseline) / median(variant)`` and its bootstrap confidence interval.

    Both samples are resampled independently (percentile bootstrap). Returns
    ``(ratio, low, high)``; a variant faster than the baseline has a ratio above 1.
    """
    base, other = np.asarray(baseline, float), np.asarray(variant, float)
    if base.size == 0 or other.size == 0:
        raise ValueError("speed-up needs samples of both variants")
    if np.any(base <= 0) or np.any(other <= 0):
        raise ValueError("iteration times must be positive")
    rng = np.random.default_rng(seed)
    base_medians = np.median(rng.choice(base, (resamples, base.size)), axis=1)
    other_medians = np.median(rng.choice(other, (resamples, other.size)), axis=1)
    ratios = base_medians / other_medians
    tail = (1 - confidence) / 2 * 100
    low, high = np.percentile(ratios, [tail, 100 - tail])
    return float(np.median(base) / np.median(other)), float(low), float(high)


def round_ratios(baseline: Sequence[float], variant: Sequence[float],
                 rounds: int) -> list[float]:
    """``median(baseline) / median(variant)`` of each round: both samples hold ``rounds``
    equal runs of steps, in round order (the steps of one round ran back to back, the
    variants interleaved)."""
    base, other = np.asarray(baseline, float), np.asarray(variant, float)
    if rounds < 1 or base.size % rounds or other.size % rounds or not base.size:
        raise ValueError(f"round ratios need samples of {rounds} equal rounds, got "
                         f"{base.size} and {other.size} steps")
    return [float(np.median(b) / np.median(o))
            for b, o in zip(base.reshape(rounds, -1), other.reshape(rounds, -1))]


def after_first_steps(values: Sequence[float], steps_per_block: int) -> list[float]:
    """The steps of ``values`` (blocks of ``steps_per_block`` steps, back to back) that
    are not the first of their block.

    Every block starts with the workers in lock step (the driver starts them together);
    the later steps run as far apart as the workers drift, as a long job's steps do, so a
    gain that holds only in a block's first step is not a long job's gain.
    """
    if steps_per_block < 2 or len(values) % steps_per_block:
        raise ValueError(f"steps after the first need blocks of 2 or more steps, got "
                         f"{len(values)} steps in blocks of {steps_per_block}")
    return [value for index, value in enumerate(values) if index % steps_per_block]


def efficiency(iteration: float, comm: float, comp: float) -> float:
    """TicTac's E for a measured iteration time; NaN when comm or comp is zero.

    1 means the iteration took only as long as the longer of communication and
    computation (full overlap), 0 as long as both in sequence. Measured values can leave
    [0, 1] by noise or by effects outside the model (e.g. contention); they are not clipped.
    """
    if comm < 0 or comp < 0 or iteration <= 0:
        raise ValueError("efficiency needs non-negative comm/comp and a positive iteration")
    upper, lower = comm + comp, max(comm, comp)
    if upper == lower:
        return math.nan
    return (upper - iteration) / (upper - lower)


def straggler_effect(blocks: Sequence[Sequence[float]]) -> float:
    """Median over blocks of (slowest worker's mean step / fastest worker's) - 1.

    ``blocks[b][w]`` is worker w's mean step time in block b (the steps the workers ran
    together). 0 means the workers kept pace.
    """
    ratios = [max(block) / min(block) - 1 for block in blocks if len(block) > 1]
    if not ratios:
        raise ValueError("straggler effect needs blocks with two or more workers")
    return float(np.median(ratios))


def order_consistency(orders: Sequence[Sequence[str]]) -> tuple[int, float]:
    """``(distinct orders, share of steps that followed the most common one)``."""
    if not orders:
        raise ValueError("order consistency of no traced steps")
    counts = collections.Counter(tuple(order) for order in orders)
    return len(counts), counts.most_common(1)[0][1] / len(orders)
