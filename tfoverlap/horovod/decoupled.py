"""Decoupled reduction (``tfoverlap.horovod.configure(decouple=True)``, graph mode).

An AllReduce is a reduce-scatter followed by an all-gather. Here the two halves go where
each overlaps best (:mod:`tfoverlap.planning.decoupled` plans them):

- **In the train run**, each bucket of gradients (Caramel's buckets, priced as
  reduce-scatters) is flattened and reduce-scattered as the backward pass produces it.
  Each rank then updates its own 1/n of the bucket: the parameters of that shard are
  copied from the variables into a flat shard variable, and the program's own optimizer
  applies the averaged shard gradient to it, with optimizer state (Momentum's
  accumulator, Adam's moments) for the shard only. The updated shard is stored.
- **When the train run returns**, a background run of the same session (on every rank
  alike, as cross-step overlap's reductions: :func:`~tfoverlap.horovod.deferred.\
register_pending`) all-gathers the stored shards, first layers first, in a few requests.
- **Every op that uses a variable** (the next step's forward pass, a validation loss, a
  Saver, Horovod's broadcast) first runs its chunk's apply: where an update is pending,
  it takes the gathered parameters and assigns them to the variables; else nothing.

So every value a program can read of its variables is plain Horovod's (elementwise
optimizers compute each element alike on a shard and on the whole tensor; past 2 ranks,
up to the order in which the reduce-scatter adds the ranks' gradients), half of the
bytes move under the backward pass and half under the next forward pass, and optimizer
memory falls by the number of ranks.

Decoupled: ``GradientDescentOptimizer``, ``MomentumOptimizer`` and ``AdamOptimizer`` with
float32 resource variables, dense gradients and no compression, where the gradient given
to apply_gradients is the reduced gradient alone. Anything else trains without it
(cross-step overlap where configured, else the in-step plan), with one line saying why.
Not yet: checkpoints of the sharded optimizer state (a Saver writes each rank's own shard
of it), Keras and ``tf.function`` steps.
"""
from __future__ import annotations

import dataclasses
import logging
import math

from tfoverlap.horovod.deferred import (DEFERRABLE_OPTIMIZERS, deferral_refused,
                                        mark_deferred, not_reduced_alone, pending_summaries,
                                        register_pending)
from tfoverlap.log import logger

__all__ = ["decoupling_refused", "decouple_updates", "decoupling_summary",
           "DECOUPLABLE_OPTIMIZERS", "BucketLayout"]

DECOUPLABLE_OPTIMIZERS = DEFERRABLE_OPTIMIZERS


def decoupling_refused(optimizer, variables, reduced, compression) -> str:
    """Why updates of ``optimizer`` to ``variables`` with the ``reduced`` gradients cannot
    be decoupled ("" if they can)."""
    import horovod.tensorflow as hvd
    import tensorflow as tf
    refused = deferral_refused(optimizer, variables, reduced, compression)
    if refused:
        return refused
    if compression is not hvd.Compression.none:
        return "compression: only uncompressed gradients are reduce-scattered"
    odd = next((v for v in variables if v.dtype.base_dtype != tf.float32), None)
    if odd is not None:
        return f"{odd.op.name} is {odd.dtype.base_dtype.name}: only float32 is decoupled"
    return ""


@dataclasses.dataclass(frozen=True)
class BucketLayout:
    """Where a bucket's variables sit in its flat vector, and the shard each rank owns.

    ``members``: pair indices; ``counts``: their element counts, in that order (flat
    offsets follow); ``shard``: elements per rank (the vector is padded to ranks x
    shard)."""

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


def _flat(tensor):
    import tensorflow as tf
    return tf.reshape(tensor, [-1])


def _padded(tensors, length: int):
    """The flat concatenation of ``tensors``, zero-padded to ``length`` elements."""
    import tensorflow as tf
    flat = [_flat(t) for t in tensors]
    missing = length - sum(int(f.shape[0]) for f in flat)
    if missing:
        flat.append(tf.zeros([missing], flat[0].dtype))
    return flat[0] if len(flat) == 1 else tf.concat(flat, 0)


