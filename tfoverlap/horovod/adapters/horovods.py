"""Horovod's own wrappers and what every tfoverlap wrapper does around them: find
Horovod's originals where ``tfoverlap run`` substituted tfoverlap's (:func:`horovods`,
:func:`substitute_in_horovod`), keep AutoGraph away from tfoverlap's code
(:func:`not_converted`), and switch the Caramel pass on for this thread's
``tf.function`` graphs (:func:`enable_for_functions`); and gather a decoupled optimizer
state for a save on one rank, in every API alike (:func:`consolidate_optimizer_state`)."""
from __future__ import annotations

from tfoverlap.horovod.settings import caramel_options, wrapper_options
from tfoverlap.log import logger

__all__ = ["horovods", "substitute_in_horovod", "not_converted", "enable_for_functions",
           "consolidate_optimizer_state"]


#: Horovod's own wrappers, where :func:`substitute_in_horovod` put tfoverlap's in their place
_horovods: dict = {}


def horovods(module, name: str):
    """Horovod's own ``module.name`` (``DistributedOptimizer``), even where tfoverlap's
    wrapper has taken its place in that module."""
    return _horovods.get((module.__name__, name)) or getattr(module, name)


def substitute_in_horovod(module, wrappers: dict) -> None:
    """Puts tfoverlap's ``wrappers`` (name -> function) in Horovod's ``module`` in place of
    its own (``tfoverlap run --allreduce caramel``: a program that calls
    ``hvd.DistributedOptimizer`` gets tfoverlap's, cross-step overlap included, unchanged)."""
    for name, wrapper in wrappers.items():
        _horovods.setdefault((module.__name__, name), getattr(module, name))
        setattr(module, name, wrapper)


def not_converted(function):
    """Marks ``function`` as ``tf.autograph.experimental.do_not_convert`` does, without
    importing TensorFlow: a ``tf.function`` step that calls it (the tape's wrapper is made
    inside the step) runs it as written. AutoGraph would convert tfoverlap's code under it,
    and the Grappler plugin's ctypes callback, made there by a first ``load()``, did not
    outlive the call (a segmentation fault when Grappler called it)."""
    function.autograph_info__ = {}
    return function


def enable_for_functions(carried_out: tuple = ()) -> None:
    """Switches the Caramel pass on for this thread's ``tf.function`` graphs; one warning
    names the wrapper options that were asked for and that such a step does not carry out
    (those of graph-mode optimizers), except those the caller does (``carried_out``:
    Keras' cross_step)."""
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


def consolidate_optimizer_state(session=None) -> bool:
    """Gathers the whole optimizer state that decoupled reduction shards across the ranks
    (collective: every rank calls it, after the same train runs or calls), so that a save
    on one rank (rank 0, as Horovod programs do) writes it whole. ``session``: a graph-mode
    program's session (:func:`tfoverlap.horovod.session.saves.consolidate_optimizer_state`);
    None: the tape steps' state, eagerly (:mod:`tfoverlap.horovod.in_call.decoupling`).
    Returns False where nothing is decoupled (nothing to do)."""
    if session is not None:
        from tfoverlap.horovod.session.saves import consolidate_optimizer_state as in_session
        return in_session(session)
    from tfoverlap.horovod.in_call.checkpoints import consolidate_all
    return consolidate_all()
