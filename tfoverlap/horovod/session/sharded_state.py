"""The sharded optimizer state of graph-mode decoupled reduction, seen as whole slots by a
Saver (:class:`ShardedState`), an object-based checkpoint and ``get_slot``
(:func:`expose_whole_slots`), and Horovod's broadcast."""
from __future__ import annotations

import functools
import weakref

from tfoverlap.horovod.core.layout import padded

__all__ = ["ShardedState", "sharded_states", "expose_whole_slots", "whole_slot_class",
           "CONSOLIDATE_FIRST"]

sharded_states = weakref.WeakKeyDictionary()    # graph -> its ShardedStates
_exposed = weakref.WeakKeyDictionary()   # optimizer -> (slot key, slot name) -> WholeSlot

CONSOLIDATE_FIRST = (
    "tfoverlap: decouple: the optimizer state is sharded across the ranks, and this rank "
    "holds only its shard: run tfoverlap.horovod.consolidate_optimizer_state(session) on "
    "every rank after the last train run and before saving on one rank")


class ShardedState:
    """The optimizer slots of the shards, seen from outside as whole slots, each kept in a
    *whole* buffer where this rank has it (docs/architecture.md, "Graph mode, decoupled
    reduction"). ``wanted``: this rank's request for a consolidation (``request`` puts
    one; the next background run consolidates on every rank where any asked).
    ``savable``: whether a checkpoint can be written now."""

    def __init__(self, optimizer, variables, layouts, shard_variables, rank, process_set,
                 wanted):
        import tensorflow as tf
        from tensorflow.python.ops import resource_variable_ops
        self.variables, self.layouts, self.rank = variables, layouts, rank
        self.process_set, self._wanted = process_set, wanted
        names = sorted(optimizer.get_slot_names())
        # Every decouplable optimizer starts its slots at zero.
        self.slots = [[optimizer.get_slot(shard, slot) for slot in names]
                      for shard in shard_variables]
        global_variables = tf.compat.v1.get_collection_ref(
            tf.compat.v1.GraphKeys.GLOBAL_VARIABLES)
        for slot in (slot for bucket in self.slots for slot in bucket):
            global_variables.remove(slot)
        self._ensured = [[self._ensure(slot) for slot in bucket] for bucket in self.slots]
        graph = tf.compat.v1.get_default_graph()
        self.whole = {}             # (pair index, slot position) -> resource handle
        for b, layout in enumerate(layouts):
            for i in layout.members:
                for position in range(len(names)):
                    name = f"whole{i}_{position}"
                    self.whole[i, position] = tf.raw_ops.VarHandleOp(
                        dtype=tf.float32, shape=variables[i].shape, name=name,
                        shared_name=graph.unique_name(name, mark_as_used=False))
        with graph.name_scope("consolidate"):
            self.consolidate = tf.group(*self._consolidation(), name="consolidate")
        self.broadcast = self._build_broadcast() if names else None
        self.request = tf.cond(wanted.size() > 0, lambda: tf.constant(False),
                               lambda: _after(wanted.enqueue(True)), name="request")
        # Saved as it is: the whole slot where this rank holds it, else the zeros of a
        # slot never stepped.
        self.savable = tf.reduce_all(tf.stack(
            [tf.constant(True)] + [self.has_whole(i, position) | tf.logical_not(
                resource_variable_ops.var_is_initialized_op(
                    self.slots[b][position].handle))
                for b, layout in enumerate(layouts) for i in layout.members
                for position in range(len(names))]), name="savable")
        self._saved = {}            # (pair index, slot position) -> the value saved
        self.whole_slots = []       # (variable, slot name, its WholeSlot)
        for b, layout in enumerate(layouts):
            for i in layout.members:
                for position, shard_slot in enumerate(self.slots[b]):
                    name = (f"{variables[i].op.name}/"
                            f"{shard_slot.op.name[len(shard_variables[b].op.name) + 1:]}")
                    self._saved[i, position] = self._guarded(b, i, position)
                    tf.compat.v1.add_to_collection(tf.compat.v1.GraphKeys.SAVEABLE_OBJECTS,
                                                   _whole_slot(self, b, i, position, name))
                    self.whole_slots.append((variables[i], names[position],
                                             whole_slot_class()(self, b, i, position, name)))

    @staticmethod
    def _ensure(slot):
        import tensorflow as tf
        from tensorflow.python.ops import resource_variable_ops

        def initialize():
            with tf.control_dependencies([slot.assign(tf.zeros(slot.shape),
                                                      read_value=False)]):
                return tf.constant(True)

        return tf.cond(resource_variable_ops.var_is_initialized_op(slot.handle),
                       lambda: tf.constant(False), initialize, name="ensure").op

    def ensure_initialized(self, bucket=None) -> list:
        """The ops that give the shard slots (of ``bucket``, else all) their zeros where
        they have no value yet, before anything else uses them in a run."""
        return [op for b, ops in enumerate(self._ensured) if bucket in (None, b)
                for op in ops]

    def drop_whole(self) -> list:
        import tensorflow as tf
        return [tf.raw_ops.DestroyResourceOp(resource=handle, ignore_lookup_error=True)
                for handle in self.whole.values()]

    def has_whole(self, i, position):
        import tensorflow as tf
        return tf.raw_ops.VarIsInitializedOp(resource=self.whole[i, position])

    def read_whole(self, i, position):
        import tensorflow as tf
        return tf.raw_ops.ReadVariableOp(resource=self.whole[i, position], dtype=tf.float32)

    def keep_whole(self, i, position, value):
        import tensorflow as tf
        return tf.raw_ops.AssignVariableOp(resource=self.whole[i, position],
                                           value=tf.reshape(value, self.variables[i].shape))

    def _guarded(self, b, i, position):
        """Pair ``i``'s whole slot at ``position``: the whole buffer, zeros before the
        first step, refused (CONSOLIDATE_FIRST) where this rank holds only its shard."""
        import tensorflow as tf
        from tensorflow.python.ops import resource_variable_ops
        shape, slot = self.variables[i].shape, self.slots[b][position]

        def not_whole():
            # Without the whole, only a slot never stepped (no value yet) can be saved.
            never_stepped = tf.logical_not(
                resource_variable_ops.var_is_initialized_op(slot.handle))
            with tf.control_dependencies([tf.debugging.Assert(never_stepped,
                                                              [CONSOLIDATE_FIRST])]):
                return tf.zeros(shape)

        return tf.cond(self.has_whole(i, position), lambda: self.read_whole(i, position),
                       not_whole)

    def saved_value(self, i, position):
        """What a checkpoint writes of pair ``i``'s slot at ``position``."""
        return self._saved[i, position]

    def restore_whole(self, b, i, position, restored):
        """The op that restores pair ``i``'s whole slot at ``position`` from ``restored``:
        into the whole buffer, and this rank's part into its shard (no collective)."""
        import tensorflow as tf
        layout, slot = self.layouts[b], self.slots[b][position]
        whole = tf.reshape(restored, self.variables[i].shape)
        ops = [self.keep_whole(i, position, whole)]
        offset = sum(layout.counts[:layout.members.index(i)])
        flat = tf.reshape(whole, [-1])
        for member, first, end in layout.owned(self.rank):
            if layout.members[member] != i:
                continue
            at = offset + first - self.rank * layout.shard
            with tf.control_dependencies(self.ensure_initialized(b)):
                ops.append(slot[at:at + end - first].assign(flat[first:end]).op)
        return tf.group(*ops)

    def _gathered_slots(self, b):
        """Every rank's shard of bucket ``b``'s slots, all-gathered: one flat whole per
        slot (collective)."""
        import horovod.tensorflow as hvd
        import tensorflow as tf
        with tf.control_dependencies(self.ensure_initialized(b)):
            shards = [slot.read_value() for slot in self.slots[b]]
        return hvd.grouped_allgather(shards, process_set=self.process_set)

    def _consolidation(self) -> list:
        """The ops that all-gather every slot shard into the whole buffers (collective)."""
        return [self.keep_whole(i, position, value)
                for b, bucket in enumerate(self.slots) if bucket
                for position, flat in enumerate(self._gathered_slots(b))
                for i, value in self.layouts[b].split(flat)]

    def consolidate_for_save(self):
        """A consolidation some rank asked for, then this rank's request (if any) taken off:
        a conditional branch of the background run."""
        import tensorflow as tf
        with tf.control_dependencies(self._consolidation()):
            return tf.cond(self._wanted.size() > 0, lambda: _after(self._wanted.dequeue()),
                           lambda: tf.constant(True))

    def _build_broadcast(self):
        """What Horovod's broadcast of the variables from rank 0 runs first, for the slots:
        rank 0's whole slots where it has them, else the shards all-gathered; every rank
        then holds its shard of that, and the whole (collective)."""
        import horovod.tensorflow as hvd
        import tensorflow as tf
        keys = sorted(self.whole)
        index_of = {key: index for index, key in enumerate(keys)}
        with tf.compat.v1.get_default_graph().name_scope("broadcast"):
            has = tf.stack([tf.cast(self.has_whole(*key), tf.float32) for key in keys])
            own = [tf.cond(self.has_whole(*key), lambda key=key: self.read_whole(*key),
                           lambda key=key: tf.zeros(self.variables[key[0]].shape))
                   for key in keys]
            has = hvd.broadcast(has, 0, process_set=self.process_set)
            rooted = hvd.broadcast(tf.concat([tf.reshape(t, [-1]) for t in own], 0), 0,
                                   process_set=self.process_set)
            rooted = dict(zip(keys, tf.split(rooted, [self.variables[i].shape.num_elements()
                                                      for i, _ in keys])))
            updates = []
            for b, bucket in enumerate(self.slots):
                if not bucket:
                    continue
                for position, flat in enumerate(self._gathered_slots(b)):
                    gathered = dict(self.layouts[b].split(flat))
                    wholes = []
                    for i in self.layouts[b].members:
                        key = (i, position)
                        whole = tf.where(has[index_of[key]] > 0, rooted[key],
                                         tf.reshape(gathered[i], [-1]))
                        wholes.append(whole)
                        updates.append(self.keep_whole(i, position, whole))
                    layout = self.layouts[b]
                    mine = padded(wholes, self.process_set.size() * layout.shard)[
                        self.rank * layout.shard:(self.rank + 1) * layout.shard]
                    with tf.control_dependencies(self.ensure_initialized(b)):
                        updates.append(bucket[position].assign(mine, read_value=False))
            return tf.group(*updates, name="broadcast")


