"""Horovod's own wrappers, also where ``tfoverlap run`` substituted tfoverlap's, and what
every tfoverlap wrapper does around them: AutoGraph kept away, the Caramel pass switched on
for ``tf.function`` graphs, a decoupled state gathered for a save, in every API alike."""
from __future__ import annotations

from tfoverlap.horovod.core.contract import keeps_horovods_reduction
from tfoverlap.horovod.settings import caramel_options, wrapper_option, wrapper_options
from tfoverlap.log import logger

__all__ = ["horovods", "substitute_in_horovod", "not_converted", "enable_for_functions",
           "plans_in_call", "consolidate_optimizer_state"]


_horovods: dict = {}        # (module, name) -> Horovod's own, where tfoverlap's replaced it


def horovods(module, name: str):
    """Horovod's own ``module.name`` (``DistributedOptimizer``), even where tfoverlap's
    wrapper has taken its place in that module."""
    return _horovods.get((module.__name__, name)) or getattr(module, name)


def substitute_in_horovod(module, wrappers: dict) -> None:
    """Puts tfoverlap's ``wrappers`` (name -> function) in Horovod's ``module`` in place of
    its own (``tfoverlap run --allreduce caramel``: an unchanged program gets them)."""
    for name, wrapper in wrappers.items():
        _horovods.setdefault((module.__name__, name), getattr(module, name))
        setattr(module, name, wrapper)


def not_converted(function):
    """Marks ``function`` as ``tf.autograph.experimental.do_not_convert`` does, without
    importing TensorFlow, so a ``tf.function`` step runs it as written: under AutoGraph
    the Grappler plugin's ctypes callback, made by a first ``load()``, died with the call."""
    function.autograph_info__ = {}
    return function


def enable_for_functions(carried_out: tuple = ()) -> None:
    """Switches the Caramel pass on for this thread's ``tf.function`` graphs; one warning
    names the wrapper options asked for that such a step does not carry out (graph mode's),
    except those the caller does (``carried_out``)."""
    from tfoverlap.api import enable_for_tf_function
    asked = sorted(name for name, value in wrapper_options().items()
                   if value is True or (type(value) is int and value > 0))
    unused = [name for name in asked if name not in carried_out]
    if unused:
        logger.warning("tfoverlap: %s asked for, but only graph-mode (tf.compat.v1) "
                       "optimizers%s carry it out; this tf.function step is planned when "
                       "first traced, within the step, with static estimates or a profile "
                       "file (profile=)", " and ".join(unused),
                       " (and Keras model.fit, for cross_step)" if "cross_step" in unused
                       else "")
    enable_for_tf_function(**caramel_options())


def plans_in_call(reduction: dict) -> bool:
    """A TF2 wrapper's Caramel pass switched on, unless Horovod keeps the ``reduction``
    (a warning); whether its steps plan cross-step overlap or decoupling (on > 1 rank)."""
    if keeps_horovods_reduction(reduction):
        return False
    enable_for_functions(carried_out=("cross_step", "decouple"))
    return bool(wrapper_option("cross_step", "auto") or wrapper_option("decouple", False)) \
        and reduction["process_set"].size() > 1


def consolidate_optimizer_state(session=None) -> bool:
    """Gathers the optimizer state that decoupled reduction shards across the ranks, so that
    a save on one rank writes it whole (collective: every rank calls it, after the same
    train runs or calls). ``session``: a graph-mode program's; None: the TF2 steps' state,
    eagerly. False where nothing is decoupled."""
    if session is not None:
        from tfoverlap.horovod.session.saves import consolidate_optimizer_state as in_session
        return in_session(session)
    from tfoverlap.horovod.in_call.checkpoints import consolidate_all
    return consolidate_all()
