"""Cross-step overlap within one call of a ``tf.function``, as Keras ``fit`` and a loop of
tape steps share it: a step keeps its last gradients in buffers, marked pending, and the
next step of the call reduces and applies them first; a drain ends the call, so between
calls nothing is pending (docs/architecture.md, "Keras fit")."""
from __future__ import annotations

import dataclasses
import weakref

from tfoverlap.horovod.core.contract import reduce_without_cond
from tfoverlap.log import logger

__all__ = ["Deferral", "PerVariables", "apply_pending", "chained_where_pending",
           "build_slots", "make_buffers", "optimizer_refused", "program_class"]


class PerVariables:
    """What tfoverlap keeps per set of variables, for as long as they live: an entry goes
    with the first of its variables to go (a process that builds and drops models in turn,
    a sweep or a test suite, would otherwise keep every model and its buffers)."""

    def __init__(self):
        self._entries: dict = {}
        self._kept: list = []       # variables without weak references: kept, ids unique

    def get(self, variables, make):
        """The entry of ``variables`` (in order), made by ``make()`` the first time."""
        variables = list(variables)
        key = tuple(id(variable) for variable in variables)
        if key not in self._entries:
            self._entries[key] = make()
            for variable in variables:
                try:
                    weakref.finalize(variable, self._entries.pop, key, None)
                except TypeError:   # no weak references: kept alive, so its id stays its
                    self._kept.append(variable)
        return self._entries[key]

    def find(self, variables):
        """The entry of ``variables``, or None."""
        return self._entries.get(tuple(id(variable) for variable in variables))

    def __len__(self) -> int:
        return len(self._entries)


_buffers = PerVariables()   # a variable -> its buffer (one per variable, however traced)
_pending = PerVariables()   # the deferred variables -> their pending flag


@dataclasses.dataclass
class Deferral:
    """One set of deferred gradients: which, their buffers, and the decision."""
    decision: dict
    chunks: list = dataclasses.field(default_factory=list)    # indices into variables
    variables: list = dataclasses.field(default_factory=list)  # the trainable variables
    buffers: dict = dataclasses.field(default_factory=dict)    # index -> buffer variable
    pending: object = None                                     # tf.Variable(bool)
    planning: dict | None = None    # while tracing the plan: allreduce name -> index
    drain: object = None
    drain_seconds: list = dataclasses.field(default_factory=list)   # per call, measured
    decoupled: object = None        # decoupled instead: its TapeDecoupled (in_call.decoupling)
    optimizer: object = None        # the optimizer that applies them
    reduction: dict = dataclasses.field(default_factory=dict)   # Horovod's arguments

    @property
    def deferred(self) -> set:
        return {index for chunk in self.chunks for index in chunk}

    def keep(self, chunks, count: int) -> bool:
        """Whether anything is deferred: ``chunks`` kept, with their buffers, unless they
        hold every one of the step's ``count`` gradients (then the decision says so)."""
        if chunks and sum(len(chunk) for chunk in chunks) >= count:
            chunks, self.decision["reason"] = [], "every gradient would be deferred"
        if chunks:
            self.chunks = chunks
            make_buffers(self)
        return bool(chunks)

    def finish_pending(self) -> list:
        """What the step before left pending, done (:func:`apply_pending`, or decoupled:
        the shards all-gathered); each chunk's update (a boolean tensor), in order."""
        if self.decoupled is not None:
            return self.decoupled.gather_pending()
        return apply_pending(self)

    def say_deferred(self, where: str) -> None:
        """Counts what is deferred into the decision, and says so in one line."""
        mb = sum(self.buffers[i].shape.num_elements() * self.buffers[i].dtype.size
                 for i in self.deferred) / 1e6
        self.decision.update(deferred=len(self.deferred), deferred_mb=round(mb, 3),
                             chunks=[len(chunk) for chunk in self.chunks])
        logger.info("tfoverlap: cross_step: %s: %d of %d gradients (%.3g MB) reduced under "
                    "the next step's forward pass, in %d chunks (predicted %s ms a step, "
                    "in-step %s ms)", where, len(self.deferred), len(self.variables), mb,
                    len(self.chunks), self.decision.get("predicted_step_ms"),
                    self.decision.get("in_step_ms"))


