"""TicTac's transfer orderings (Hashemi et al., MLSys 2019), on plain data.

Inputs are per-op *dependency sets*: for each compute op, the set of outstanding transfers
it transitively needs, as a Python int bitset (bit r = transfer r). From them:

- ``M(r)``  transfer time of r,
- ``P(r)``  compute time of the ops whose only outstanding dependency is r,
- ``M+(r)`` over ops that need r and other outstanding transfers, the minimum summed
  transfer time of what they need (infinity if there is none).

TIC: unit transfer times, zero compute; static priority M+ (ascending). TAC: repeatedly
pick the transfer that goes first by Johnson's two-machine flow-shop rule ("A before B iff
min(P_B, M_A) < min(P_A, M_B)"), ties by smaller M+, then recompute over what is left.

Ops sharing a dependency set are merged first, so the work per pick is over distinct
sets (K, usually O(R)) rather than over all N ops, with numpy over a K x R matrix that
shrinks as transfers and satisfied sets drop out.

Both orders also respect *precedence*: a transfer whose source itself depends on other
transfers is never ordered before them.
"""
from __future__ import annotations

import dataclasses
import heapq
from typing import Sequence

import numpy as np

__all__ = ["DependencySets", "group_dependency_sets", "tic_order", "tac_order",
           "transfer_priorities", "release_groups", "release_groups_per_link"]


@dataclasses.dataclass
class DependencySets:
    """Distinct dependency sets of the compute ops.

    matrix[k, r]:  set k contains transfer r.
    compute[k]:    total compute time of the ops whose dependency set is k.
    """

    matrix: np.ndarray
    compute: np.ndarray

    @property
    def num_transfers(self) -> int:
        return self.matrix.shape[1]