def _after(op):
    """True, once ``op`` has run (a conditional's branch value)."""
    import tensorflow as tf
    with tf.control_dependencies([op]):
        return tf.constant(True)


def _whole_slot(state: ShardedState, bucket: int, pair: int, position: int, name: str):
    """A Saver's view of one variable's slot, whole, under its plain ``name``."""
    from tensorflow.python.training.saving import saveable_object
    value = state.saved_value(pair, position)
    saveable = saveable_object.SaveableObject(
        value, [saveable_object.SaveSpec(value, "", name)], name)
    saveable.restore = lambda tensors, shapes: state.restore_whole(bucket, pair, position,
                                                                  tensors[0])
    return saveable


@functools.cache
def whole_slot_class():
    from tensorflow.python.trackable import base as trackable

    class WholeSlot(trackable.Trackable):
        """An object-based checkpoint's view of one variable's whole slot (what ``get_slot``
        gives for a decoupled variable), saved and restored as the Saver's view is."""

        def __init__(self, state, bucket, pair, position, name):
            self._state, self._at = state, (bucket, pair, position)
            self.name = name + ":0"
            self.shape, self.dtype = state.variables[pair].shape, state.variables[pair].dtype

        def _serialize_to_tensors(self):
            return {trackable.VARIABLE_VALUE_KEY: self._state.saved_value(*self._at[1:])}

        def _restore_from_tensors(self, restored_tensors):
            return self._state.restore_whole(
                *self._at, restored_tensors[trackable.VARIABLE_VALUE_KEY])

    return WholeSlot


