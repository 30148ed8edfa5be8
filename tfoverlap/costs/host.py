"""Facts about this host that estimates need when nothing was profiled: its FLOP rate, the
links to the PS tasks that this process measured, how many workers its cluster has, and
which PS task shares this task's host.

The FLOP rate is measured once per process with numpy (no TensorFlow session: the Grappler
plugin calls this from inside TensorFlow's optimizer); the links are measured when a
session starts (:mod:`tfoverlap.integrations.link_probe`) and recorded here.
"""
from __future__ import annotations

import json
import os
import threading
import time

import numpy as np

__all__ = ["measure_flops", "host_flops", "record_link", "measured_links", "record_link_failure",
           "link_failures", "cluster_workers", "colocated_ps_task"]

_lock = threading.Lock()
_measured: dict[str, float] = {}


def measure_flops(size: int = 768, repeats: int = 5) -> float:
    """FLOP/s of a float32 matrix product of ``size`` x ``size`` on this host (median of
    ``repeats`` timed runs after one warm-up)."""
    matrix = np.random.default_rng(0).random((size, size), dtype=np.float32)
    times = []
    for _ in range(repeats + 1):
        began = time.perf_counter()
        np.matmul(matrix, matrix)
        times.append(time.perf_counter() - began)
    return 2 * size ** 3 / max(float(np.median(times[1:])), 1e-9)


def host_flops() -> float:
    """:func:`measure_flops`, measured on first use and remembered for the process."""
    with _lock:
        if "flops" not in _measured:
            _measured["flops"] = measure_flops()
        return _measured["flops"]


#: PS task device ("/job:ps/replica:0/task:0", as TensorFlow names it) -> (bytes/s, round
#: trip seconds) of the link to it, measured by this process.
_links: dict[str, tuple[float, float]] = {}


def record_link(device: str, bandwidth: float, round_trip: float) -> None:
    """Remembers a measured link to a PS task for the rest of the process."""
    with _lock:
        _links[device] = (float(bandwidth), float(round_trip))


def measured_links() -> dict[str, tuple[float, float]]:
    """The links this process measured: device -> (bytes/s, round trip seconds)."""
    with _lock:
        return dict(_links)


#: PS task device -> why its link could not be measured (a probe failed, ran out of time or
#: gave a figure no link can have); such a link is not probed again by this process.
_link_failures: dict[str, str] = {}


def record_link_failure(device: str, reason: str) -> None:
    """Remembers that the link to a PS task could not be measured, and why."""
    with _lock:
        _link_failures[device] = reason


def link_failures() -> dict[str, str]:
    """The links this process could not measure: device -> why."""
    with _lock:
        return dict(_link_failures)


def cluster_workers(ps_jobs=("ps",)) -> int:
    """How many training tasks the cluster in ``TF_CONFIG`` (tf.distribute's environment
    variable) has: those of jobs other than ``ps_jobs`` and "evaluator". In parameter-server
    training each of them pulls from every PS task. 0 where TF_CONFIG is unset or holds no
    cluster."""
    try:
        cluster = json.loads(os.environ.get("TF_CONFIG") or "{}").get("cluster") or {}
        return sum(len(tasks) for job, tasks in cluster.items()
                   if job not in ps_jobs and job != "evaluator")
    except (ValueError, AttributeError, TypeError):
        return 0


_LOOPBACK_HOSTS = ("localhost", "127.", "::1", "[::1]")


def colocated_ps_task(ps_jobs=("ps",)) -> str | None:
    """The PS task ("job:index") that the cluster in ``TF_CONFIG`` puts on this task's
    host (the same address host, on another port), or None: no TF_CONFIG, no such task,
    or a loopback address, where every task of a one-machine cluster shares the host but
    no link."""
    try:
        config = json.loads(os.environ.get("TF_CONFIG") or "{}")
        cluster, task = config.get("cluster") or {}, config.get("task") or {}
        own = cluster[task["type"]][int(task.get("index", 0))]
    except (ValueError, AttributeError, TypeError, KeyError, IndexError):
        return None
    host = str(own).rsplit(":", 1)[0]
    if not host or host.startswith(_LOOPBACK_HOSTS):
        return None
    for job in sorted(ps_jobs):
        for index, address in enumerate(cluster.get(job) or []):
            if str(address).rsplit(":", 1)[0] == host:
                return f"{job}:{index}"
    return None
