"""Decoupled reduction for ``DistributedGradientTape`` steps in a loop inside one
``tf.function`` (``configure(decouple=True|"auto")``): the TF2 form of
:mod:`tfoverlap.horovod.decoupled`, built by :mod:`tfoverlap.horovod.tape_deferred`
where it would otherwise defer.

Each step of the loop:

- all-gathers the shards that the step before it updated, first layers first, in the
  plan's requests, and assigns the parameters; the step's forward reads of a variable
  wait for its own request alone (ordered as cross-step overlap orders them);
- reduce-scatters each bucket of its gradients (Caramel's buckets, planned against the
  backward pass) as the backward pass makes it;
- copies its own shard of every bucket's parameters into a flat shard variable, and has a
  copy of the program's optimizer (same class and configuration, sharing its step counter
  and learning rate) update the shards, with optimizer state for the shards only.

After the loop, the call all-gathers what its last step updated. So between calls every
variable holds plain Horovod's value (elementwise optimizers compute each element alike
on a shard and on the whole tensor; past 2 ranks, up to the order in which the
reduce-scatter adds the ranks' gradients), and the optimizer state takes 1/n of its
memory. The program's optimizer holds no slots for the decoupled variables: its
``variables`` are its step counter (and hyperparameters), which Horovod's broadcast and
Keras' callbacks use as before.

**Checkpoints** (``tf.train.Checkpoint`` of the program's optimizer) hold the whole slots
under the keys a checkpoint without decoupling has (``optimizer/_variables/3``; legacy:
``.../.OPTIMIZER_SLOT/optimizer/m``), so each restores into the other. A restore needs no
collective: each rank takes its shard, also where the checkpoint was read before the
first step (then rank 0's state goes to every rank when the step is built, as plain
Horovod programs broadcast it); Horovod's ``broadcast_variables`` of the optimizer's
variables carries rank 0's restored state to the others. A save on one rank needs the
others' shards: every rank first calls ``tfoverlap.horovod.consolidate_optimizer_state()``
(a save without it is refused with that remedy named).

An optimizer built (or restored into, or loaded from a .keras file) before its first
decoupled step hands its state over to the shards then. Keras' .keras format saves and
loads the whole state as it does without decoupling; its .h5 format is refused.

Where the program or its optimizer does not allow it, nothing is decoupled and one line
says why (:func:`refused`).
"""
from __future__ import annotations

import dataclasses
import functools
import itertools
import weakref

from tfoverlap.horovod.contract import decoupling_refused_by_reduction
from tfoverlap.horovod.decoupled import BucketLayout, _flat, _padded, _whole_slot_class
from tfoverlap.horovod.pipeline import build_slots, chained_where_pending, optimizer_refused
from tfoverlap.horovod.patching import patch
from tfoverlap.log import logger

__all__ = ["plan", "refused", "refuse_again", "TapeDecoupled",
           "decoupled_for", "consolidate_all", "whole_slots", "shard_state_bytes",
           "CONSOLIDATE_FIRST"]

_built: dict = {}             # the variables' refs -> their TapeDecoupled (however traced)
_of_optimizer = weakref.WeakKeyDictionary()     # program optimizer -> its TapeDecoupleds
_legacy_exposed = weakref.WeakKeyDictionary()   # legacy optimizer -> id(variable) -> slots
_numbers = itertools.count()


def _decouplable_classes() -> tuple:
    import tensorflow as tf
    keras = tf.keras.optimizers
    return (keras.SGD, keras.Adam, keras.AdamW, keras.legacy.SGD, keras.legacy.Adam)


def _program_class(optimizer):
    """The class of the program's ``optimizer`` (the one Horovod's Keras wrapper derives
    from, where it is one)."""
    cls = type(optimizer)
    while cls.__module__.startswith("horovod") and len(cls.__mro__) > 1:
        cls = cls.__mro__[1]
    return cls


