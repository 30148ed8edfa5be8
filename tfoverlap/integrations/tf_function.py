"""The Grappler config of TF2 ``tf.function`` graphs, which TensorFlow keeps in a private
per-thread context: the one place that touches TensorFlow internals with no public API.

``ParameterServerStrategy``: a ``ClusterCoordinator`` dispatches each scheduled function
from one of its own threads (one per worker), where the config set in the program's thread
is not seen, so :func:`carry_config_to_coordinator` hands the scheduling thread's config to
the dispatching thread. The coordinator sends the function, with that config, to the worker
task, and Grappler runs *there*, on the whole multi-device function (PS and worker ops)
before it is cut into components: the worker processes must have the plugin loaded.
"""
from __future__ import annotations

import threading

__all__ = ["get_function_config", "set_function_config", "carry_config_to_coordinator",
           "coordinator_dispatches", "WORKERS_OPTIMIZE"]

WORKERS_OPTIMIZE = (
    "tfoverlap: functions scheduled on a ClusterCoordinator are optimized by the worker "
    "tasks, which run Grappler for them: start each worker's server with tfoverlap loaded "
    "(`import tfoverlap`, or under `tfoverlap run`), or TfOverlap is silently skipped there; "
    "the workers write the reports")
_hook_lock = threading.Lock()
_hooked = False
_dispatched = 0


def get_function_config():
    """The ConfigProto that Grappler uses for tf.function graphs run from this thread."""
    from tensorflow.core.protobuf import config_pb2
    from tensorflow.python.eager import context
    config = config_pb2.ConfigProto()
    serialized = context.context().function_call_options.config_proto_serialized
    if serialized:
        config.ParseFromString(serialized)
    return config


def set_function_config(config) -> None:
    """Makes ``config`` the Grappler config of tf.function graphs run from this thread.

    TensorFlow reads it when a concrete function is first called: functions that already
    ran keep the config they were optimized with.
    """
    from tensorflow.python.eager import context
    options = context.context().function_call_options
    options.config_proto_serialized = config
    context.context().function_call_options = options


def coordinator_dispatches() -> int:
    """How many closures this process dispatched to workers with TfOverlap switched on."""
    return _dispatched


def _names_tfoverlap(config) -> bool:
    from tfoverlap.integrations.grappler import OPTIMIZER_NAME
    return any(optimizer.name == OPTIMIZER_NAME
               for optimizer in config.graph_options.rewrite_options.custom_optimizers)


def carry_config_to_coordinator() -> None:
    """Closures that a ``ClusterCoordinator`` schedules run under the function config of
    the thread that scheduled them (idempotent)."""
    global _hooked
    with _hook_lock:
        if _hooked:
            return
        _hooked = True
    from tensorflow.python.distribute.coordinator import cluster_coordinator
    closure = cluster_coordinator.Closure
    original_init, original_execute = closure.__init__, closure.execute_on

    def __init__(self, *args, **kwargs):
        original_init(self, *args, **kwargs)
        self._tfoverlap_config = get_function_config()

    def execute_on(self, worker):
        global _dispatched
        scheduled = getattr(self, "_tfoverlap_config", None)
        if scheduled is None or not _names_tfoverlap(scheduled):
            return original_execute(self, worker)
        from tfoverlap.integrations.link_probe import coordinator_link, with_link
        from tfoverlap.log import warn_once
        warn_once(WORKERS_OPTIMIZE)
        link = coordinator_link(scheduled, worker.device_name)
        if link is not None:
            scheduled = with_link(scheduled, *link)
        with _hook_lock:
            _dispatched += 1
        previous = get_function_config()
        set_function_config(scheduled)
        try:
            return original_execute(self, worker)
        finally:
            set_function_config(previous)

    closure.__init__, closure.execute_on = __init__, execute_on