def _slot_key(variable):
    """The optimizer's key for ``variable``'s slots (None for what is not a graph
    variable: object-based checkpoints ask for the slots of every object they hold)."""
    op = getattr(variable, "op", None)
    return None if op is None else (op.graph, op.name)


def expose_whole_slots(optimizer, whole_slots) -> None:
    """Makes ``optimizer.get_slot`` give a decoupled variable's whole slot (``whole_slots``:
    (variable, slot name, WholeSlot)), which object-based checkpoints save and restore,
    restoring into it what a checkpoint read before the step was built left pending."""
    exposed = _exposed.get(optimizer)
    if exposed is None:
        exposed = _exposed[optimizer] = {}
        get_slot = optimizer.get_slot
        create_or_restore = optimizer._create_or_restore_slot_variable  # noqa: SLF001

        def get_whole_slot(variable, name):
            slot = get_slot(variable, name)
            return exposed.get((_slot_key(variable), name)) if slot is None else slot

        def restore_whole_slot(slot_variable_position, slot_name, variable):
            whole = exposed.get((_slot_key(variable), slot_name))
            if whole is None:
                return create_or_restore(slot_variable_position, slot_name, variable)
            return slot_variable_position.restore(whole)

        optimizer.get_slot = get_whole_slot
        optimizer._create_or_restore_slot_variable = restore_whole_slot  # noqa: SLF001
    for variable, slot_name, whole in whole_slots:
        exposed[_slot_key(variable), slot_name] = whole
        optimizer._restore_slot_variable(slot_name, variable, whole)  # noqa: SLF001
