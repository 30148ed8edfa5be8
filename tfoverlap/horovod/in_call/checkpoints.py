"""Checkpoints, saves and broadcasts of a TF2 program whose optimizer state decoupled
reduction shards: whole slots under their plain keys, the state of an optimizer built
before handed over, ``.h5`` saves and saves not gathered refused, and Horovod's
``broadcast_variables`` carrying rank 0's state (docs/architecture.md)."""
from __future__ import annotations

import functools
import weakref

from tfoverlap.horovod.core.patching import patch
from tfoverlap.horovod.in_call.pending import program_class
from tfoverlap.horovod.session.sharded_state import whole_slot_class
from tfoverlap.log import logger

__all__ = ["decoupled_by_variables", "decoupled_of_optimizer", "expose_whole_slots",
           "plain_order", "consolidate_all", "whole_slots", "shard_state_bytes",
           "CONSOLIDATE_FIRST", "H5_SAVE_REFUSED"]

decoupled_by_variables: dict = {}      # the variables' refs -> their TapeDecoupled
decoupled_of_optimizer = weakref.WeakKeyDictionary()    # program optimizer -> its TapeDecoupleds
_legacy_exposed = weakref.WeakKeyDictionary()   # legacy optimizer -> id(variable) -> slots

CONSOLIDATE_FIRST = (
    "tfoverlap: decouple: the optimizer state is sharded across the ranks, and this rank "
    "holds only its shard: call tfoverlap.horovod.consolidate_optimizer_state() on every "
    "rank after the last train call and before saving on one rank")

H5_SAVE_REFUSED = (
    "tfoverlap: decouple: Keras' .h5 format saves an optimizer's variables, and a "
    "decoupled optimizer's slots are sharded outside them: save in the .keras format or "
    "TensorFlow's checkpoint format (save_weights to a path without .h5, or "
    "tf.train.Checkpoint), which hold the whole state, or with include_optimizer=False")


def expose_whole_slots(optimizer, decoupled) -> None:
    """Makes checkpoints of the program's ``optimizer`` hold the decoupled variables'
    whole slots where a plain optimizer keeps them (a WholeSlot each), restoring into
    them what a checkpoint read before the first step left pending or restored."""
    import tensorflow as tf
    whole_slot = whole_slot_class()
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
    """Makes a checkpoint of ``optimizer`` refuse to be written where this rank holds only
    its shards (:data:`CONSOLIDATE_FIRST`), by a child without values of its own."""
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
        if decoupled_of_optimizer.get(saved_optimizer):
            raise ValueError(H5_SAVE_REFUSED)
        return plain_h5(hdf5_group, saved_optimizer)
    return save_optimizer_weights_to_hdf5_group


def _check_savable(optimizer) -> None:
    """Raises :data:`CONSOLIDATE_FIRST` where this rank holds only its shards."""
    if not all(decoupled.savable for decoupled in decoupled_of_optimizer.get(optimizer, [])):
        raise ValueError(CONSOLIDATE_FIRST)


def plain_order(optimizer, count: int) -> list:
    """(variable index, slot name) of each of ``variables[1:]`` (which checkpoints number)
    that Keras' ``optimizer`` would make for ``count`` variables: a copy built for
    stand-ins tells."""
    import tensorflow as tf
    with tf.init_scope():       # the configuration holds the learning rate's value
        probe = program_class(optimizer).from_config(optimizer.get_config())
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
    """Keras' ``optimizer`` built before the first decoupled step (explicitly, restored,
    a .keras model loaded): its slots' values go into the shards (held whole until the
    next train call), and its slots are let go, as if it was never built."""
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
    """Keras' optimizer: checkpoints and .keras saves number its variables."""
    from tensorflow.python.trackable import base as trackable
    listed = {"0": optimizer.iterations}
    order = plain_order(optimizer, len(decoupled.variables))
    for k, entry in enumerate(order, start=1):
        if entry is not None:
            listed[str(k)] = wholes[entry]
    _take_over_built(optimizer, decoupled, order)

    class ListedState(trackable.Trackable):
        """The optimizer's ``_variables`` as a checkpoint without decoupling holds them."""

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
    """Makes Keras' .keras format save and load ``optimizer``'s variables as without
    decoupling (``listed``: the step counter and the whole slots, numbered)."""
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
    """Makes Horovod's ``broadcast_variables`` of a decoupled optimizer's variables carry
    the root's whole state where it holds it, as it carries a plain optimizer's slots."""
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
            for decoupled in {id(d): d for d in decoupled_by_variables.values()}.values():
                if id(decoupled.program_optimizer.iterations) in counters:
                    decoupled.broadcast_state(root_rank)
        return result
    return broadcast_variables


def consolidate_all() -> bool:
    """Every decoupled state gathered whole on every rank (collective); False if none."""
    decoupleds = list({id(d): d for d in decoupled_by_variables.values()}.values())
    for decoupled in decoupleds:
        decoupled.consolidate()
    return bool(decoupleds)


def whole_slots(optimizer) -> dict:
    """{variable ref: {slot name: whole value}} of the variables ``optimizer`` decoupled
    (eager; collective: every rank calls it, after the same calls)."""
    state = {}
    for decoupled in decoupled_of_optimizer.get(optimizer, []):
        for (i, name), value in decoupled.gathered_slots().items():
            state.setdefault(decoupled.variables[i].ref(), {})[name] = value
    return state


def shard_state_bytes(optimizer) -> int:
    """The bytes of optimizer state this rank holds for the variables ``optimizer``
    decoupled."""
    return sum(int(slot.shape.num_elements()) * slot.dtype.size
               for decoupled in decoupled_of_optimizer.get(optimizer, [])
               for b in range(len(decoupled.shards))
               for slot in decoupled.slot_variables(b).values())
