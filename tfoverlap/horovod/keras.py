"""``horovod.tensorflow.keras`` with Caramel's schedule, the same names and signatures:
``DistributedOptimizer`` is Horovod's, with the Caramel pass on for this thread's
``tf.function`` graphs; everything else (``init``, ``callbacks``, ...) is Horovod's::

    import tfoverlap.horovod.keras as hvd
    hvd.init()
    model.compile(optimizer=hvd.DistributedOptimizer(tf.keras.optimizers.legacy.SGD(0.1)), ...)
    model.fit(x, y, callbacks=[hvd.callbacks.BroadcastGlobalVariablesCallback(0)])

Cross-step overlap ("auto" by default) and decoupled reduction (``decouple=True``) work
within each call of ``compile(steps_per_execution=N)`` with N > 1, which ends with the
weights exactly as plain Horovod's (:mod:`tfoverlap.horovod.adapters.keras_fit`).
"""
from __future__ import annotations

from tfoverlap.horovod.adapters import keras_fit, keras_hooks
from tfoverlap.horovod.adapters.horovods import (consolidate_optimizer_state, horovods,
                                                 not_converted, plans_in_call)
from tfoverlap.horovod.core.contract import reduction_of
from tfoverlap.horovod.core.decisions import decisions
from tfoverlap.horovod.settings import configure

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
    planned = plans_in_call(reduction)
    wrapped = horovods(hvd_keras, "DistributedOptimizer")(
        optimizer, name=name, device_dense=device_dense, device_sparse=device_sparse,
        compression=reduction["compression"], sparse_as_dense=sparse_as_dense,
        gradient_predivide_factor=gradient_predivide_factor, op=reduction["op"],
        backward_passes_per_step=backward_passes_per_step,
        average_aggregated_gradients=average_aggregated_gradients, num_groups=num_groups,
        groups=groups, process_set=reduction["process_set"],
        scale_local_gradients=scale_local_gradients)
    if planned:
        keras_fit.register(wrapped, reduction)
        keras_hooks.install()
    return wrapped


def cross_step_decision(model) -> dict | None:
    """What was decided for ``model.fit``'s train function, as a dict (None before its
    first trace): kept from before :func:`decisions`, which reports every API."""
    return keras_fit.decision_for(model)


def __getattr__(name: str):
    import horovod.tensorflow.keras as hvd_keras
    try:
        return getattr(hvd_keras, name)
    except AttributeError:
        raise AttributeError(f"module 'tfoverlap.horovod.keras' has no attribute {name!r} "
                             "(nor has horovod.tensorflow.keras)") from None
