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
``variables`` are its step counter (and learning rate), which Horovod's broadcast and
Keras' callbacks use as before; :func:`whole_slots` gathers the state (collective).

Where the program or its optimizer does not allow it, nothing is decoupled and one line
says why (:func:`refused`). Not yet: a checkpoint of the sharded state. A
``tf.train.Checkpoint`` that holds the program's optimizer refuses to save, naming the
remedy, rather than write a checkpoint without its slots.
"""
from __future__ import annotations

import dataclasses
import itertools
import weakref

from tfoverlap.horovod.decoupled import BucketLayout, _flat, _padded
from tfoverlap.horovod.pipeline import optimizer_refused

__all__ = ["refused", "reduction_refused", "TapeDecoupled", "decoupled_for", "whole_slots",
           "shard_state_bytes"]

_built: dict = {}             # the variables' refs -> their TapeDecoupled (however traced)
_of_optimizer = weakref.WeakKeyDictionary()     # program optimizer -> its TapeDecoupleds
_numbers = itertools.count()

SAVE_REFUSED = (
    "tfoverlap: decouple: this optimizer's state is sharded across the ranks (a "
    "DistributedGradientTape step decoupled in a tf.function loop), and checkpoints of that "
    "state are not written yet; train with tfoverlap.horovod.configure(decouple=False) "
    "where the optimizer is checkpointed")


def _decouplable_classes() -> tuple:
    import tensorflow as tf
    keras = tf.keras.optimizers
    return (keras.SGD, keras.Adam, keras.AdamW, keras.legacy.SGD, keras.legacy.Adam)


def reduction_refused(reduction: dict) -> str:
    """Why gradients reduced with Horovod's ``reduction`` arguments cannot be
    reduce-scattered instead ("" if they can)."""
    import horovod.tensorflow as hvd
    if reduction["compression"] is not hvd.Compression.none:
        return "compression: only uncompressed gradients are reduce-scattered"
    if reduction["op"] not in (hvd.Average, hvd.Sum):
        return "only Horovod's Average and Sum are reduce-scattered"
    if reduction["gradient_predivide_factor"] != 1.0:
        return "gradient_predivide_factor: only unscaled reductions are reduce-scattered"
    return ""


def refused(optimizer, variables, gradients) -> str:
    """Why the updates of ``optimizer`` to ``variables`` with the unreduced ``gradients``
    cannot be decoupled ("" if they can)."""
    import tensorflow as tf
    refusal = optimizer_refused(optimizer)
    if refusal:
        return refusal
    if type(optimizer) not in _decouplable_classes():
        return (f"{type(optimizer).__name__}: only Keras' SGD, Adam and AdamW (and legacy "
                "SGD and Adam) are decoupled")
    if getattr(optimizer, "_exclude_from_weight_decay", None) or getattr(
            optimizer, "_exclude_from_weight_decay_names", None):
        return "weight decay that excludes some variables (it goes by the variable)"
    for variable, gradient in zip(variables, gradients):
        if variable.dtype.base_dtype != tf.float32:
            return f"{variable.name} is {variable.dtype.base_dtype.name}: only float32 " \
                   "is decoupled"
        if getattr(variable, "constraint", None) is not None:
            return f"{variable.name} has a constraint (it applies to the whole variable)"
        if not isinstance(gradient, tf.Tensor):
            return f"{variable.name}'s gradient is not a dense tensor"
    if variables[0].ref() in _built:
        if _built[variables[0].ref()].program_optimizer is not optimizer:
            return "the variables are decoupled with another optimizer"
    elif _holds_state(optimizer, variables):
        return ("the optimizer already holds state for the variables (built, stepped or "
                "restored from a checkpoint before its first decoupled step)")
    return ""


def _holds_state(optimizer, variables) -> bool:
    """Whether ``optimizer`` has (or waits to restore) state of its own for ``variables``."""
    import tensorflow as tf
    if isinstance(optimizer, tf.keras.optimizers.Optimizer):
        waiting = getattr(optimizer._variables, "_deferred_dependencies", {})  # noqa: SLF001
        return bool(getattr(optimizer, "_built", False) or waiting)
    from keras.src.optimizers.legacy.optimizer_v2 import _var_key  # the slots' own key
    slots = getattr(optimizer, "_slots", {})
    return bool(getattr(optimizer, "_deferred_slot_restorations", {})) or any(
        slots.get(_var_key(variable)) for variable in variables)


def _shard_optimizer(optimizer):
    """A copy of the program's ``optimizer`` (same class and configuration) that shares
    its step counter and learning rate, for the shard variables."""
    import tensorflow as tf
    with tf.init_scope():       # the configuration holds the learning rate's value
        copy = type(optimizer).from_config(optimizer.get_config())
        if isinstance(optimizer, tf.keras.optimizers.Optimizer):
            copy._iterations = optimizer.iterations  # noqa: SLF001 - shared, as documented
            copy._variables = [optimizer.iterations]  # noqa: SLF001
            copy._learning_rate = optimizer._learning_rate  # noqa: SLF001
            if hasattr(optimizer, "_current_learning_rate"):
                copy._current_learning_rate = optimizer._current_learning_rate  # noqa: SLF001
        else:
            copy.iterations = optimizer.iterations
            copy._hyper = optimizer._hyper  # noqa: SLF001 - set_hyper reaches both
    return copy


@dataclasses.dataclass
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
        gathered, previous = [], []
        for chunk in self.gathers:
            def gather(chunk=chunk):
                return hvd.grouped_allgather([self.shards[b].read_value() for b in chunk],
                                             process_set=self.process_set)

            def nothing(chunk=chunk):
                return [tf.zeros([ranks * self.layouts[b].shard]) for b in chunk]

            with tf.control_dependencies(previous):
                wholes = tf.cond(self.pending, gather, nothing)
            wholes = wholes if isinstance(wholes, (list, tuple)) else [wholes]
            gathered.append(wholes)
            previous = list(wholes)
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


def decoupled_for(optimizer, variables, buckets, gathers, reduction) -> TapeDecoupled:
    """The shards, shard optimizer and pending flag of ``variables`` (made once: a
    function traced again uses the same ones), and the program optimizer's refusal to be
    saved without its state."""
    import tensorflow as tf
    key = variables[0].ref()
    if key in _built:
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
        _refuse_saves(optimizer)
    decoupled = TapeDecoupled(optimizer, list(variables), layouts, [list(c) for c in gathers],
                              shards, _shard_optimizer(optimizer), pending, process_set,
                              reduction["op"])
    _built[key] = decoupled
    _of_optimizer.setdefault(optimizer, []).append(decoupled)
    return decoupled


def _refuse_saves(optimizer) -> None:
    """Makes a checkpoint that holds ``optimizer`` fail with :data:`SAVE_REFUSED` where
    its decoupled steps keep optimizer state (plain SGD keeps none)."""
    from tensorflow.python.trackable import base as trackable
    program_optimizer = weakref.ref(optimizer)

    class ShardedStateNotSaved(trackable.Trackable):
        def _serialize_to_tensors(self):
            for decoupled in _of_optimizer.get(program_optimizer(), []):
                if any(decoupled.slot_variables(b) for b in range(len(decoupled.shards))):
                    raise ValueError(SAVE_REFUSED)
            return {}

    optimizer._track_trackable(ShardedStateNotSaved(),  # noqa: SLF001 - a tracked child
                               name="tfoverlap_sharded_state", overwrite=True)


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
