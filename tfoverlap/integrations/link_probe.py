"""Measuring the link to each parameter server once per process, when a session starts.

TicTac's gain estimate and its credit need the link's bandwidth and round trip, and a
Grappler optimizer cannot measure them: it sees device names, not addresses, and runs
inside session creation. A TF1 session created with a ``grpc://`` target and a config
that switches TfOverlap on (and leaves ``bandwidth`` unset) is the moment to measure:
before it runs anything, a separate probe session on the same target times a tiny and an
8 MB fetch from every PS task its graph uses. The round trip is the tiny fetch; the
bandwidth is the extra bytes over the extra time. The results go to
:mod:`tfoverlap.costs.host`, where the pass finds them. Nothing of the user's graph or
variables is touched; the probe creates its tensors on the PS and frees them.
"""
from __future__ import annotations

import functools
import statistics
import threading
import time

from tfoverlap.costs.host import measured_links, record_link
from tfoverlap.graph.devices import DeviceMatcher
from tfoverlap.integrations.grappler import OPTIMIZER_NAME
from tfoverlap.log import logger, warn_once
from tfoverlap.options import parse_options

__all__ = ["measure_ps_link", "install_session_hook", "PROBE_BYTES"]

PROBE_BYTES = 8 * 2 ** 20
_install_lock = threading.Lock()
_installed = False
_measuring = threading.local()


def measure_ps_link(target: str, ps_device: str, worker_device: str = "",
                    probe_bytes: int = PROBE_BYTES, repeats: int = 3,
                    timeout_ms: int = 30_000) -> tuple[float, float]:
    """(bytes/s, round trip seconds) of fetching from ``ps_device`` to ``worker_device``
    (the session's own device where empty) through ``target``."""
    import tensorflow as tf
    graph = tf.Graph()
    with graph.as_default():
        one = tf.compat.v1.placeholder_with_default(1.0, [])   # keeps Fill from folding
        with tf.device(ps_device):
            tiny = tf.fill([1], one)
            large = tf.fill([probe_bytes // 4], one)
        with tf.device(worker_device or None):
            tiny_sum, large_sum = tf.reduce_sum(tiny), tf.reduce_sum(large)
    config = tf.compat.v1.ConfigProto()
    config.graph_options.rewrite_options.disable_meta_optimizer = True
    options = tf.compat.v1.RunOptions(timeout_in_ms=timeout_ms)
    _measuring.active = True
    try:
        with tf.compat.v1.Session(target, graph=graph, config=config) as session:
            def timed(fetch):
                session.run(fetch, options=options)      # warm-up
                times = []
                for _ in range(repeats):
                    began = time.perf_counter()
                    session.run(fetch, options=options)
                    times.append(time.perf_counter() - began)
                return statistics.median(times)
            round_trip = timed(tiny_sum)
            large_time = timed(large_sum)
    finally:
        _measuring.active = False
    bandwidth = probe_bytes / max(large_time - round_trip, 1e-6)
    return bandwidth, round_trip


def _wants_measurement(config) -> list[str] | None:
    """The PS device specs of a config that switches TfOverlap on without a bandwidth."""
    if config is None:
        return None
    for optimizer in config.graph_options.rewrite_options.custom_optimizers:
        if optimizer.name != OPTIMIZER_NAME:
            continue
        parameters = optimizer.parameter_map
        if "bandwidth" in parameters and (parameters["bandwidth"].f or parameters["bandwidth"].i
                                          or parameters["bandwidth"].s not in (b"", b"auto")):
            return None
        schedule = parameters["schedule"].s.decode() if "schedule" in parameters else "tic"
        if schedule == "none":
            return None
        spec = (parameters["ps_devices"].s.decode() if "ps_devices" in parameters
                else parse_options().ps_devices)
        return [s.strip() for s in spec.split(",") if s.strip()]
    return None


def _placement(graph, specs: list[str]) -> tuple[list[str], str]:
    """(the PS task devices, "/job:ps/replica:0/task:0", that ops of ``graph`` are placed
    on; the device most of its other placed ops are on, "" if none)."""
    import collections

    from tensorflow.python.framework import device as tf_device
    matchers = [DeviceMatcher(spec) for spec in specs]
    tasks, others = set(), collections.Counter()
    for op in graph.get_operations():
        if not op.device:
            continue
        if any(matches(op.device) for matches in matchers):
            parsed = tf_device.DeviceSpec.from_string(op.device)
            tasks.add(f"/job:{parsed.job}/replica:{parsed.replica or 0}/task:{parsed.task or 0}")
        else:
            others[op.device] += 1
    return sorted(tasks), (others.most_common(1)[0][0] if others else "")


def _measure_for_session(target, graph, config) -> None:
    if getattr(_measuring, "active", False) or not isinstance(target, str):
        return
    if not target.startswith("grpc://"):
        return
    specs = _wants_measurement(config)
    if not specs:
        return
    import tensorflow as tf
    graph = graph if graph is not None else tf.compat.v1.get_default_graph()
    known = measured_links()
    tasks, worker_device = _placement(graph, specs)
    for task in tasks:
        if any(device.startswith(task) for device in known):
            continue
        try:
            bandwidth, round_trip = measure_ps_link(target, task, worker_device)
        except Exception as error:  # noqa: BLE001 - measuring must never stop a session
            warn_once(f"tfoverlap: could not measure the link to {task} ({type(error).__name__}:"
                      f" {error}); TicTac assumes 1 Gbit/s (set the bandwidth option)")
            continue
        record_link(f"{task}/device:CPU:0", bandwidth, round_trip)
        logger.info("tfoverlap: measured the link to %s: %.3g Gbit/s, round trip %.3g ms",
                    task, bandwidth * 8 / 1e9, round_trip * 1e3)


def install_session_hook() -> None:
    """Makes every TF1 session that switches TfOverlap on measure its PS links first
    (once per PS task and process). Safe to call any number of times."""
    global _installed
    with _install_lock:
        if _installed:
            return
        from tensorflow.python.client import session as session_module
        original = session_module.Session.__init__

        @functools.wraps(original)
        def __init__(self, target="", graph=None, config=None):
            _measure_for_session(target, graph, config)
            original(self, target, graph, config)

        session_module.Session.__init__ = __init__
        _installed = True