def refused(optimizer, variables, gradients=()) -> str:
    """Why the updates of ``optimizer`` to ``variables`` with the unreduced ``gradients``
    (where given) cannot be decoupled ("" if they can)."""
    import tensorflow as tf
    refusal = optimizer_refused(optimizer)
    if refusal:
        return refusal
    if _program_class(optimizer) not in _decouplable_classes():
        return (f"{_program_class(optimizer).__name__}: only Keras' SGD, Adam and AdamW "
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
    if isinstance(optimizer, tf.keras.optimizers.Optimizer) and _of_optimizer.get(optimizer):
        return "the optimizer is decoupled for other variables (Keras' optimizers build once)"
    elif not _built_for(optimizer, variables):
        return ("the optimizer was built for other variables before its first decoupled "
                "step (Keras' optimizers build once)")
    return ""


def _decoupled_with(optimizer, variables) -> "TapeDecoupled | None":
    """What ``optimizer`` decoupled for ``variables`` before, if anything."""
    decoupled = _built.get(variables[0].ref())
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
    """(buckets, all-gather requests, decision) for a step of ``count`` gradients traced
    in ``graph`` (``own``: its HorovodAllreduce names -> gradient indices, the dense ones)
    and reduced with ``reduction``: decouple's plan, or none with the reason (``refusal``,
    a reduction that cannot be reduce-scattered, a gradient that is not dense)."""
    from tfoverlap.horovod.scheduling import plan_decoupling
    refusal = (refusal or decoupling_refused_by_reduction(reduction)
               or ("" if len(set(own.values())) == count else "a gradient is not a dense "
                                                              "tensor"))
    if refusal:
        return [], [], {"mode": "auto" if mode == "auto" else "on", "decoupled": 0,
                        "reason": refusal}
    return plan_decoupling(graph.as_graph_def(add_shapes=True), own, count, mode)


def _built_for(optimizer, variables) -> bool:
    """Whether Keras' ``optimizer`` is unbuilt, or built for ``variables`` alone, in their
    order (then its state is taken over: :func:`_take_over_built`; a legacy optimizer's
    slots, restored or built, always are: :func:`_expose_legacy`)."""
    import tensorflow as tf
    if not isinstance(optimizer, tf.keras.optimizers.Optimizer) or not getattr(
            optimizer, "_built", False):
        return True
    index = {optimizer._var_key(v): i for i, v in enumerate(variables)}  # noqa: SLF001
    if optimizer._index_dict != index:  # noqa: SLF001 - what build() was given
        return False
    return len(optimizer.variables) == 1 + len(_plain_order(optimizer, len(variables)))


def _shard_optimizer(optimizer):
    """A copy of the program's ``optimizer`` (same class and configuration) that shares
    its step counter and learning rate, for the shard variables."""
    import tensorflow as tf
    with tf.init_scope():       # the configuration holds the learning rate's value
        copy = _program_class(optimizer).from_config(optimizer.get_config())
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
        parameters, request by request (each starts when the one before it has been
        gathered); nothing where none is pending. Returns each request's assignment (a
        boolean tensor), in order."""
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
                    layout = self.layouts[b]
                    values = tf.split(whole[:layout.total], list(layout.counts))
                    for i, value in zip(layout.members, values):
                        self.variables[i].assign(tf.reshape(value, self.variables[i].shape),
                                                 read_value=False)
                return tf.constant(True)

            assigned.append(tf.cond(self.pending, assign, lambda: tf.constant(False)))
        self.pending.assign(False)
        return assigned

    def update(self, gradients):
        """The step's update: each bucket of the unreduced ``gradients`` (by variable
        index) reduce-scattered, this rank's shard of the parameters loaded and updated by
        the shard optimizer, and the all-gather marked pending. Returns the shard
        optimizer's apply_gradients result."""
        import horovod.tensorflow as hvd
        import tensorflow as tf
        ranks, rank = self.process_set.size(), self.process_set.rank()
        scattered, loads = [], []
        for b, layout in enumerate(self.layouts):
            flat = _padded([gradients[i] for i in layout.members], ranks * layout.shard)
            scattered.append(hvd.reducescatter(flat, op=self.op, process_set=self.process_set,
                                               name=f"tfoverlap_scatter{b}"))
        for b, layout in enumerate(self.layouts):
            parts = [tf.slice(_flat(self.variables[layout.members[position]]), [first],
                              [end - first]) for position, first, end in layout.owned(rank)]
            owned = sum(end - first for _, first, end in layout.owned(rank))
            if owned < layout.shard:
                parts.append(tf.zeros([layout.shard - owned]))
            loads.append(self.shards[b].assign(
                parts[0] if len(parts) == 1 else tf.concat(parts, 0), read_value=False))
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
        """A call that updates the shards, counted (its start or end): the whole values
        held are stale."""
        self.calls += 1
        self.whole = {}

    def consolidate(self) -> None:
        """Every rank's shards of every slot all-gathered into whole values, kept until
        the next train call (collective)."""
        import horovod.tensorflow as hvd
        import tensorflow as tf
        for b, layout in enumerate(self.layouts):
            gathered = hvd.grouped_allgather(
                [tf.convert_to_tensor(self.slot_variables(b)[name]) for name in self.slot_names],
                process_set=self.process_set)
            for name, flat in zip(self.slot_names, gathered):
                for i, value in zip(layout.members, tf.split(flat[:layout.total],
                                                             list(layout.counts))):
                    self.whole[i, name] = tf.reshape(value, self.variables[i].shape)
        self.whole_at = self.calls

    @property
    def savable(self) -> bool:
        """Whether this rank holds the whole state (or nothing was trained yet)."""
        return self.calls == 0 or self.whole_at == self.calls and len(self.whole) == sum(
            len(layout.members) for layout in self.layouts) * len(self.slot_names)

    def saved_value(self, i, name):
        """What a checkpoint writes of variable ``i``'s slot ``name``: the whole value this
        rank holds since its last train call, else zeros (nothing trained yet; or a
        restore, which asks for the value's type alone: a save is refused before, by
        :func:`_guard_saves`)."""
        import tensorflow as tf
        if self.whole_at == self.calls and (i, name) in self.whole:
            return self.whole[i, name]
        return tf.zeros(self.variables[i].shape)

    def restore_whole(self, b, i, name, value) -> None:
        """Variable ``i``'s slot ``name`` restored to ``value``: kept whole (a save or a
        broadcast may follow), and this rank's part written into its shard (no
        collective)."""
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
        """The whole state that ``root_rank`` restored (if it holds it whole) given to
        every rank, each taking its shard (collective; nothing moves where the root holds
        only its shard: the ranks' shards already agree)."""
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


