"""Drop-in Horovod wrappers that train with Caramel's schedule.

``import tfoverlap.horovod as tfo_hvd`` and use ``tfo_hvd.DistributedOptimizer`` /
``tfo_hvd.DistributedGradientTape`` where the program used Horovod's: same arguments, same
results, with the backward order fixed and the gradients reduced in planned buckets.

- *Graph mode* (``tf.compat.v1`` optimizers): the gradients are reduced by plain
  ``HorovodAllreduce`` ops (Horovod's own wrapper hides them in a cond that only
  Grappler folds), the Caramel pass is run on the graph as it stands and its rewrite is
  applied to the graph in place (:mod:`tfoverlap.integrations.live_graph`). Sessions need no flag.
- *TF2* (``tf.function`` training steps, Keras optimizers, the tape): Horovod's wrapper is
  used as is and the TfOverlap optimizer is switched on for the ``tf.function`` graphs of
  this thread (:func:`tfoverlap.enable_for_tf_function`), where Grappler has folded the cond.
  Eagerly executed steps have no graph to schedule and run as plain Horovod.

Cross-step overlap (on where the plan predicts a gain) runs in graph mode
(:mod:`tfoverlap.horovod.deferred`), in Keras ``model.fit`` with several steps per call
(:mod:`tfoverlap.horovod.keras_deferred`) and for tape steps in a loop inside one
``tf.function`` (:mod:`tfoverlap.horovod.tape_deferred`). Graph mode and such tape loops
also offer decoupled reduction (:mod:`tfoverlap.horovod.decoupled`,
:mod:`tfoverlap.horovod.tape_decoupled`, ``configure(decouple=...)``, off by default;
:func:`consolidate_optimizer_state` on every rank before a save on one).

The network model (alpha, beta) is what :func:`configure` was given, else it is measured
once with a few AllReduces of two sizes. Op times come from a profile (``profile=``), from
a profiled warm-up of the graph being built (``profile_steps=N``, graph mode: N traced
steps of the gradients in a private copy of the graph,
:mod:`tfoverlap.integrations.warmup_profile`), else from TensorFlow's FLOP counts over a
measured matrix-product rate. Rank 0's measurements, profile and host facts (compute
threads, Horovod's cycle) are used by every rank so that all ranks plan alike.

:func:`decisions` says, for every wrapped optimizer (graph mode), tape step and Keras
train function, which mechanism runs, what it deferred, the predicted and in-step step,
and why a mechanism asked for was declined. What each mechanism can carry out (``op``,
compression, groups, ...) is decided by rules written once for every API
(:mod:`tfoverlap.horovod.contract`).
"""
from __future__ import annotations

import sys

from tfoverlap.horovod.decisions import Decision, decisions
from tfoverlap.horovod.measure import host_facts, measure_flops, measure_network, warmup_profile
from tfoverlap.horovod.settings import caramel_options, configure, network_model
from tfoverlap.horovod.wrappers import (DistributedGradientTape, DistributedOptimizer,
                                        consolidate_optimizer_state, flush_op)

__all__ = ["DistributedOptimizer", "DistributedGradientTape", "configure", "measure_network",
           "measure_flops", "host_facts", "network_model", "caramel_options", "flush_op",
           "warmup_profile", "consolidate_optimizer_state", "decisions", "Decision"]

if "tensorflow" in sys.modules:
    # A tape step's loop may be traced before its first tape is made: hook loops now.
    from tfoverlap.horovod.tape_deferred import install as _install_loop_hooks
    _install_loop_hooks()
