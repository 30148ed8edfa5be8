"""Decoupled reduction within one ``tf.function`` call (tape loops and Keras ``fit``;
docs/architecture.md, "Tape loops and Keras, decoupled reduction"); its checkpoints and
saves: :mod:`tfoverlap.horovod.in_call.checkpoints`."""
from __future__ import annotations

import dataclasses
import itertools

from tfoverlap.horovod.core.contract import decoupling_refused_by_reduction
from tfoverlap.horovod.core.decisions import planned
from tfoverlap.horovod.core.layout import BucketLayout, padded
from tfoverlap.horovod.in_call.checkpoints import (decoupled_by_variables,
                                                   decoupled_of_optimizer, expose_whole_slots,
                                                   plain_order)
from tfoverlap.horovod.in_call.pending import (build_slots, chained_where_pending,
                                               optimizer_refused, program_class)
from tfoverlap.log import logger

__all__ = ["plan", "refused", "refuse_again", "TapeDecoupled", "decoupled_for"]

_numbers = itertools.count()


def refused(optimizer, variables, gradients=()) -> str:
    """Why the updates of ``optimizer`` to ``variables`` with the unreduced ``gradients``
    (if given) cannot be decoupled ("" if they can)."""
    import tensorflow as tf
    keras = tf.keras.optimizers
    refusal = optimizer_refused(optimizer)
    if refusal:
        return refusal
    if program_class(optimizer) not in (keras.SGD, keras.Adam, keras.AdamW, keras.legacy.SGD,
                                        keras.legacy.Adam):
        return (f"{program_class(optimizer).__name__}: only Keras' SGD, Adam and AdamW "
                "(and legacy SGD and Adam) are decoupled")
    if getattr(optimizer, "_exclude_from_weight_decay", None) or getattr(
            optimizer, "_exclude_from_weight_decay_names", None):
        return "weight decay that excludes some variables (it goes by the variable)"
    for variable in variables:
        if variable.dtype.base_dtype != tf.float32:
            return f"{variable.name} is {variable.dtype.base_dtype.name}: only float32 " \
                   "is decoupled"
        if getattr(variable, "constraint", None) is not None:
            return f"{variable.name} has a constraint (it applies to the whole variable)"
    for variable, gradient in zip(variables, gradients):
        if not isinstance(gradient, tf.Tensor):
            return f"{variable.name}'s gradient is not a dense tensor"
    if _decoupled_with(optimizer, variables) is not None:
        return ""
    if isinstance(optimizer, tf.keras.optimizers.Optimizer) and decoupled_of_optimizer.get(
            optimizer):
        return "the optimizer is decoupled for other variables (Keras' optimizers build once)"
    elif not _built_for(optimizer, variables):
        return ("the optimizer was built for other variables before its first decoupled "
                "step (Keras' optimizers build once)")
    return ""


def _decoupled_with(optimizer, variables) -> "TapeDecoupled | None":
    """What ``optimizer`` decoupled for ``variables`` before, if anything."""
    decoupled = decoupled_by_variables.get(variables[0].ref())
    return decoupled if decoupled is not None and (
        decoupled.program_optimizer is optimizer) else None


def refuse_again(optimizer, variables, refusal: str) -> None:
    """Raises where ``optimizer`` decoupled ``variables`` before and a step of them is now
    refused: their optimizer state is in the shards, which plain updates would not use."""
    if _decoupled_with(optimizer, variables) is not None:
        raise ValueError(f"tfoverlap: decouple: {variables[0].name} was decoupled in an "
                         f"earlier trace, and this one cannot be ({refusal}); its optimizer "
                         "state is sharded: trace the step alike, or train with "
                         "configure(decouple=False) from the start")