def decouple_updates(optimizer, grads_and_vars, local, reduced, allreduces, buckets,
                     gathers, apply_in_step, process_set,
                     refusal_level: int = logging.WARNING):
    """Builds the step of ``optimizer`` (wrapped by Horovod) decoupled; returns its train
    op (None, with one line at ``refusal_level``, where it cannot be).

    ``grads_and_vars``: what the program passed to apply_gradients. ``local[i]``,
    ``reduced[i]`` and ``allreduces[i]`` are pair ``i``'s unreduced gradient, reduced
    gradient and HorovodAllreduce op (left unrun). ``buckets``: lists of pair indices in
    the order the backward pass makes them; ``gathers``: lists of bucket indices, first
    needed first. ``apply_in_step(pairs)`` is the wrapped optimizer's apply_gradients."""
    import horovod.tensorflow as hvd
    import tensorflow as tf
    pairs = list(grads_and_vars)
    refused = not_reduced_alone(pairs, reduced, range(len(pairs)))
    if refused:
        logger.log(refusal_level, "tfoverlap: decouple: %s; nothing decoupled", refused)
        return None
    if sorted(i for bucket in buckets for i in bucket) != list(range(len(pairs))):
        raise ValueError("the buckets must hold every pair once")
    ranks, rank = process_set.size(), process_set.rank()
    variables = [variable for _, variable in pairs]
    layouts = [BucketLayout.of(bucket, [variables[i].shape.num_elements() for i in bucket],
                               ranks) for bucket in buckets]
    graph = variables[0].graph
    name = graph.unique_name("tfoverlap/decoupled", mark_as_used=True)
    first_op = len(graph.get_operations())
    with tf.control_dependencies(None), graph.name_scope(name + "/"):
        stored = [tf.queue.FIFOQueue(1, [tf.float32], [[layout.shard]], name=f"stored{b}")
                  for b, layout in enumerate(layouts)]
        gathered = [tf.queue.FIFOQueue(1, [tf.float32], [[ranks * layout.shard]],
                                       name=f"gathered{b}") for b, layout in enumerate(layouts)]
        tokens = [tf.queue.FIFOQueue(1, [tf.bool], [[]], name=f"token{c}")
                  for c in range(len(gathers))]
        guard_of, applies, enqueues, chained = {}, [], [], []
        for number, chunk in enumerate(gathers):
            with graph.name_scope(f"gather{number}"):
                with tf.control_dependencies(chained):       # first layers first
                    shards = [stored[b].dequeue() for b in chunk]
                whole = hvd.grouped_allgather(shards, process_set=process_set)
                enqueues += [gathered[b].enqueue([t]) for b, t in zip(chunk, whole)]
                chained = whole
                applies.append(_pending_apply(tokens[number], [gathered[b] for b in chunk],
                                              [layouts[b] for b in chunk], variables))
                for b in chunk:
                    for i in layouts[b].members:
                        guard_of[variables[i].handle.name] = applies[-1]
        background = tf.group(*enqueues, name="gather")
        close = tf.group(*[queue.close(cancel_pending_enqueues=True)
                           for queue in stored + gathered + tokens], name="close")
    own = frozenset(op.name for op in graph.get_operations()[first_op:])
    for allreduce in allreduces:
        mark_deferred(allreduce)         # left unrun: Caramel plans around it
    # The step, in the program's context (its control dependencies hold for the updates).
    with graph.name_scope(name + "/step/"):
        shard_gradients, shard_variables, loads = [], [], []
        for b, layout in enumerate(layouts):
            flat = _padded([local[i] for i in layout.members], ranks * layout.shard)
            shard_gradients.append(hvd.reducescatter(flat, op=hvd.Average,
                                                     name=f"tfoverlap_scatter{b}",
                                                     process_set=process_set))
            with tf.compat.v1.init_scope():
                shard_variables.append(tf.compat.v1.Variable(
                    tf.zeros([layout.shard]), trainable=False, collections=[],
                    use_resource=True, name=f"shard{b}"))
            parts = [tf.slice(_flat(variables[layout.members[position]].read_value()),
                              [first], [end - first])
                     for position, first, end in layout.owned(rank)]
            owned = sum(end - first for _, first, end in layout.owned(rank))
            if owned < layout.shard:
                parts.append(tf.zeros([layout.shard - owned]))
            loads.append(shard_variables[-1].assign(
                parts[0] if len(parts) == 1 else tf.concat(parts, 0), read_value=False))
        with tf.compat.v1.init_scope():
            optimizer._create_slots(shard_variables)  # noqa: SLF001 - as apply_gradients would
        with tf.control_dependencies(loads):
            update = apply_in_step(list(zip(shard_gradients, shard_variables)))
        stores = []
        with tf.control_dependencies([update]):
            for b, variable in enumerate(shard_variables):
                stores.append(stored[b].enqueue([variable.read_value()]))
            with tf.control_dependencies(stores):
                marks = [token.enqueue([True]) for token in tokens]
        train = tf.group(update, *stores, *marks, name="train")
    summary = {"decoupled": len(pairs), "buckets": [len(b) for b in buckets],
               "gathers": [len(chunk) for chunk in gathers],
               "bytes": sum(4 * layout.total for layout in layouts),
               "shard_bytes": sum(4 * layout.shard for layout in layouts)}
    register_pending(graph, name, [mark.name for mark in marks], background, close,
                     guard_of, own=own, summary=summary)
    logger.info("tfoverlap: decouple: %d gradients reduce-scattered in %d buckets, "
                "all-gathered under the next forward pass in %d requests", len(pairs),
                len(buckets), len(gathers))
    return train


def _pending_apply(token, gathered, layouts, variables):
    """The op that assigns a chunk's gathered parameters to its variables, if an update is
    pending (its token is queued), else does nothing."""
    import tensorflow as tf

    def apply_pending():
        assigns = [token.dequeue()]
        for queue, layout in zip(gathered, layouts):
            whole = queue.dequeue()
            values = tf.split(whole[:layout.total], list(layout.counts))
            for i, value in zip(layout.members, values):
                assigns.append(variables[i].assign(
                    tf.reshape(value, variables[i].shape), read_value=False))
        with tf.control_dependencies(assigns):
            return tf.constant(True)

    return tf.cond(token.size() > 0, apply_pending, lambda: tf.constant(False),
                   name="apply").op


def decoupling_summary(graph) -> dict:
    """What :func:`decouple_updates` built in ``graph`` ({} if nothing), summed over the
    decoupled optimizers."""
    summaries = [s for s in pending_summaries(graph) if "decoupled" in s]
    if not summaries:
        return {}
    return {"decoupled": sum(s["decoupled"] for s in summaries),
            "buckets": [n for s in summaries for n in s["buckets"]],
            "gathers": [n for s in summaries for n in s["gathers"]],
            "bytes": sum(s["bytes"] for s in summaries),
            "shard_bytes": sum(s["shard_bytes"] for s in summaries),
            "optimizers": len(summaries)}