def optimizer_refused(optimizer) -> str:
    """Why a Keras ``optimizer``'s updates cannot be deferred ("" if they can)."""
    import tensorflow as tf
    new_api = tf.keras.optimizers.Optimizer
    legacy_api = tf.keras.optimizers.legacy.Optimizer
    if isinstance(optimizer, tf.keras.mixed_precision.LossScaleOptimizer) or not isinstance(
            optimizer, (new_api, legacy_api)):
        return f"{type(optimizer).__name__}: only Keras' own optimizers are deferred"
    if isinstance(optimizer, new_api) and (
            optimizer.clipnorm or optimizer.clipvalue or optimizer.global_clipnorm
            or optimizer.use_ema):
        return ("gradient clipping or moving averages of the weights (they look at every "
                "gradient or weight of the step at once)")
    if isinstance(optimizer, legacy_api) and (
            getattr(optimizer, "clipnorm", None) or getattr(optimizer, "clipvalue", None)
            or getattr(optimizer, "global_clipnorm", None)):
        return "gradient clipping (it looks at every gradient of the step at once)"
    return ""


def build_slots(optimizer, variables) -> None:
    """Creates the optimizer's slots for every variable now, as its first full
    apply_gradients would (a first apply of a subset builds Keras' for the subset only)."""
    import tensorflow as tf
    with tf.init_scope():
        if isinstance(optimizer, tf.keras.optimizers.Optimizer):
            optimizer.build(variables)
        else:
            optimizer._create_all_weights(variables)  # noqa: SLF001 - apply_gradients' own


def make_buffers(deferral: Deferral) -> None:
    """The deferred gradients' buffers and the pending flag, made once per variable (a
    function traced again must use the same ones)."""
    import tensorflow as tf
    with tf.init_scope():
        for index in sorted(deferral.deferred):
            variable = deferral.variables[index]
            deferral.buffers[index] = _buffers.get([variable], lambda: tf.Variable(
                tf.zeros(variable.shape, variable.dtype), trainable=False,
                name=f"tfoverlap_deferred_{index}"))
        deferral.pending = _pending.get(
            [deferral.variables[i] for i in sorted(deferral.deferred)],
            lambda: tf.Variable(False, trainable=False, name="tfoverlap_pending"))


def chained_where_pending(pending, chunks, collect, nothing) -> list[list]:
    """Per chunk, ``collect(chunk)`` (a collective's outputs) where ``pending``, else
    ``nothing(chunk)`` (tensors alike); each collective starts when the one before has its
    outputs, so the requests go one after another, first chunk first."""
    import tensorflow as tf
    outputs, previous = [], []
    for chunk in chunks:
        with tf.control_dependencies(previous):
            values = tf.cond(pending, lambda chunk=chunk: collect(chunk),
                             lambda chunk=chunk: nothing(chunk))
        previous = list(values) if isinstance(values, (list, tuple)) else [values]
        outputs.append(previous)
    return outputs


def apply_pending(deferral: Deferral) -> list:
    """Reduces and applies the pending deferred gradients, chunk by chunk, at the step
    count they came from (nothing where none is pending); returns each chunk's update (a
    boolean tensor). Each reduction (marked deferred: out of Caramel's in-step plan)
    starts once the one before is reduced, not applied: the ring goes from chunk to chunk
    while the updates (in order: they share the step counter) follow behind."""
    import tensorflow as tf

    from tfoverlap.horovod.session.deferral import mark_deferred, reducing_allreduce
    optimizer = deferral.optimizer

    def reduce(chunk):
        reduced = reduce_without_cond([deferral.buffers[i].read_value() for i in chunk],
                                      deferral.reduction)
        for tensor in reduced:
            mark_deferred(reducing_allreduce(tensor))
        return reduced

    reduced_chunks = chained_where_pending(
        deferral.pending, deferral.chunks, reduce,
        lambda chunk: [tf.zeros_like(deferral.buffers[i]) for i in chunk])
    updates = []
    for chunk, reduced in zip(deferral.chunks, reduced_chunks):
        def apply(chunk=chunk, reduced=reduced):
            optimizer.iterations.assign_sub(1)     # apply_gradients counts it back
            optimizer.apply_gradients([(gradient, deferral.variables[i])
                                       for gradient, i in zip(reduced, chunk)])
            return tf.constant(True)

        updates.append(tf.cond(deferral.pending, apply, lambda: tf.constant(False)))
    deferral.pending.assign(False)
    return updates


def program_class(optimizer):
    """The class of the program's ``optimizer`` (under Horovod's Keras wrapper, if one)."""
    cls = type(optimizer)
    while cls.__module__.startswith("horovod") and len(cls.__mro__) > 1:
        cls = cls.__mro__[1]
    return cls