def plan(graph, own: dict, count: int, reduction: dict, mode,
         refusal: str = "") -> tuple[list, list, dict]:
    """(buckets, all-gather requests, decision) of a step of ``count`` gradients traced in
    ``graph`` (``own``: HorovodAllreduce names -> indices of the dense ones), or none with
    the reason: ``refusal``, the reduction's, or a gradient that is not dense."""
    from tfoverlap.horovod.core.plans import plan_decoupling
    refusal = (refusal or decoupling_refused_by_reduction(reduction)
               or ("" if len(set(own.values())) == count else "a gradient is not a dense "
                                                              "tensor"))
    if refusal:
        return [], [], planned("decouple", mode, refusal)
    return plan_decoupling(graph.as_graph_def(add_shapes=True), own, count, mode)


def _built_for(optimizer, variables) -> bool:
    """Whether Keras' ``optimizer`` is unbuilt, or built for ``variables`` alone, in their
    order (then its state is taken over; a legacy optimizer's always is)."""
    import tensorflow as tf
    if not isinstance(optimizer, tf.keras.optimizers.Optimizer) or not getattr(
            optimizer, "_built", False):
        return True
    index = {optimizer._var_key(v): i for i, v in enumerate(variables)}  # noqa: SLF001
    if optimizer._index_dict != index:  # noqa: SLF001 - what build() was given
        return False
    return len(optimizer.variables) == 1 + len(plain_order(optimizer, len(variables)))


def _shard_optimizer(optimizer):
    """A copy of the program's ``optimizer`` for the shard variables, sharing its step
    counter and learning rate."""
    import tensorflow as tf
    with tf.init_scope():       # the configuration holds the learning rate's value
        copy = program_class(optimizer).from_config(optimizer.get_config())
        if isinstance(optimizer, tf.keras.optimizers.Optimizer):
            copy._iterations = optimizer.iterations  # noqa: SLF001 - shared, as documented
            copy._variables = [optimizer.iterations]  # noqa: SLF001
            copy._learning_rate = optimizer._learning_rate  # noqa: SLF001
            if hasattr(optimizer, "_current_learning_rate"):
                copy._current_learning_rate = optimizer._current_learning_rate  # noqa: SLF001
        else:
            optimizer._create_hypers()  # noqa: SLF001 - saved with the program's, as without
            copy.iterations = optimizer.iterations
            copy._hyper = optimizer._hyper  # noqa: SLF001 - set_hyper reaches both
    return copy


