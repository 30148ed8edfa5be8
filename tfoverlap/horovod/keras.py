"""``horovod.tensorflow.keras`` with Caramel's schedule: the same names and signatures.

``DistributedOptimizer`` is Horovod's, and it switches the Caramel pass on for the
``tf.function`` graphs of this thread (``model.fit``'s train function among them), with
the options and network figures of :func:`tfoverlap.horovod.configure`. Everything else
(``init``, ``size``, ``callbacks``, ``broadcast_variables``, ...) is Horovod's own, passed
through::

    import tfoverlap.horovod.keras as hvd
    hvd.init()
    model.compile(optimizer=hvd.DistributedOptimizer(tf.keras.optimizers.legacy.SGD(0.1)), ...)
    model.fit(x, y, callbacks=[hvd.callbacks.BroadcastGlobalVariablesCallback(0)])

Cross-step overlap (:mod:`tfoverlap.horovod.adapters.keras_fit`) is "auto" by default: used
where Caramel's plan predicts ``min_gain``; ``configure(cross_step=False)`` of
:mod:`tfoverlap.horovod` turns it off. It needs ``compile(steps_per_execution=N)`` with
N > 1: the reductions of a step's last gradients then run under the next step's forward
pass within each call, and the call ends with the weights exactly as plain Horovod's.
``configure(decouple=True)`` decouples those steps instead (reduce-scatter, sharded
update, all-gather under the next step's forward pass).
"""
from __future__ import annotations

from tfoverlap.horovod.adapters import keras_fit, keras_hooks
from tfoverlap.horovod.core.contract import keeps_horovods_reduction, reduction_of
from tfoverlap.horovod.settings import configure, wrapper_option
from tfoverlap.horovod.adapters.horovods import (consolidate_optimizer_state,
                                                 enable_for_functions, horovods,
                                                 not_converted)

__all__ = ["DistributedOptimizer", "configure", "decisions", "consolidate_optimizer_state",
           "cross_step_decision"]


@not_converted
def DistributedOptimizer(optimizer, name=None, device_dense="", device_sparse="",
                         compression=None, sparse_as_dense=False,
                         gradient_predivide_factor=1.0, op=None, backward_passes_per_step=1,
                         average_aggregated_gradients=False, num_groups=0, groups=None,
                         process_set=None, scale_local_gradients=True):
    """``horovod.tensorflow.keras.DistributedOptimizer`` with Caramel's schedule (same
    arguments). Explicit groups, gradient accumulation and Adasum keep Horovod's own
    reduction, with a warning."""
    import horovod.tensorflow.keras as hvd_keras
    reduction = reduction_of(device_dense, device_sparse, compression, sparse_as_dense, op,
                             gradient_predivide_factor, process_set, backward_passes_per_step,
                             groups, num_groups)
    keeps_horovods = keeps_horovods_reduction(reduction)
    if not keeps_horovods:
        enable_for_functions(carried_out=("cross_step", "decouple"))
    wrapped = horovods(hvd_keras, "DistributedOptimizer")(
        optimizer, name=name, device_dense=device_dense, device_sparse=device_sparse,
        compression=reduction["compression"], sparse_as_dense=sparse_as_dense,
        gradient_predivide_factor=gradient_predivide_factor, op=reduction["op"],
        backward_passes_per_step=backward_passes_per_step,
        average_aggregated_gradients=average_aggregated_gradients, num_groups=num_groups,
        groups=groups, process_set=reduction["process_set"],
        scale_local_gradients=scale_local_gradients)
    if not keeps_horovods and (wrapper_option("cross_step", "auto")
                               or wrapper_option("decouple", False)) \
            and reduction["process_set"].size() > 1:
        keras_fit.register(wrapped, reduction)
        keras_hooks.install()
    return wrapped


def cross_step_decision(model) -> dict | None:
    """What was decided for ``model.fit``'s train function, as a dict: mode, how many
    gradients were deferred (and their MB), the predicted and in-step step in ms, and the
    reason where nothing was deferred; None before the train function's first trace. (An
    alias kept from before :func:`tfoverlap.horovod.core.decisions`, which reports every API.)"""
    return keras_fit.decision_for(model)


def decisions():
    """:func:`tfoverlap.horovod.core.decisions`: what was decided for every wrapped optimizer
    and step of this process, Keras train functions among them."""
    from tfoverlap.horovod.core.decisions import decisions as every_decision
    return every_decision()


def __getattr__(name: str):
    import horovod.tensorflow.keras as hvd_keras
    try:
        return getattr(hvd_keras, name)
    except AttributeError:
        raise AttributeError(f"module 'tfoverlap.horovod.keras' has no attribute {name!r} "
                             "(nor has horovod.tensorflow.keras)") from None
