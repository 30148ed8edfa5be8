"""Caramel's network-aware batching of AllReduce (Hashemi et al.), on plain data.

Gradients become ready one after another during the backward pass; Horovod reduces them
on one background thread, one request after another. Each request costs a ring AllReduce:
``2 (n-1) alpha + 2 (n-1)/n * bytes / bandwidth``. Small requests waste the latency term,
one big request at the end overlaps nothing. The plan here picks bucket boundaries (a
bucket is a run of consecutive gradients in ready order, reduced as one grouped request
launched when its last gradient is ready and the previous request is done) that minimize
when the last request finishes, by dynamic programming over the ready order. Gradients
larger than ``chunk_bytes`` are split into pieces first, so that a bucket may end inside a
large tensor and its first part travels while the rest of the bucket is still computing.
"""
from __future__ import annotations

import dataclasses
import math
from typing import Sequence

import numpy as np

from tfoverlap.costs.network import ring_allreduce_seconds

__all__ = ["Piece", "Bucket", "plan_buckets", "horovod_default_buckets", "step_end",
           "HOROVOD_FUSION_BYTES"]

HOROVOD_FUSION_BYTES = 128 * 2 ** 20     # Horovod's default fusion buffer


@dataclasses.dataclass(frozen=True)
class Piece:
    """Bytes [offset, offset + size) of gradient ``gradient``."""

    gradient: int
    offset: int
    size: int


@dataclasses.dataclass(frozen=True)
class Bucket:
    pieces: tuple[Piece, ...]
    ready: float          # when its last piece is ready
    start: float          # planned launch: max(ready, previous bucket's finish)
    finish: float

    @property
    def size(self) -> int:
        return sum(piece.size for piece in self.pieces)


def _pieces(sizes: Sequence[int], ready: Sequence[float], chunk_bytes: float):
    pieces, times = [], []
    for gradient, (size, time) in enumerate(zip(sizes, ready)):
        count = max(1, math.ceil(size / chunk_bytes)) if chunk_bytes < math.inf else 1
        step = math.ceil(size / count) if size else 0
        for index in range(count):
            offset = index * step
            pieces.append(Piece(gradient, offset, max(0, min(step, size - offset))))
            times.append(time)
    return pieces, np.array(times, float)


def plan_buckets(sizes: Sequence[int], ready: Sequence[float], ranks: int, bandwidth: float,
                 latency: float, chunk_bytes: float = math.inf,
                 tails: Sequence[float] | None = None, threads: int = 1,
                 max_bucket_bytes: float = math.inf) -> list[Bucket]:
    """Buckets, in launch order, that minimize when the step can end.

    ``sizes[i]``/``ready[i]``: bytes of gradient i and when it is ready, in ready order
    (``ready`` must not decrease). ``tails[i]``: compute that must follow gradient i's
    reduction (its variable update); a bucket's tail is the longest of its gradients' tails
    or their sum over ``threads`` (the updates share the compute threads), and the step ends
    at the latest ``finish + tail`` over the buckets. Without tails the plan is optimal
    among all consecutive bucketings (dynamic programming over the ready order); with tails
    the program keeps, per prefix, the plan with the earliest end and then the earliest
    finish, and the result is never worse than
    Horovod's own fusion (:func:`horovod_default_buckets`), which is taken if it is better.
    ``max_bucket_bytes`` caps a bucket of several pieces (one piece may exceed it): smaller
    requests pipeline, as the reduction of one overlaps the copies of the next.

    Raises:
      ValueError: inconsistent lengths, a decreasing ready time, or a bad network value.
    """
    if len(sizes) != len(ready) or (tails is not None and len(tails) != len(sizes)):
        raise ValueError("sizes, ready times and tails differ in length")
    if (ranks < 1 or not bandwidth > 0 or latency < 0 or not chunk_bytes > 0
            or not max_bucket_bytes > 0):
        raise ValueError("need ranks >= 1, bandwidth > 0, latency >= 0, chunk_bytes > 0, "
                         "max_bucket_bytes > 0")
    if any(b < a for a, b in zip(ready, ready[1:])):
        raise ValueError("gradients must be given in ready order")
    if any(size < 0 for size in sizes):
        raise ValueError("gradient sizes must be non-negative")
    if not sizes:
        return []
    tails = [0.0] * len(sizes) if tails is None else list(tails)
    pieces, times = _pieces(sizes, ready, chunk_bytes)
    # A gradient's tail follows its last piece.
    piece_tails = np.array([tails[p.gradient] if p.offset + p.size >= sizes[p.gradient] else 0.0
                            for p in pieces], float)
    tail_sums = np.concatenate([[0.0], np.cumsum(piece_tails)])
    count = len(pieces)
    prefix = np.concatenate([[0.0], np.cumsum([p.size for p in pieces], dtype=float)])
    finish = np.zeros(count + 1)
    worst = np.zeros(count + 1)          # the latest finish + tail of the prefix's plan
    choice = np.zeros(count + 1, dtype=np.int64)
    for end in range(1, count + 1):
        # The last bucket is pieces[first:end]; every first at once.
        launch = np.maximum(finish[:end], times[end - 1])
        done = launch + ring_allreduce_seconds(prefix[end] - prefix[:end], ranks, bandwidth,
                                               latency)
        bucket_tail = np.maximum(np.maximum.accumulate(piece_tails[:end][::-1])[::-1],
                                 (tail_sums[end] - tail_sums[:end]) / threads)
        ends = np.maximum(worst[:end], done + bucket_tail)
        too_big = (prefix[end] - prefix[:end] > max_bucket_bytes) & (np.arange(end) < end - 1)
        ends[too_big] = np.inf
        best = ends.min()
        # Among equally good plans (within float noise): the earliest finish, then the
        # largest last bucket.
        tied = np.flatnonzero(ends <= best * (1 + 1e-12) + 1e-15)
        first = int(tied[np.argmin(done[tied])])
        choice[end], finish[end], worst[end] = first, done[first], best
    bounds = []
    end = count
    while end > 0:
        bounds.append((choice[end], end))
        end = choice[end]
    bounds.reverse()
    buckets = _launch([_joined(pieces[first:last]) for first, last in bounds], ready, ranks,
                      bandwidth, latency)
    fallback = horovod_default_buckets(sizes, ready, ranks, bandwidth, latency,
                                       fusion_bytes=min(HOROVOD_FUSION_BYTES,
                                                        max_bucket_bytes))
    if step_end(fallback, tails, threads) < step_end(buckets, tails, threads) * (1 - 1e-12):
        return fallback
    return buckets


