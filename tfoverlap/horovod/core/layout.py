"""The bucket layout of decoupled reduction, for both backends: where each variable of a
bucket sits in its flat, padded vector, and which shard each rank owns."""
from __future__ import annotations

import dataclasses
import math

__all__ = ["BucketLayout", "flattened", "padded"]


@dataclasses.dataclass(frozen=True)
class BucketLayout:
    """``members``: pair indices; ``counts``: their element counts, in that order (flat
    offsets follow); ``shard``: elements per rank (the vector is padded to ranks x shard)."""

    members: tuple[int, ...]
    counts: tuple[int, ...]
    shard: int

    @classmethod
    def of(cls, members, counts, ranks: int) -> "BucketLayout":
        total = sum(counts)
        return cls(tuple(members), tuple(counts), max(1, math.ceil(total / ranks)))

    @property
    def total(self) -> int:
        return sum(self.counts)

    def owned(self, rank: int) -> list[tuple[int, int, int]]:
        """(position in ``members``, first element, end element) of each variable's part
        in ``rank``'s shard."""
        low, high = rank * self.shard, (rank + 1) * self.shard
        parts, offset = [], 0
        for position, count in enumerate(self.counts):
            first, end = max(low, offset), min(high, offset + count)
            if first < end:
                parts.append((position, first - offset, end - offset))
            offset += count
        return parts

    def split(self, flat) -> list:
        """(member, its flat values) of the bucket's flat whole vector ``flat``."""
        import tensorflow as tf
        return list(zip(self.members, tf.split(flat[:self.total], list(self.counts))))

    def shard_of(self, rank: int, value_of):
        """``rank``'s shard of the bucket: each member's part that it owns (``value_of(i)``:
        member ``i``'s tensor), zero-padded to ``shard`` elements."""
        import tensorflow as tf
        parts = [tf.slice(flattened(value_of(self.members[position])), [first], [end - first])
                 for position, first, end in self.owned(rank)]
        owned = sum(end - first for _, first, end in self.owned(rank))
        if owned < self.shard:
            parts.append(tf.zeros([self.shard - owned]))
        return parts[0] if len(parts) == 1 else tf.concat(parts, 0)


def flattened(tensor):
    import tensorflow as tf
    return tf.reshape(tensor, [-1])


def padded(tensors, length: int):
    """The flat concatenation of ``tensors``, zero-padded to ``length`` elements."""
    import tensorflow as tf
    flat = [flattened(t) for t in tensors]
    missing = length - sum(int(f.shape[0]) for f in flat)
    if missing:
        flat.append(tf.zeros([missing], flat[0].dtype))
    return flat[0] if len(flat) == 1 else tf.concat(flat, 0)
