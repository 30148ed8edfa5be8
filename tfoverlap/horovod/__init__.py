"""Drop-in Horovod wrappers that train with Caramel's schedule (docs/horovod.md).

``import tfoverlap.horovod as tfo_hvd`` and use ``tfo_hvd.DistributedOptimizer`` /
``tfo_hvd.DistributedGradientTape`` where the program used Horovod's (same arguments,
same results); ``tfoverlap.horovod.keras`` for Keras. Cross-step overlap ("auto" by
default) and decoupled reduction (off by default) move reductions under the next step's
forward pass where the plan predicts a gain and the contract allows. :func:`configure`
sets the options; :func:`decisions` says what was decided for every wrapped optimizer,
tape step and Keras train function, and why a mechanism was declined.
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
    # A tape step's loop may be traced before its first tape is made: hook loops now; and
    # a graph may be run by a session before its train op is built: watch sessions now.
    from tfoverlap.horovod.in_call.loops import install as _install_loop_hooks
    from tfoverlap.horovod.session.pending import watch_sessions as _watch_sessions
    _install_loop_hooks()
    _watch_sessions()