def _joined(pieces: Sequence[Piece]) -> tuple[Piece, ...]:
    """Adjacent pieces of one gradient in one bucket travel as one piece."""
    joined: list[Piece] = []
    for piece in pieces:
        last = joined[-1] if joined else None
        if last and last.gradient == piece.gradient and last.offset + last.size == piece.offset:
            joined[-1] = Piece(piece.gradient, last.offset, last.size + piece.size)
        else:
            joined.append(piece)
    return tuple(joined)


def _launch(groups, ready, ranks, bandwidth, latency) -> list[Bucket]:
    """Buckets of ``groups`` launched in order, each when ready and the thread is free."""
    buckets, previous = [], 0.0
    for members in groups:
        ready_at = float(ready[members[-1].gradient])
        start = max(previous, ready_at)
        previous = start + ring_allreduce_seconds(sum(p.size for p in members), ranks,
                                                  bandwidth, latency)
        buckets.append(Bucket(members, ready_at, start, previous))
    return buckets


def step_end(buckets: Sequence[Bucket], tails: Sequence[float], threads: int = 1) -> float:
    """When the step ends under a plan: the latest bucket finish plus its tail (see
    :func:`plan_buckets`)."""
    last_bucket = {piece.gradient: index for index, bucket in enumerate(buckets)
                   for piece in bucket.pieces}          # a gradient's tail follows its last piece
    own: list[list[float]] = [[] for _ in buckets]
    for gradient, index in last_bucket.items():
        own[index].append(tails[gradient])
    ends = [bucket.finish + max(max(mine, default=0.0), sum(mine) / threads)
            for bucket, mine in zip(buckets, own)]
    return max(ends, default=0.0)


def horovod_default_buckets(sizes: Sequence[int], ready: Sequence[float], ranks: int,
                            bandwidth: float, latency: float,
                            fusion_bytes: float = HOROVOD_FUSION_BYTES,
                            cycle_seconds: float = 1e-3) -> list[Bucket]:
    """What Horovod does by default, for comparison: every cycle its background thread
    fuses whatever is ready (up to the fusion buffer) into one request, once the previous
    request is done."""
    if len(sizes) != len(ready):
        raise ValueError("sizes and ready times differ in length")
    buckets: list[Bucket] = []
    free_at, index = 0.0, 0
    while index < len(sizes):
        # The first cycle boundary at which the thread is free and something is ready.
        now = max(free_at, ready[index])
        now = math.ceil(now / cycle_seconds - 1e-9) * cycle_seconds if cycle_seconds else now
        members, total = [], 0
        while index < len(sizes) and ready[index] <= now + 1e-12 and (
                not members or total + sizes[index] <= fusion_bytes):
            members.append(Piece(index, 0, int(sizes[index])))
            total += sizes[index]
            index += 1
        free_at = now + ring_allreduce_seconds(total, ranks, bandwidth, latency)
        buckets.append(Bucket(tuple(members), float(ready[members[-1].gradient]), now, free_at))
    return buckets