CONSOLIDATE_FIRST = (
    "tfoverlap: decouple: the optimizer state is sharded across the ranks, and this rank "
    "holds only its shard: call tfoverlap.horovod.consolidate_optimizer_state() on every "
    "rank after the last train call and before saving on one rank")


H5_SAVE_REFUSED = (
    "tfoverlap: decouple: Keras' .h5 format saves an optimizer's variables, and a "
    "decoupled optimizer's slots are sharded outside them: save in the .keras format or "
    "TensorFlow's checkpoint format (save_weights to a path without .h5, or "
    "tf.train.Checkpoint), which hold the whole state, or with include_optimizer=False")


def decoupled_for(optimizer, variables, buckets, gathers, reduction) -> TapeDecoupled:
    """The shards, shard optimizer and pending flag of ``variables`` (made once: a
    function traced again uses the same ones), and the program optimizer's refusal to be
    saved without its state."""
    import tensorflow as tf
    key = variables[0].ref()
    if _decoupled_with(optimizer, variables) is not None:
        return _built[key]
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
        _built[key] = decoupled
        _of_optimizer.setdefault(optimizer, []).append(decoupled)
        _expose_whole_slots(optimizer, decoupled)
        # A checkpoint restored on rank 0 alone before the first step: every rank takes
        # its shard (plain Horovod's programs broadcast the slots from rank 0 as well).
        decoupled.broadcast_state(0)
    return decoupled


