"""Drop-in Horovod wrappers that train with Caramel's schedule.

``import tfoverlap.horovod as tfo_hvd`` and use ``tfo_hvd.DistributedOptimizer`` /
``tfo_hvd.DistributedGradientTape`` where the program used Horovod's (same arguments,
same results); ``tfoverlap.horovod.keras`` for Keras. Graph-mode optimizers are planned
and rewritten as their graph is built; TF2 steps are planned by the TfOverlap optimizer
when traced. Cross-step overlap ("auto" by default) and decoupled reduction (off by
default) move reductions under the next step's forward pass where the plan predicts a
gain and the contract allows (docs/horovod.md). :func:`configure` sets the options (the
network model and op times are otherwise measured once, on rank 0, for every rank);
:func:`decisions` says what was decided for every wrapped optimizer, tape step and Keras
train function, and why a mechanism was declined.
"""
from __future__ import annotations

import sys

from tfoverlap.horovod.core.decisions import Decision, decisions
from tfoverlap.horovod.measure import host_facts, measure_flops, measure_network, warmup_profile
from tfoverlap.horovod.settings import caramel_options, configure, network_model
from tfoverlap.horovod.wrappers import (DistributedGradientTape, DistributedOptimizer,
                                        consolidate_optimizer_state, flush_op)

__all__ = ["DistributedOptimizer", "DistributedGradientTape", "configure", "measure_network",
           "measure_flops", "host_facts", "network_model", "caramel_options", "flush_op",
           "warmup_profile", "consolidate_optimizer_state", "decisions", "Decision"]

if "tensorflow" in sys.modules:
    # A tape step's loop may be traced before its first tape is made: hook loops now.
    from tfoverlap.horovod.in_call.loops import install as _install_loop_hooks
    _install_loop_hooks()
