"""The reduction rules of the Horovod wrappers, written once for every API and mechanism:
Horovod's reduction arguments as plain data (:func:`reduction_of`), and per mechanism why
it cannot carry them out ("" where it can), so that ``op=hvd.Sum`` or Adasum mean the
same in a graph, a tape loop and ``fit``."""
from __future__ import annotations

from tfoverlap.log import logger

__all__ = ["reduction_of", "horovods_reduction_kept", "deferral_refused_by_reduction",
           "decoupling_refused_by_reduction", "keeps_horovods_reduction",
           "reduce_without_cond"]


def reduction_of(device_dense="", device_sparse="", compression=None, sparse_as_dense=False,
                 op=None, gradient_predivide_factor=1.0, process_set=None,
                 backward_passes_per_step=1, groups=None, num_groups=0) -> dict:
    """Horovod's reduction arguments, its defaults filled in, as one plain dict."""
    import horovod.tensorflow as hvd
    return dict(device_dense=device_dense, device_sparse=device_sparse,
                compression=hvd.Compression.none if compression is None else compression,
                sparse_as_dense=bool(sparse_as_dense),
                op=hvd.Average if op is None else op,
                gradient_predivide_factor=gradient_predivide_factor,
                process_set=hvd.global_process_set if process_set is None else process_set,
                backward_passes_per_step=backward_passes_per_step, groups=groups,
                num_groups=num_groups)


def horovods_reduction_kept(reduction: dict) -> str:
    """Why a wrapper must leave the whole reduction to Horovod ("" where it need not):
    explicit groups (Caramel's buckets would replace them), gradient accumulation and
    Adasum (they reduce otherwise than one AllReduce per step)."""
    import horovod.tensorflow as hvd
    reasons = [reason for reason, present in (
        ("explicit groups", reduction["groups"] is not None or reduction["num_groups"]),
        ("backward_passes_per_step > 1", reduction["backward_passes_per_step"] > 1),
        ("Adasum", reduction["op"] == hvd.Adasum)) if present]
    return ", ".join(reasons)


def keeps_horovods_reduction(reduction: dict) -> bool:
    """Whether a wrapper must leave the reduction to Horovod, saying so in one warning."""
    kept = horovods_reduction_kept(reduction)
    if kept:
        logger.warning("tfoverlap: %s: Horovod's own reduction is used, without Caramel",
                       kept)
    return bool(kept)


def deferral_refused_by_reduction(reduction: dict) -> str:
    """Why the reduction of gradients reduced with ``reduction`` cannot be deferred ("" if
    it can): only Horovod's own compressions reduce a stored gradient exactly."""
    import horovod.tensorflow as hvd
    compression = reduction["compression"]
    if compression not in (hvd.Compression.none, hvd.Compression.fp16):
        return (f"compression {getattr(compression, '__name__', compression)}: only "
                "Horovod's none and fp16 are known to reduce a stored gradient exactly")
    return ""


def decoupling_refused_by_reduction(reduction: dict) -> str:
    """Why gradients reduced with ``reduction`` cannot be reduce-scattered instead ("" where
    they can): a reduce-scatter sums or averages the plain gradients, nothing else."""
    import horovod.tensorflow as hvd
    if reduction["compression"] is not hvd.Compression.none:
        return "compression: only uncompressed gradients are reduce-scattered"
    if reduction["op"] not in (hvd.Average, hvd.Sum):
        return "only Horovod's Average and Sum are reduce-scattered"
    if reduction["gradient_predivide_factor"] != 1.0:
        return "gradient_predivide_factor: only unscaled reductions are reduce-scattered"
    return ""


def reduce_without_cond(grads, reduction: dict):
    """Horovod's gradient reduction as plain ops (what Horovod's cond holds), with the
    arguments of ``reduction`` (:func:`reduction_of`)."""
    import horovod.tensorflow as hvd
    import tensorflow as tf
    op, gradient_predivide_factor = reduction["op"], reduction["gradient_predivide_factor"]
    if op == hvd.Average and gradient_predivide_factor != 1.0:
        prescale, postscale = 1.0 / gradient_predivide_factor, gradient_predivide_factor
    else:
        prescale = postscale = 1.0
    reduced = []
    for grad in grads:
        if grad is None:
            reduced.append(None)
            continue
        if reduction["sparse_as_dense"] and isinstance(grad, tf.IndexedSlices):
            grad = tf.convert_to_tensor(grad)
        reduced.append(hvd.allreduce(grad, device_dense=reduction["device_dense"],
                                     device_sparse=reduction["device_sparse"],
                                     compression=reduction["compression"], op=op,
                                     prescale_factor=prescale, postscale_factor=postscale,
                                     process_set=reduction["process_set"]))
    return reduced