def _expose_whole_slots(optimizer, decoupled: TapeDecoupled) -> None:
    """Makes checkpoints of the program's ``optimizer`` hold the whole slots of the
    decoupled variables where a plain optimizer keeps them (a WholeSlot each, saved and
    restored through ``decoupled``), and restores into them what a checkpoint read
    before the first step left pending (or, legacy, restored into the optimizer's own
    slots, which are then let go)."""
    import tensorflow as tf
    whole_slot = _whole_slot_class()
    wholes = {(i, name): whole_slot(decoupled, b, i, name,
                                    f"{decoupled.variables[i]._shared_name}/{name}")  # noqa: SLF001
              for b, layout in enumerate(decoupled.layouts) for i in layout.members
              for name in decoupled.slot_names}
    if isinstance(optimizer, tf.keras.optimizers.Optimizer):
        _expose_listed(optimizer, decoupled, wholes)
    else:
        _expose_legacy(optimizer, decoupled, wholes)
    _guard_saves(optimizer)
    _install_broadcast_hook()


def _guard_saves(optimizer) -> None:
    """Makes a checkpoint that holds ``optimizer`` refuse to be written
    (:data:`CONSOLIDATE_FIRST`) where this rank holds only its shards of the state: a
    child of the optimizer without values of its own, looked at first."""
    from tensorflow.python.trackable import base as trackable
    program_optimizer = weakref.ref(optimizer)

    class ShardedStateGuard(trackable.Trackable):
        def _serialize_to_tensors(self):
            _check_savable(program_optimizer())
            return {}

    if "tfoverlap_sharded_state" not in optimizer._trackable_children():  # noqa: SLF001
        optimizer._track_trackable(ShardedStateGuard(),  # noqa: SLF001 - a tracked child
                                   name="tfoverlap_sharded_state")
    # Keras' .h5 format saves the optimizer's variables by name, which hold no slots of
    # the decoupled variables: refused rather than written without them.
    from keras.src.saving.legacy import hdf5_format
    patch(hdf5_format, "save_optimizer_weights_to_hdf5_group", _refusing_h5_saves)


def _refusing_h5_saves(plain_h5):
    def save_optimizer_weights_to_hdf5_group(hdf5_group, saved_optimizer):
        if _of_optimizer.get(saved_optimizer):
            raise ValueError(H5_SAVE_REFUSED)
        return plain_h5(hdf5_group, saved_optimizer)
    return save_optimizer_weights_to_hdf5_group


def _check_savable(optimizer) -> None:
    """Raises :data:`CONSOLIDATE_FIRST` where this rank holds only its shards of
    ``optimizer``'s decoupled state."""
    if not all(decoupled.savable for decoupled in _of_optimizer.get(optimizer, [])):
        raise ValueError(CONSOLIDATE_FIRST)


def _plain_order(optimizer, count: int) -> list:
    """(variable index, slot name) of each variable that Keras' ``optimizer`` would make
    for ``count`` variables, in the order of its ``variables[1:]`` (which its checkpoints
    number): found by building a copy of it for stand-ins of one element each."""
    import tensorflow as tf
    with tf.init_scope():       # the configuration holds the learning rate's value
        probe = _program_class(optimizer).from_config(optimizer.get_config())
        stand_ins = [tf.Variable(tf.zeros([1]), name=f"tfoverlap_probe_{i}")
                     for i in range(count)]
        probe.build(stand_ins)
    suffixes = [f"/{stand_in._shared_name}:0"  # noqa: SLF001 - the optimizer's naming
                for stand_in in stand_ins]
    order = []
    for variable in probe.variables[1:]:
        index = next((i for i, suffix in enumerate(suffixes)
                      if variable.name.endswith(suffix)), None)
        order.append(None if index is None else (index, variable.name[
            :-len(suffixes[index])].rsplit("/", 1)[-1]))
    return order


def _take_over_built(optimizer, decoupled, order) -> None:
    """Keras' ``optimizer`` built for the decoupled variables before their first decoupled
    step (an explicit build, a restore into it built, a .keras model loaded): its slots'
    values go into the shards (and are held whole until the next train call, for a save
    or Horovod's broadcast), and its slot variables are let go, so that it looks as the
    decoupled optimizer that was never built."""
    if not getattr(optimizer, "_built", False):
        return
    slots = list(optimizer.variables[1:])
    for entry, slot in zip(order, slots):
        if entry is not None:
            i, name = entry
            b = next(b for b, layout in enumerate(decoupled.layouts) if i in layout.members)
            decoupled.restore_whole(b, i, name, slot.read_value())
    held = {id(slot) for slot in slots}
    for attribute, value in list(vars(optimizer).items()):     # _momentums, _velocities...
        if attribute != "_variables" and isinstance(value, list) and value and all(
                id(v) in held for v in value):
            setattr(optimizer, attribute, [])
    optimizer._variables = [optimizer.iterations]  # noqa: SLF001 - as never built
    optimizer._index_dict = {}  # noqa: SLF001
    optimizer._built = False  # noqa: SLF001