@dataclasses.dataclass(eq=False)
class TapeDecoupled:
    """One set of decoupled variables: their buckets, the shard variables this rank
    updates, the optimizer that updates them, and whether an all-gather is pending."""
    program_optimizer: object
    variables: list
    layouts: list             # BucketLayout per bucket, in reduce-scatter order
    gathers: list             # lists of bucket indices, first needed first
    shards: list              # tf.Variable per bucket: this rank's shard
    optimizer: object         # the shard optimizer
    pending: object           # tf.Variable(bool): shards updated, not yet all-gathered
    process_set: object
    op: object                # Horovod's reduction op (Average or Sum)
    slot_names: list = dataclasses.field(default_factory=list)
    calls: int = 0            # calls of the functions that train the shards
    whole: dict = dataclasses.field(default_factory=dict)   # (index, slot) -> whole value
    whole_at: int = -1        # ``calls`` when ``whole`` was gathered or restored

    @property
    def chunks(self) -> list[list[int]]:
        """The variable indices of each all-gather request."""
        return [[i for b in chunk for i in self.layouts[b].members] for chunk in self.gathers]

    def gather_pending(self) -> list:
        """All-gathers the updated shards where an update is pending and assigns the
        parameters, request by request (:func:`chained_where_pending`); returns each
        request's assignment (a boolean tensor), in order."""
        import horovod.tensorflow as hvd
        import tensorflow as tf
        ranks = self.process_set.size()
        gathered = chained_where_pending(
            self.pending, self.gathers,
            lambda chunk: hvd.grouped_allgather([self.shards[b].read_value() for b in chunk],
                                                process_set=self.process_set),
            lambda chunk: [tf.zeros([ranks * self.layouts[b].shard]) for b in chunk])
        assigned = []
        for chunk, wholes in zip(self.gathers, gathered):
            def assign(chunk=chunk, wholes=wholes):
                for b, whole in zip(chunk, wholes):
                    for i, value in self.layouts[b].split(whole):
                        self.variables[i].assign(tf.reshape(value, self.variables[i].shape),
                                                 read_value=False)
                return tf.constant(True)

            assigned.append(tf.cond(self.pending, assign, lambda: tf.constant(False)))
        self.pending.assign(False)
        return assigned

    def update(self, gradients):
        """The step's update: each bucket of the unreduced ``gradients`` reduce-scattered,
        this rank's shards of the parameters loaded and updated by the shard optimizer
        (its apply_gradients' result returned), and the all-gather marked pending."""
        import horovod.tensorflow as hvd
        import tensorflow as tf
        ranks, rank = self.process_set.size(), self.process_set.rank()
        scattered = [hvd.reducescatter(padded([gradients[i] for i in layout.members],
                                              ranks * layout.shard), op=self.op,
                                       process_set=self.process_set, name=f"tfoverlap_scatter{b}")
                     for b, layout in enumerate(self.layouts)]
        loads = [self.shards[b].assign(layout.shard_of(rank, lambda i: self.variables[i]),
                                       read_value=False) for b, layout in enumerate(self.layouts)]
        with tf.control_dependencies(loads):
            result = self.optimizer.apply_gradients(list(zip(scattered, self.shards)))
        with tf.control_dependencies([result] if isinstance(result, tf.Tensor) else []):
            self.pending.assign(True)
        return result

    def summary(self) -> dict:
        """What was decoupled, as the decision reports it."""
        return {"decoupled": len(self.variables),
                "buckets": [len(layout.members) for layout in self.layouts],
                "gathers": [len(chunk) for chunk in self.gathers],
                "bytes": sum(4 * layout.total for layout in self.layouts),
                "shard_bytes": sum(4 * layout.shard for layout in self.layouts)}

    def say(self, where: str, decision: dict) -> None:
        """The line that says what was decoupled."""
        logger.info("tfoverlap: decouple: %s: %d gradients reduce-scattered in %d buckets, "
                    "all-gathered under the next forward pass in %d requests (predicted %s "
                    "ms a step, Horovod %s ms)", where, len(self.variables), len(self.layouts),
                    len(self.gathers), decision.get("predicted_step_ms"),
                    decision.get("horovod_step_ms"))

    def slot_variables(self, b) -> dict:
        """The shard optimizer's slots of bucket ``b``'s shard, by slot name."""
        import tensorflow as tf
        shard = self.shards[b]
        if isinstance(self.optimizer, tf.keras.optimizers.Optimizer):
            suffix = f"/{shard._shared_name}:0"  # noqa: SLF001 - the optimizer's own naming
            return {v.name[:-len(suffix)].rsplit("/", 1)[-1]: v
                    for v in self.optimizer.variables[1:] if v.name.endswith(suffix)}
        return {name: self.optimizer.get_slot(shard, name)
                for name in self.optimizer.get_slot_names()}

    def trained(self) -> None:
        """A call that updates the shards, counted: the whole values held are stale."""
        self.calls += 1
        self.whole = {}

    def gathered_slots(self) -> dict:
        """Every rank's shards of every slot all-gathered: {(variable index, slot name):
        whole value} (collective)."""
        import horovod.tensorflow as hvd
        import tensorflow as tf
        wholes = {}
        for b, layout in enumerate(self.layouts):
            gathered = hvd.grouped_allgather(
                [tf.convert_to_tensor(self.slot_variables(b)[name]) for name in self.slot_names],
                process_set=self.process_set)
            for name, flat in zip(self.slot_names, gathered):
                for i, value in layout.split(flat):
                    wholes[i, name] = tf.reshape(value, self.variables[i].shape)
        return wholes

    def consolidate(self) -> None:
        """The whole values of every slot gathered, kept until the next train call."""
        self.whole.update(self.gathered_slots())
        self.whole_at = self.calls

    @property
    def savable(self) -> bool:
        """Whether this rank holds the whole state (or nothing was trained yet)."""
        return self.calls == 0 or self.whole_at == self.calls and len(self.whole) == sum(
            len(layout.members) for layout in self.layouts) * len(self.slot_names)

    def saved_value(self, i, name):
        """What a checkpoint writes of variable ``i``'s slot ``name``: the whole value held
        since the last train call, else zeros (nothing trained yet, or a restore, which
        asks for the type alone: a save is refused before)."""
        import tensorflow as tf
        if self.whole_at == self.calls and (i, name) in self.whole:
            return self.whole[i, name]
        return tf.zeros(self.variables[i].shape)

    def restore_whole(self, b, i, name, value) -> None:
        """Variable ``i``'s slot ``name`` restored to ``value``: kept whole (a save or a
        broadcast may follow), this rank's part written into its shard (no collective)."""
        import tensorflow as tf
        value = tf.reshape(tf.convert_to_tensor(value), self.variables[i].shape)
        if self.whole_at != self.calls:
            self.whole = {}
        self.whole[i, name], self.whole_at = value, self.calls
        slot, layout = self.slot_variables(b)[name], self.layouts[b]
        offset = sum(layout.counts[:layout.members.index(i)])
        flat = tf.reshape(value, [-1])
        for member, first, end in layout.owned(self.process_set.rank()):
            if layout.members[member] == i:
                at = offset + first - self.process_set.rank() * layout.shard
                slot[at:at + end - first].assign(flat[first:end])

    def broadcast_state(self, root_rank: int) -> None:
        """The whole state that ``root_rank`` restored given to every rank, each taking its
        shard (collective; nothing moves where the root holds only its shard)."""
        import horovod.tensorflow as hvd
        import tensorflow as tf
        keys = [(b, i, name) for b, layout in enumerate(self.layouts)
                for i in layout.members for name in self.slot_names]
        held = self.whole_at == self.calls and all(key[1:] in self.whole for key in keys)
        if not keys or not int(hvd.broadcast(tf.constant(int(held)), root_rank,
                                             process_set=self.process_set)):
            return
        sizes = [self.variables[i].shape.num_elements() for _, i, _ in keys]
        own = [tf.reshape(self.whole[i, name], [-1]) if held else tf.zeros([size])
               for (_, i, name), size in zip(keys, sizes)]
        rooted = hvd.broadcast(tf.concat(own, 0), root_rank, process_set=self.process_set)
        for key, value in zip(keys, tf.split(rooted, sizes)):
            self.restore_whole(*key, value)


