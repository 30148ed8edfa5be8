"""The drop-in ``DistributedOptimizer`` (graph mode; a Keras optimizer goes to
:mod:`tfoverlap.horovod.keras`) and ``DistributedGradientTape``: Horovod's wrappers, planned
by Caramel (:mod:`tfoverlap.horovod.adapters`)."""
from __future__ import annotations

from tfoverlap.horovod.adapters.horovods import (consolidate_optimizer_state, horovods,
                                                 not_converted, plans_in_call)
from tfoverlap.horovod.core.contract import keeps_horovods_reduction, reduction_of
from tfoverlap.horovod.session.pending import flush_op
from tfoverlap.horovod.settings import wrapper_option
from tfoverlap.log import logger

__all__ = ["DistributedOptimizer", "DistributedGradientTape", "flush_op",
           "consolidate_optimizer_state"]


@not_converted
def DistributedOptimizer(optimizer, name=None, use_locking=False, device_dense="",
                         device_sparse="", compression=None, sparse_as_dense=False,
                         backward_passes_per_step=1, op=None, gradient_predivide_factor=1.0,
                         average_aggregated_gradients=False, num_groups=0, groups=None,
                         process_set=None, scale_local_gradients=True):
    """``hvd.DistributedOptimizer`` with Caramel's schedule (same arguments). Explicit
    ``groups``, gradient accumulation and Adasum keep Horovod's own reduction, with a
    warning."""
    import horovod.tensorflow as hvd
    import tensorflow as tf
    if not isinstance(optimizer, tf.compat.v1.train.Optimizer) and op != hvd.Adasum:
        # Horovod hands a Keras optimizer to horovod.tensorflow.keras, with these
        # arguments (op and groups are not among them); tfoverlap to its Keras wrapper.
        from tfoverlap.horovod.keras import DistributedOptimizer as keras_wrapper
        return keras_wrapper(
            optimizer, name=name, device_dense=device_dense, device_sparse=device_sparse,
            compression=compression, sparse_as_dense=sparse_as_dense,
            gradient_predivide_factor=gradient_predivide_factor,
            backward_passes_per_step=backward_passes_per_step,
            average_aggregated_gradients=average_aggregated_gradients,
            process_set=process_set, scale_local_gradients=scale_local_gradients)
    reduction = reduction_of(device_dense, device_sparse, compression, sparse_as_dense, op,
                             gradient_predivide_factor, process_set, backward_passes_per_step,
                             groups, num_groups)
    wrapped = horovods(hvd, "DistributedOptimizer")(
        optimizer, name=name, use_locking=use_locking, device_dense=device_dense,
        device_sparse=device_sparse, compression=reduction["compression"],
        sparse_as_dense=sparse_as_dense, backward_passes_per_step=backward_passes_per_step,
        op=reduction["op"], gradient_predivide_factor=gradient_predivide_factor,
        average_aggregated_gradients=average_aggregated_gradients, num_groups=num_groups,
        groups=groups, process_set=reduction["process_set"],
        scale_local_gradients=scale_local_gradients)
    if keeps_horovods_reduction(reduction):
        return wrapped
    if tf.executing_eagerly():
        logger.warning("tfoverlap: a tf.compat.v1 optimizer run eagerly has no graph to "
                       "schedule; plain Horovod is used")
        return wrapped

    from tfoverlap.horovod.adapters.graph import attach
    attach(wrapped, optimizer, reduction)
    return wrapped


@not_converted
def DistributedGradientTape(gradtape, device_dense="", device_sparse="", compression=None,
                            sparse_as_dense=False, op=None, gradient_predivide_factor=1.0,
                            num_groups=0, groups=None, process_set=None,
                            scale_local_gradients=True):
    """``hvd.DistributedGradientTape`` with Caramel's schedule for ``tf.function`` steps
    (same arguments), deferred or decoupled where they run in a loop inside one call
    (:mod:`tfoverlap.horovod.adapters.tape`)."""
    import horovod.tensorflow as hvd
    reduction = reduction_of(device_dense, device_sparse, compression, sparse_as_dense, op,
                             gradient_predivide_factor, process_set, groups=groups,
                             num_groups=num_groups)
    planned = plans_in_call(reduction)
    tape = horovods(hvd, "DistributedGradientTape")(
        gradtape, device_dense=device_dense, device_sparse=device_sparse,
        compression=reduction["compression"], sparse_as_dense=sparse_as_dense,
        op=reduction["op"], gradient_predivide_factor=gradient_predivide_factor,
        num_groups=num_groups, groups=groups, process_set=reduction["process_set"],
        scale_local_gradients=scale_local_gradients)
    if planned:
        from tfoverlap.horovod.adapters.tape import attach
        attach(tape, reduction, wrapper_option("cross_step", "auto"))
    return tape