def _expose_listed(optimizer, decoupled, wholes) -> None:
    """Keras' optimizer: its checkpoints number its variables (``_variables/k``), and so
    do its .keras saves."""
    from tensorflow.python.trackable import base as trackable
    listed = {"0": optimizer.iterations}
    order = _plain_order(optimizer, len(decoupled.variables))
    for k, entry in enumerate(order, start=1):
        if entry is not None:
            listed[str(k)] = wholes[entry]
    _take_over_built(optimizer, decoupled, order)

    class ListedState(trackable.Trackable):
        """The optimizer's ``_variables`` as a checkpoint of it without decoupling holds
        them."""

        def _trackable_children(self, save_type="checkpoint", **kwargs):
            return dict(listed)

    view = ListedState()
    plain_children = optimizer._trackable_children  # noqa: SLF001

    def trackable_children(save_type="checkpoint", **kwargs):
        children = plain_children(save_type, **kwargs)
        if save_type == "checkpoint" and "_variables" in children:
            children["_variables"] = view
        return children

    optimizer._trackable_children = trackable_children  # noqa: SLF001
    _save_listed_as_keras(optimizer, listed)
    waiting = optimizer._variables._deferred_dependencies  # noqa: SLF001 - read before
    for name in [name for name in waiting if name in listed and name != "0"]:
        for position in waiting.pop(name):
            position.restore(listed[name])


def _save_listed_as_keras(optimizer, listed: dict) -> None:
    """Makes Keras' .keras format save and load ``optimizer``'s variables as it does
    without decoupling (``listed``: its checkpoint numbering, the step counter and the
    whole slots), which Keras reads back into an optimizer it built (its state is then
    taken over at the first decoupled step)."""
    import tensorflow as tf
    from tensorflow.python.trackable import base as trackable
    key = trackable.VARIABLE_VALUE_KEY
    program_optimizer = weakref.ref(optimizer)

    def save_own_variables(store):
        _check_savable(program_optimizer())
        for k, value in listed.items():
            saved = value if k == "0" else value._serialize_to_tensors()[key]  # noqa: SLF001
            store[k] = saved.numpy()

    def load_own_variables(store):
        if sorted(store.keys()) != sorted(listed):
            logger.warning("tfoverlap: decouple: %s not loaded: the saved optimizer has %d "
                           "variables, this one %d", program_optimizer().name,
                           len(store.keys()), len(listed))
            return
        for k, value in listed.items():
            if k == "0":
                value.assign(store[k])
            else:
                value._restore_from_tensors({key: tf.constant(store[k])})  # noqa: SLF001

    optimizer.save_own_variables = save_own_variables
    optimizer.load_own_variables = load_own_variables


