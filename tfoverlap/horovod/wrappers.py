"""The drop-in ``DistributedOptimizer`` (graph mode and TF2) and
``DistributedGradientTape``: Horovod's wrappers, with the gradients reduced by plain
HorovodAllreduce ops that Caramel plans (graph mode), or with the TfOverlap optimizer on
for the ``tf.function`` graphs of this thread (TF2)."""
from __future__ import annotations

import logging

from tfoverlap.horovod.contract import keeps_horovods_reduction, reduction_of
from tfoverlap.horovod.pipeline import reduce_without_cond
from tfoverlap.horovod.scheduling import (record_graph_decision, decouple_and_schedule,
                                          defer_and_schedule, schedule_in_place)
from tfoverlap.horovod.settings import caramel_options, wrapper_option, wrapper_options
from tfoverlap.log import logger

__all__ = ["DistributedOptimizer", "DistributedGradientTape", "not_converted",
           "enable_for_functions", "flush_op", "horovods", "substitute_in_horovod",
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


@not_converted
def DistributedOptimizer(optimizer, name=None, use_locking=False, device_dense="",
                         device_sparse="", compression=None, sparse_as_dense=False,
                         backward_passes_per_step=1, op=None, gradient_predivide_factor=1.0,
                         average_aggregated_gradients=False, num_groups=0, groups=None,
                         process_set=None, scale_local_gradients=True):
    """``hvd.DistributedOptimizer`` with Caramel's schedule (same arguments).

    Explicit ``groups``, gradient accumulation (``backward_passes_per_step > 1``) and
    Adasum keep Horovod's own reduction (Caramel's buckets would replace the first, and
    the others reduce differently), with a warning.
    """
    import horovod.tensorflow as hvd
    import tensorflow as tf
    reduction = reduction_of(device_dense, device_sparse, compression, sparse_as_dense, op,
                             gradient_predivide_factor, process_set, backward_passes_per_step,
                             groups, num_groups)
    process_set = reduction["process_set"]
    wrapped = horovods(hvd, "DistributedOptimizer")(
        optimizer, name=name, use_locking=use_locking, device_dense=device_dense,
        device_sparse=device_sparse, compression=reduction["compression"],
        sparse_as_dense=sparse_as_dense, backward_passes_per_step=backward_passes_per_step,
        op=reduction["op"], gradient_predivide_factor=gradient_predivide_factor,
        average_aggregated_gradients=average_aggregated_gradients, num_groups=num_groups,
        groups=groups, process_set=process_set, scale_local_gradients=scale_local_gradients)
    if keeps_horovods_reduction(reduction):
        return wrapped
    if not isinstance(optimizer, tf.compat.v1.train.Optimizer):
        enable_for_functions()
        return wrapped
    if tf.executing_eagerly():
        logger.warning("tfoverlap: a tf.compat.v1 optimizer run eagerly has no graph to "
                       "schedule; plain Horovod is used")
        return wrapped

    pending: dict = {}      # cross_step: what apply_gradients defers once the updates exist

    def reduce_and_schedule(grads, variables=None, use_generic_names=False):
        reduced = reduce_without_cond(grads, reduction)
        if process_set.size() < 2:
            return reduced
        from tfoverlap.horovod.deferred import deferral_refused, reducing_allreduce
        allreduces = [reducing_allreduce(r) if isinstance(r, tf.Tensor) else None
                      for r in reduced]
        # The rewrite re-points the consumers of each reduced tensor: these Identities.
        reduced = [tf.identity(r) if isinstance(r, tf.Tensor) else r for r in reduced]
        dense = [r for r in reduced if isinstance(r, tf.Tensor)]
        if not dense:
            return reduced
        gradients = [g for g in grads if isinstance(g, tf.Tensor)]
        from tfoverlap.horovod.decoupled import decoupling_refused
        decision = None
        # Decoupled reduction where asked for and possible, else cross-step overlap.
        for option, default, refusal in (("decouple", False, decoupling_refused),
                                         ("cross_step", "auto", deferral_refused)):
            mode = wrapper_option(option, default)
            if not mode:
                continue
            refused = (refusal(optimizer, variables, reduced, reduction)
                       if variables is not None else "Horovod did not name the variables")
            if not refused:
                pending.update(grads=list(grads), variables=list(variables),
                               reduced=reduced, allreduces=allreduces, gradients=gradients,
                               mode=mode, decouple=option == "decouple", reduction=reduction)
                return reduced
            # Asked for: a warning; on by default: one INFO line.
            logger.log(logging.WARNING if mode is True else logging.INFO,
                       "tfoverlap: %s: %s; the step is planned without it", option, refused)
            declined = {"mode": "on" if mode is True else "auto", "reason": refused,
                        "decoupled" if option == "decouple" else "deferred": 0}
            record_graph_decision(optimizer, declined, option)
            if option == "cross_step":
                decision = declined
        schedule_in_place(dense[0].graph, gradients, cross_step=decision)
        return reduced

    original_apply = wrapped.apply_gradients

    def apply_and_defer(grads_and_vars, global_step=None, name=None):
        if not pending:
            return original_apply(grads_and_vars, global_step=global_step, name=name)
        deferrable = dict(pending)
        pending.clear()
        if deferrable.pop("decouple", False):
            return decouple_and_schedule(
                optimizer, list(grads_and_vars),
                lambda pairs: original_apply(pairs, global_step=global_step, name=name),
                **deferrable)
        deferrable.pop("reduction")
        return defer_and_schedule(
            optimizer, list(grads_and_vars),
            lambda pairs: original_apply(pairs, global_step=global_step, name=name),
            **deferrable)

    wrapped._allreduce_grads = reduce_and_schedule  # noqa: SLF001 - Horovod's hook
    wrapped.apply_gradients = apply_and_defer
    return wrapped


def flush_op(graph=None):
    """cross_step: the op that applies every pending deferred update (optional: any run
    that uses a deferred variable applies its update first); None where nothing was
    deferred."""
    from tfoverlap.horovod.deferred import flush_op as deferred_flush
    return deferred_flush(graph)


def consolidate_optimizer_state(session=None) -> bool:
    """Gathers the whole optimizer state that decoupled reduction shards across the ranks
    (collective: every rank calls it, after the same train runs or calls), so that a save
    on one rank (rank 0, as Horovod programs do) writes it whole. ``session``: a graph-mode
    program's session (:func:`tfoverlap.horovod.decoupled.consolidate_optimizer_state`);
    None: the tape steps' state, eagerly (:mod:`tfoverlap.horovod.tape_decoupled`).
    Returns False where nothing is decoupled (nothing to do)."""
    if session is not None:
        from tfoverlap.horovod.decoupled import consolidate_optimizer_state as in_session
        return in_session(session)
    from tfoverlap.horovod.tape_decoupled import consolidate_all
    return consolidate_all()


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


@not_converted
def DistributedGradientTape(gradtape, device_dense="", device_sparse="", compression=None,
                            sparse_as_dense=False, op=None, gradient_predivide_factor=1.0,
                            num_groups=0, groups=None, process_set=None,
                            scale_local_gradients=True):
    """``hvd.DistributedGradientTape`` with Caramel's schedule for ``tf.function`` steps
    (same arguments), and cross-step overlap or decoupled reduction where the steps run in
    a loop inside one ``tf.function`` (:mod:`tfoverlap.horovod.tape_deferred`,
    :mod:`tfoverlap.horovod.tape_decoupled`)."""
    import horovod.tensorflow as hvd
    reduction = reduction_of(device_dense, device_sparse, compression, sparse_as_dense, op,
                             gradient_predivide_factor, process_set, groups=groups,
                             num_groups=num_groups)
    kept = keeps_horovods_reduction(reduction)
    if not kept:
        enable_for_functions(carried_out=("cross_step", "decouple"))
    tape = horovods(hvd, "DistributedGradientTape")(
        gradtape, device_dense=device_dense, device_sparse=device_sparse,
        compression=reduction["compression"], sparse_as_dense=sparse_as_dense,
        op=reduction["op"], gradient_predivide_factor=gradient_predivide_factor,
        num_groups=num_groups, groups=groups, process_set=reduction["process_set"],
        scale_local_gradients=scale_local_gradients)
    mode = wrapper_option("cross_step", "auto")
    decouple = wrapper_option("decouple", False)
    if not kept and (mode or decouple) and reduction["process_set"].size() > 1:
        from tfoverlap.horovod.tape_deferred import attach
        attach(tape, reduction, mode)
    return tape
