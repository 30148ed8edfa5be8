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
"""
from __future__ import annotations

from tfoverlap.horovod.wrappers import enable_for_functions, keeps_horovods_reduction

__all__ = ["DistributedOptimizer"]


def DistributedOptimizer(optimizer, name=None, device_dense="", device_sparse="",
                         compression=None, sparse_as_dense=False,
                         gradient_predivide_factor=1.0, op=None, backward_passes_per_step=1,
                         average_aggregated_gradients=False, num_groups=0, groups=None,
                         process_set=None, scale_local_gradients=True):
    """``horovod.tensorflow.keras.DistributedOptimizer`` with Caramel's schedule (same
    arguments). Explicit groups, gradient accumulation and Adasum keep Horovod's own
    reduction, with a warning."""
    import horovod.tensorflow as hvd
    import horovod.tensorflow.keras as hvd_keras
    compression = hvd.Compression.none if compression is None else compression
    op = hvd.Average if op is None else op
    process_set = hvd.global_process_set if process_set is None else process_set
    if not keeps_horovods_reduction(groups, num_groups, backward_passes_per_step, op):
        enable_for_functions()
    return hvd_keras.DistributedOptimizer(
        optimizer, name=name, device_dense=device_dense, device_sparse=device_sparse,
        compression=compression, sparse_as_dense=sparse_as_dense,
        gradient_predivide_factor=gradient_predivide_factor, op=op,
        backward_passes_per_step=backward_passes_per_step,
        average_aggregated_gradients=average_aggregated_gradients, num_groups=num_groups,
        groups=groups, process_set=process_set, scale_local_gradients=scale_local_gradients)


def __getattr__(name: str):
    import horovod.tensorflow.keras as hvd_keras
    try:
        return getattr(hvd_keras, name)
    except AttributeError:
        raise AttributeError(f"module 'tfoverlap.horovod.keras' has no attribute {name!r} "
                             "(nor has horovod.tensorflow.keras)") from None