def _expose_legacy(optimizer, decoupled, wholes) -> None:
    """A legacy optimizer: its checkpoints hold slots by variable and slot name."""
    from keras.src.optimizers.legacy.optimizer_v2 import _var_key  # the slots' own key
    for i, variable in enumerate(decoupled.variables):
        key = _var_key(variable)
        b = next(b for b, layout in enumerate(decoupled.layouts) if i in layout.members)
        for name, slot in optimizer._slots.pop(key, {}).items():  # noqa: SLF001
            if name in decoupled.slot_names:          # restored (or built) before the step
                decoupled.restore_whole(b, i, name, slot.read_value())
            optimizer._weights[:] = [w for w in optimizer._weights  # noqa: SLF001
                                     if w is not slot]
        for name in decoupled.slot_names:
            waiting = optimizer._deferred_slot_restorations.get(name, {})  # noqa: SLF001
            for position in waiting.pop(key, []):
                position.restore(wholes[i, name])
    exposed = _legacy_exposed.get(optimizer)
    if exposed is None:
        exposed = _legacy_exposed[optimizer] = {}
        plain_get_slot, plain_names = optimizer.get_slot, optimizer.get_slot_names
        plain_restore = optimizer._create_or_restore_slot_variable  # noqa: SLF001

        def whole_of(variable, name):
            entry = exposed.get(id(variable))
            return entry[1].get(name) if entry is not None and entry[0] is variable else None

        def get_slot(variable, name):
            whole = whole_of(variable, name)
            return plain_get_slot(variable, name) if whole is None else whole

        def get_slot_names():
            return sorted(set(plain_names()) | {name for _, slots in exposed.values()
                                                for name in slots})

        def create_or_restore_slot(slot_variable_position, slot_name, variable):
            whole = whole_of(variable, slot_name)
            return (plain_restore(slot_variable_position, slot_name, variable)
                    if whole is None else whole)

        optimizer.get_slot, optimizer.get_slot_names = get_slot, get_slot_names
        optimizer._create_or_restore_slot_variable = create_or_restore_slot  # noqa: SLF001
    for (i, name), whole in wholes.items():
        variable = decoupled.variables[i]
        exposed.setdefault(id(variable), (variable, {}))[1][name] = whole


def _install_broadcast_hook() -> None:
    """Makes Horovod's ``broadcast_variables`` of a decoupled optimizer's step counter
    (``optimizer.variables``) carry the root's whole state where the root holds it (a
    checkpoint restored there alone), as it carries a plain optimizer's slots."""
    import horovod.tensorflow as hvd
    from horovod.tensorflow import functions
    patch(functions, "broadcast_variables", _broadcasting_whole_state)
    hvd.broadcast_variables = functions.broadcast_variables


def _broadcasting_whole_state(plain):
    import tensorflow as tf

    @functools.wraps(plain)
    def broadcast_variables(variables, root_rank, *args, **kwargs):
        variables = list(variables)
        result = plain(variables, root_rank, *args, **kwargs)
        if tf.executing_eagerly():
            counters = {id(variable) for variable in variables}
            for decoupled in {id(d): d for d in _built.values()}.values():
                if id(decoupled.program_optimizer.iterations) in counters:
                    decoupled.broadcast_state(root_rank)
        return result
    return broadcast_variables


def consolidate_all() -> bool:
    """Every tape step's decoupled state gathered whole on every rank (collective);
    False where nothing was decoupled."""
    decoupleds = list({id(d): d for d in _built.values()}.values())
    for decoupled in decoupleds:
        decoupled.consolidate()
    return bool(decoupleds)


def whole_slots(optimizer) -> dict:
    """The whole optimizer state of every variable that ``optimizer``'s tape steps
    decoupled: {variable ref: {slot name: value}} (eager; collective: every rank calls
    it, after the same calls)."""
    import horovod.tensorflow as hvd
    import tensorflow as tf
    state = {}
    for decoupled in _of_optimizer.get(optimizer, []):
        for b, layout in enumerate(decoupled.layouts):
            slots = decoupled.slot_variables(b)
            names = sorted(slots)
            gathered = hvd.grouped_allgather([tf.convert_to_tensor(slots[n]) for n in names],
                                             process_set=decoupled.process_set)
            for name, whole in zip(names, gathered):
                values = tf.split(whole[:layout.total], list(layout.counts))
                for i, value in zip(layout.members, values):
                    variable = decoupled.variables[i]
                    state.setdefault(variable.ref(), {})[name] = tf.reshape(value,
                                                                            variable.shape)
    return state


def shard_state_bytes(optimizer) -> int:
    """The bytes of optimizer state this rank holds for the variables that
    ``optimizer``'s tape steps decoupled (0 where none)."""
    return sum(int(slot.shape.num_elements()) * slot.dtype.size
               for decoupled in _of_optimizer.get(optimizer, [])
               for b in range(len(decoupled.shards))
               for slot in decoupled.slot_variables(b).values())
