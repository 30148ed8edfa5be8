"""The network model: how long a transfer or a ring AllReduce takes (alpha-beta)."""
from __future__ import annotations

__all__ = ["estimate_transfer_seconds", "ring_allreduce_seconds"]


def estimate_transfer_seconds(num_bytes: int | None, bandwidth: float) -> float:
    """bytes / bandwidth; an unknown size counts as one 4-byte scalar."""
    return (num_bytes if num_bytes is not None else 4) / bandwidth


def ring_allreduce_seconds(num_bytes, ranks: int, bandwidth: float, latency: float):
    """Time of a ring AllReduce of ``num_bytes`` over ``ranks`` ranks (alpha-beta model):
    ``2 (n-1) latency + 2 (n-1)/n * bytes / bandwidth``; 0 for one rank. Works elementwise
    on numpy arrays of sizes."""
    if ranks <= 1:
        return num_bytes * 0.0
    return 2 * (ranks - 1) / ranks * num_bytes / bandwidth + 2 * (ranks - 1) * latency