def decoupled_for(optimizer, variables, buckets, gathers, reduction) -> TapeDecoupled:
    """The TapeDecoupled of ``variables``: its shards, shard optimizer and pending flag,
    made once (a function traced again uses the same ones), its checkpoint views."""
    import tensorflow as tf
    key = variables[0].ref()
    if _decoupled_with(optimizer, variables) is not None:
        return decoupled_by_variables[key]
    process_set = reduction["process_set"]
    layouts = [BucketLayout.of(bucket, [variables[i].shape.num_elements() for i in bucket],
                               process_set.size()) for bucket in buckets]
    number = next(_numbers)
    with tf.init_scope():
        shards = [tf.Variable(tf.zeros([layout.shard]), trainable=False,
                              name=f"tfoverlap_shard{number}_{b}")
                  for b, layout in enumerate(layouts)]
        pending = tf.Variable(False, trainable=False, name=f"tfoverlap_gather_pending{number}")
        shard_optimizer = _shard_optimizer(optimizer)
        build_slots(shard_optimizer, shards)
        decoupled = TapeDecoupled(optimizer, list(variables), layouts,
                                  [list(c) for c in gathers], shards, shard_optimizer,
                                  pending, process_set, reduction["op"])
        decoupled.slot_names = sorted(decoupled.slot_variables(0)) if shards else []
        decoupled_by_variables[key] = decoupled
        decoupled_of_optimizer.setdefault(optimizer, []).append(decoupled)
        expose_whole_slots(optimizer, decoupled)
        # A checkpoint restored on rank 0 alone before the first step: every rank takes
        # its shard (plain Horovod's programs broadcast the slots from rank 0 as well).
        decoupled.broadcast_state(0)
    return decoupled