def bits_to_rows(bitsets: Sequence[int], width: int) -> np.ndarray:
    """Python int bitsets -> bool matrix (len(bitsets) x width); bit r -> column r."""
    num_bytes = max(1, (width + 7) // 8)
    raw = b"".join(bits.to_bytes(num_bytes, "little") for bits in bitsets)
    packed = np.frombuffer(raw, dtype=np.uint8).reshape(len(bitsets), num_bytes)
    return np.unpackbits(packed, axis=1, bitorder="little")[:, :width].astype(bool)


def group_dependency_sets(op_dependencies: Sequence[int], op_times: Sequence[float] | None,
                          num_transfers: int) -> DependencySets:
    """Merges ops with equal dependency sets; ops that need no transfer are dropped."""
    totals: dict[int, float] = {}
    for index, bits in enumerate(op_dependencies):
        if bits:
            totals[bits] = totals.get(bits, 0.0) + (op_times[index] if op_times is not None
                                                    else 0.0)
    keys = list(totals)
    matrix = (bits_to_rows(keys, num_transfers) if keys
              else np.zeros((0, num_transfers), dtype=bool))
    return DependencySets(matrix=matrix, compute=np.array([totals[k] for k in keys], float))


def _min_plus(matrix: np.ndarray, counts: np.ndarray,
              sums: np.ndarray) -> tuple[np.ndarray, np.ndarray]:
    """M+ per column: min of ``sums`` over rows with counts > 1 that contain the column.

    Rows are visited cheapest first (ties by row index), so each column's M+ is the sum of
    the first row that contains it: a short-circuiting argmax over bools instead of a
    K x R float minimum. Also returns that row's rank in this visiting order (the set that
    *completes* the column first; infinity if none): transfers completed by the same set
    share it.
    """
    multi = np.flatnonzero(counts > 1)
    if multi.size == 0:
        return np.full(matrix.shape[1], np.inf), np.full(matrix.shape[1], np.inf)
    cheapest_first = multi[np.argsort(sums[multi], kind="stable")]
    by_column = np.ascontiguousarray(matrix[cheapest_first].T)
    first = by_column.argmax(axis=1)
    contains = by_column[np.arange(by_column.shape[0]), first]
    return (np.where(contains, sums[cheapest_first][first], np.inf),
            np.where(contains, first.astype(float), np.inf))


def _precedence_counts(source_dependencies: Sequence[int], num_transfers: int):
    blockers = [0] * num_transfers
    unblocks: list[list[int]] = [[] for _ in range(num_transfers)]
    for transfer, bits in enumerate(source_dependencies):
        bits &= ~(1 << transfer)
        while bits:
            low = bits & -bits
            blocker = low.bit_length() - 1
            blockers[transfer] += 1
            unblocks[blocker].append(transfer)
            bits ^= low
    return blockers, unblocks


def transfer_priorities(sets: DependencySets) -> tuple[np.ndarray, np.ndarray, np.ndarray]:
    """TIC's static keys: (M+ with unit transfer times, the set that completes it, min
    transfers needed by any op).

    The second key keeps transfers that complete the same op together (in TicTac's par
    model, both kernels of branch 0 before any of branch 1, so branch 0 can start after
    two transfers rather than after all first layers). The third breaks the remaining
    ties (the first two layers of a chain share M+ = 2 and the completing set, but only
    the first layer's op can start after one transfer).
    """
    counts = sets.matrix.sum(axis=1).astype(float)
    min_plus, completing_set = _min_plus(sets.matrix, counts, counts)
    if len(counts):
        min_any = np.where(sets.matrix, counts[:, None], np.inf).min(axis=0)
    else:
        min_any = np.full(sets.num_transfers, np.inf)
    return min_plus, completing_set, min_any


def tic_order(sets: DependencySets, source_dependencies: Sequence[int] = (),
              tiebreak: Sequence[float] | None = None) -> list[int]:
    """TIC: transfers by ascending M+ (unit costs), precedence respected.

    Ties: transfers completed by the same set together, fewer transfers needed by some op
    first, then ``tiebreak`` (e.g. the topological position of the first consumer), then
    transfer index.
    """
    num = sets.num_transfers
    min_plus, completing_set, min_any = transfer_priorities(sets)
    tiebreak = np.zeros(num) if tiebreak is None else np.asarray(tiebreak, float)
    blockers, unblocks = _precedence_counts(source_dependencies or [0] * num, num)
    def key(r):
        return (min_plus[r], completing_set[r], min_any[r], tiebreak[r], r)

    heap = [key(r) for r in range(num) if blockers[r] == 0]
    heapq.heapify(heap)
    order = []
    while heap:
        *_, transfer = heapq.heappop(heap)
        order.append(transfer)
        for waiting in unblocks[transfer]:
            blockers[waiting] -= 1
            if blockers[waiting] == 0:
                heapq.heappush(heap, key(waiting))
    if len(order) != num:
        raise ValueError("transfer precedences form a cycle")
    return order


def tac_order(sets: DependencySets, transfer_times: Sequence[float],
              source_dependencies: Sequence[int] = (),
              tiebreak: Sequence[float] | None = None) -> list[int]:
    """TAC: repeatedly pick by Johnson's rule over the outstanding transfers.

    Key per candidate r: (0, M_r) if M_r < P_r (a transfer that unblocks more compute than
    it costs goes early, shortest first), else (1, -P_r) (longest compute first); ties by
    smaller M+, then ``tiebreak``, then index. P and M+ are recomputed after every pick;
    M+ only for the candidates tied on Johnson's key, since it only breaks those ties.
    """
    num = sets.num_transfers
    transfer_times = np.asarray(transfer_times, float)
    tiebreak = np.zeros(num) if tiebreak is None else np.asarray(tiebreak, float)
    blockers, unblocks = _precedence_counts(source_dependencies or [0] * num, num)
    eligible = np.array([b == 0 for b in blockers])
    outstanding = np.ones(num, bool)

    matrix = sets.matrix.copy()
    compute = sets.compute
    columns = np.arange(num)          # original transfer id of each column of ``matrix``
    counts = matrix.sum(axis=1)
    sums = matrix.astype(float) @ transfer_times
    order: list[int] = []
    while len(order) < num:
        single = counts == 1
        unblocked = compute[single] @ matrix[single] if single.any() else np.zeros(columns.size)
        times = transfer_times[columns]
        group = np.where(times < unblocked, 0, 1)
        value = np.where(group == 0, times, -unblocked)
        tied = np.flatnonzero(eligible[columns] & outstanding[columns])
        if tied.size == 0:
            raise ValueError("transfer precedences form a cycle")
        tied = tied[group[tied] == group[tied].min()]
        tied = tied[value[tied] == value[tied].min()]
        if tied.size > 1:
            min_plus, _ = _min_plus(matrix[:, tied], counts, sums)
            tied = tied[np.lexsort((columns[tied], tiebreak[columns[tied]], min_plus))]
        best = tied[0]
        picked = int(columns[best])
        order.append(picked)
        outstanding[picked] = False
        for waiting in unblocks[picked]:
            blockers[waiting] -= 1
            eligible[waiting] = blockers[waiting] == 0
        in_set = matrix[:, best].copy()
        counts = counts - in_set
        sums = sums - in_set * transfer_times[picked]
        matrix[:, best] = False
        # Compact now and then: drop picked columns and satisfied sets.
        if 2 * (num - len(order)) < columns.size or 2 * np.count_nonzero(counts) < counts.size:
            keep_rows = counts > 0
            keep_columns = outstanding[columns]
            matrix = matrix[keep_rows][:, keep_columns]
            compute, counts, sums = compute[keep_rows], counts[keep_rows], sums[keep_rows]
            columns = columns[keep_columns]
    return order


def release_groups(sizes: Sequence[float], credit: float) -> list[list[int]]:
    """Cuts an order (``sizes[k]``: bytes of the k-th transfer in it) into release groups.

    Consecutive transfers go together while their bytes stay within ``credit``; a group
    always holds at least one transfer, so a transfer larger than the credit goes alone.
    A credit of 0 makes every transfer a group of its own. Returns the positions of each
    group, in order.
    """
    if credit < 0:
        raise ValueError(f"credit must be non-negative, got {credit}")
    groups: list[list[int]] = []
    group_bytes = 0.0
    for position, size in enumerate(sizes):
        if groups and credit > 0 and group_bytes + size <= credit:
            groups[-1].append(position)
            group_bytes += size
        else:
            groups.append([position])
            group_bytes = size
    return groups


def release_groups_per_link(sizes: Sequence[float], links: Sequence, credit: float
                            ) -> list[tuple[object, list[list[int]]]]:
    """(link, its release groups) for each link, in the order links first appear: the order
    (``sizes[k]``, ``links[k]``: bytes and link of its k-th transfer) restricted to one link,
    cut as :func:`release_groups` cuts it. Positions are the whole order's."""
    if len(sizes) != len(links):
        raise ValueError("sizes and links must have one entry per transfer")
    positions_of: dict = {}
    for position, link in enumerate(links):
        positions_of.setdefault(link, []).append(position)
    return [(link, [[positions[k] for k in group]
                    for group in release_groups([sizes[p] for p in positions], credit)])
            for link, positions in positions_of.items()]
