"""Measuring the link to each parameter server once per process, when a session starts.

TicTac's gain estimate and its credit need the link's bandwidth and round trip, and a
Grappler optimizer cannot measure them: it sees device names, not addresses, and runs
inside session creation. A TF1 session created with a ``grpc://`` target and a config
that switches TfOverlap on (and leaves ``bandwidth`` unset) is the moment to measure:
before it runs anything, a separate probe session on the same target times a tiny fetch
(the round trip) and two large ones, one twice the other, from every PS task its graph
uses, and the same two on the worker alone (so that creating and summing the tensor does
not count as transfer time). The bandwidth is the extra bytes over the extra time, in the
fastest of several rounds: workers that start together also probe together.

The probe never makes a session start wait for what plain TensorFlow would not wait for:
its session keeps the program's config (device filters, cluster, timeouts), waits only for
the tasks it measures, and gets :data:`PROBE_SECONDS` in all (times the ``dilation``
option, on a testbed that slows its links by it). A probe that fails, runs out
of time or measures a figure no link can have is remembered for the process (one warning),
and TicTac plans with the assumed link, saying so in its report. The results go to
:mod:`tfoverlap.costs.host`, where the pass finds them. Nothing of the user's graph or
variables is touched; the probe creates its tensors on the PS and frees them.

Many PS tasks share the time: each gets an equal part of what is left, at least two timed
rounds, and more while its part lasts. Workers that start together probe the PS tasks in
turn from the one after their own index (:func:`probe_order`), not all the first one at
once, and a PS task that ``TF_CONFIG`` puts on the worker's own host is not probed: its
bytes never cross the host's link.
"""
from __future__ import annotations

import functools
import random
import statistics
import threading
import time

from tfoverlap.costs.host import (colocated_ps_task, link_failures, measured_links, record_link,
                                  record_link_failure)
from tfoverlap.graph.devices import DeviceMatcher
from tfoverlap.integrations.grappler import OPTIMIZER_NAME, options_from_parameters
from tfoverlap.log import logger
from tfoverlap.options import parse_options

__all__ = ["measure_ps_links", "link_from_timings", "link_from_rounds", "install_session_hook",
           "coordinator_link", "with_link", "probe_order", "probe_seconds",
           "ImplausibleLink", "PROBE_BYTES", "PROBE_SECONDS", "MAX_PLAUSIBLE_BANDWIDTH"]

#: the largest fetch; the probe sizes its two down to about PROBE_TRANSFER_SECONDS together.
PROBE_BYTES = 32 * 2 ** 20
PROBE_TRANSFER_SECONDS = 0.05
#: the most a session start waits for the probe, all its PS tasks together.
PROBE_SECONDS = 5.0
#: 400 Gbit/s, faster than any NIC a PS job runs on: a figure above it is noise.
MAX_PLAUSIBLE_BANDWIDTH = 50e9

_install_lock = threading.Lock()
_installed = False
_measuring = threading.local()
_warned = threading.Event()


class ImplausibleLink(ValueError):
    """The probe's timings give a figure that no link can have."""


def link_from_timings(extra_bytes: int, smaller_s: float, larger_s: float,
                      local_smaller_s: float = 0.0, local_larger_s: float = 0.0) -> float:
    """Bytes/s from the median times of two fetches from the PS, the larger one
    ``extra_bytes`` more, and of the same two made on the worker alone (the work that is
    not transfer). Two sizes, not a tiny and a large one: a shaped link's burst allowance
    then speeds both alike and cancels. ImplausibleLink where the extra bytes took no time
    or the rate exceeds any real link."""
    transfer_s = (larger_s - smaller_s) - max(local_larger_s - local_smaller_s, 0.0)
    if transfer_s <= 0:
        raise ImplausibleLink(
            f"{extra_bytes / 2 ** 20:.3g} MiB more took no longer once the worker's own work "
            f"is taken off ({larger_s * 1e3:.3g} ms against {smaller_s * 1e3:.3g} ms)")
    bandwidth = extra_bytes / transfer_s
    if bandwidth > MAX_PLAUSIBLE_BANDWIDTH:
        raise ImplausibleLink(f"it measured {bandwidth * 8 / 1e9:.3g} Gbit/s, more than "
                              f"{MAX_PLAUSIBLE_BANDWIDTH * 8 / 1e9:.3g} Gbit/s")
    return bandwidth


def link_from_rounds(extra_bytes: int, rounds: list[tuple[float, float, float, float]]
                     ) -> float:
    """Bytes/s from rounds of (smaller, larger, local smaller, local larger) fetch times
    (:func:`link_from_timings`): the fastest plausible round, the worker's own work taken
    as its median. Workers that start together probe together and share the PS link; a
    round that ran while the others' did not shows the link's own rate."""
    local_work = statistics.median(larger - smaller for _, _, smaller, larger in rounds)
    rates, rejected = [], None
    for smaller, larger, _, _ in rounds:
        try:
            rates.append(link_from_timings(extra_bytes, smaller, larger, 0.0, local_work))
        except ImplausibleLink as error:
            rejected = error
    if not rates:
        raise rejected
    return max(rates)


def _probe_config(config, ps_tasks: list[str], worker_device: str):
    """The program's config for the probe's session: its device filters, cluster and
    timeouts stay; Grappler is off. Without filters of its own, the probe waits only for
    the tasks it measures and its worker."""
    import tensorflow as tf
    probe = tf.compat.v1.ConfigProto()
    if config is not None:
        probe.CopyFrom(config)
    probe.graph_options.rewrite_options.ClearField("custom_optimizers")
    probe.graph_options.rewrite_options.disable_meta_optimizer = True
    worker_task = _task_of(worker_device)
    if not probe.device_filters and worker_task:
        probe.device_filters.extend(ps_tasks + [worker_task])
    return probe


def _task_of(device: str) -> str:
    """"/job:ps/replica:0/task:1" of a device name; "" where it names no job."""
    from tensorflow.python.framework import device as tf_device
    parsed = tf_device.DeviceSpec.from_string(device or "")
    if not parsed.job:
        return ""
    return f"/job:{parsed.job}/replica:{parsed.replica or 0}/task:{parsed.task or 0}"


def _task_key(task: str) -> tuple[str, int]:
    """(job, task index) of "/job:ps/replica:0/task:10", for sorting task 10 after task 2."""
    from tensorflow.python.framework import device as tf_device
    parsed = tf_device.DeviceSpec.from_string(task)
    return parsed.job or "", parsed.task or 0


def probe_order(tasks: list[str], worker_index: int | None) -> list[str]:
    """The order in which the worker of ``worker_index`` probes ``tasks``: by job and task
    index, starting after its own index and going round. Workers that start together then
    probe different PS tasks at once (with a PS task per worker, one each), and the task of
    the worker's own index, on a colocated cluster the one on its own host, comes last."""
    ordered = sorted(tasks, key=_task_key)
    if worker_index is None or not ordered:
        return ordered
    start = (worker_index + 1) % len(ordered)
    return ordered[start:] + ordered[:start]


def measure_ps_links(target: str, ps_tasks: list[str], worker_device: str = "", config=None,
                     deadline: float | None = None, probe_bytes: int = PROBE_BYTES,
                     repeats: int = 5, on_result=None) -> dict:
    """Measures the link from each of ``ps_tasks`` to ``worker_device`` (the session's own
    device where empty) through ``target``, in one probe session with ``config``'s
    settings (:func:`_probe_config`), in the order given. Returns task -> (bytes/s, round
    trip s), or task -> why not (a string); calls ``on_result(task, result)`` as each is
    known. Runs stop at ``deadline`` (time.monotonic()); each task gets an equal part of
    the time left, in which it runs up to ``repeats`` timed rounds and at least two."""
    import numpy as np
    import tensorflow as tf
    deadline = time.monotonic() + PROBE_SECONDS if deadline is None else deadline
    graph = tf.Graph()
    with graph.as_default():
        one = tf.compat.v1.placeholder_with_default(1.0, [])   # keeps Fill from folding
        size = tf.compat.v1.placeholder_with_default(np.int32(1), [])
        fetches = {}
        for task in ps_tasks + [worker_device or None]:
            with tf.device(task):
                values = tf.fill([size], one)
            with tf.device(worker_device or None):
                fetches[task] = tf.reduce_sum(values)
    results = {}

    def run_once(session, fetch, count) -> float:
        remaining_ms = int((deadline - time.monotonic()) * 1e3)
        if remaining_ms <= 0:
            raise TimeoutError("out of time")
        options = tf.compat.v1.RunOptions(timeout_in_ms=remaining_ms)
        began = time.perf_counter()
        try:
            session.run(fetch, feed_dict={size: count}, options=options)
        except tf.errors.DeadlineExceededError:
            raise TimeoutError("out of time") from None
        return time.perf_counter() - began

    def timed_rounds(session, runs: list[tuple], rounds: int,
                     until: float = float("inf")) -> list[list[float]]:
        """Seconds of each (fetch, count) per round, the runs taken in turn round after
        round (a load that comes and goes then weighs on all alike), after one warm-up
        round; a random pause between rounds keeps workers that probe together apart.
        After the second, a round starts only if one more as long as the last ends by
        ``until`` (time.monotonic()); one cut short by the deadline after two is dropped."""
        for fetch, count in runs:
            run_once(session, fetch, count)
        times, last_round_s = [], 0.0
        for _ in range(rounds):
            if len(times) >= 2 and time.monotonic() + last_round_s > until:
                break
            began = time.monotonic()
            time.sleep(random.uniform(0, PROBE_TRANSFER_SECONDS))
            try:
                times.append([run_once(session, fetch, count) for fetch, count in runs])
            except TimeoutError:
                if len(times) < 2:
                    raise
                break
            last_round_s = time.monotonic() - began
        return times

    _measuring.active = True
    try:
        with tf.compat.v1.Session(target, graph=graph,
                                  config=_probe_config(config, ps_tasks, worker_device)) as s:
            local = fetches[worker_device or None]
            for position, task in enumerate(ps_tasks):
                share_ends = time.monotonic() + (deadline - time.monotonic()) / (
                    len(ps_tasks) - position)
                try:
                    remote = fetches[task]
                    ((round_trip, rough),) = timed_rounds(s, [(remote, 1), (remote, 2 ** 18)], 1)
                    # the 1 MiB fetch sizes the others to about PROBE_TRANSFER_SECONDS
                    rough_rate = 2 ** 20 / max(rough - round_trip, 1e-6)
                    count = int(min(max(rough_rate * PROBE_TRANSFER_SECONDS / 2, 2 ** 20),
                                    probe_bytes / 2)) // 4
                    rounds = timed_rounds(s, [(remote, 1), (remote, count), (remote, 2 * count),
                                              (local, count), (local, 2 * count)], repeats,
                                           until=share_ends)
                    result = (link_from_rounds(count * 4, [r[1:] for r in rounds]),
                              statistics.median(r[0] for r in rounds))
                except ImplausibleLink as error:
                    result = f"rejected: {error}"
                except TimeoutError:
                    raise
                except Exception as error:  # noqa: BLE001 - reported per task
                    result = f"failed: {type(error).__name__}: {_first_line(error)}"
                results[task] = result
                if on_result is not None:
                    on_result(task, result)
    finally:
        _measuring.active = False
    return results


def _first_line(error: BaseException) -> str:
    return (str(error).strip().splitlines() or [""])[0][:200]


def _tfoverlap_parameters(config):
    """The parameter_map of ``config``'s TfOverlap optimizer, or None."""
    if config is None:
        return None
    for optimizer in config.graph_options.rewrite_options.custom_optimizers:
        if optimizer.name == OPTIMIZER_NAME:
            return optimizer.parameter_map
    return None


def probe_seconds(config, seconds: float = PROBE_SECONDS) -> float:
    """The probe's time under ``config``: ``seconds``, times the ``dilation`` option where
    TfOverlap's is given. A dilated testbed slows its links by that factor, so a probe
    that fits its time on the real link fits this much on the dilated one."""
    parameters = _tfoverlap_parameters(config)
    if parameters is None or "dilation" not in parameters:
        return seconds
    try:
        dilation = options_from_parameters(parameters)["dilation"]
        return seconds * parse_options({"dilation": dilation}, check_files=False).dilation
    except ValueError:
        return seconds      # the pass reports the bad option itself


def _wants_measurement(config) -> list[str] | None:
    """The PS device specs of a config that switches TfOverlap on without a bandwidth."""
    parameters = _tfoverlap_parameters(config)
    if parameters is None:
        return None
    if "bandwidth" in parameters and (parameters["bandwidth"].f or parameters["bandwidth"].i
                                      or parameters["bandwidth"].s not in (b"", b"auto")):
        return None
    schedule = parameters["schedule"].s.decode() if "schedule" in parameters else "tic"
    if schedule == "none":
        return None
    spec = (parameters["ps_devices"].s.decode() if "ps_devices" in parameters
            else parse_options().ps_devices)
    return [s.strip() for s in spec.split(",") if s.strip()]


def _placement(graph, specs: list[str]) -> tuple[list[str], str]:
    """(the PS task devices, "/job:ps/replica:0/task:0", that ops of ``graph`` are placed
    on; the device most of its other placed ops are on, "" if none)."""
    import collections

    matchers = [DeviceMatcher(spec) for spec in specs]
    tasks, others = set(), collections.Counter()
    for op in graph.get_operations():
        if not op.device:
            continue
        if any(matches(op.device) for matches in matchers) and _task_of(op.device):
            tasks.add(_task_of(op.device))
        else:
            others[op.device] += 1
    return sorted(tasks), (others.most_common(1)[0][0] if others else "")


def _link_device(task: str) -> str:
    return f"{task}/device:CPU:0"


def _measure_for_session(target, graph, config, seconds: float = PROBE_SECONDS) -> None:
    """Measures the links of a session about to start, at most ``seconds`` (dilated,
    :func:`probe_seconds`); every outcome is recorded in :mod:`tfoverlap.costs.host`, so
    no task is probed twice."""
    if getattr(_measuring, "active", False) or not isinstance(target, str):
        return
    if not target.startswith("grpc://"):
        return
    specs = _wants_measurement(config)
    if not specs:
        return
    import tensorflow as tf
    graph = graph if graph is not None else tf.compat.v1.get_default_graph()
    tasks, worker_device = _placement(graph, specs)
    # This process is the worker probed: the PS task on its own host is left out.
    own_host = colocated_ps_task()
    left_out = set()
    if own_host:
        job, index = own_host.split(":")
        left_out.add(f"/job:{job}/replica:0/task:{index}")
    _measure_tasks(target, tasks, worker_device, config, probe_seconds(config, seconds),
                   left_out)


def _measure_tasks(target: str, tasks: list[str], worker_device: str, config,
                   seconds: float, left_out: set[str] = frozenset()) -> None:
    """Measures the links from those of ``tasks`` not measured yet (nor ``left_out``) to
    ``worker_device`` through ``target``, at most ``seconds``, in :func:`probe_order`;
    records every outcome."""
    known = set(measured_links()) | set(link_failures()) | {_link_device(t) for t in left_out}
    worker = _task_of(worker_device)
    tasks = [task for task in probe_order(tasks, _task_key(worker)[1] if worker else None)
             if _link_device(task) not in known]
    if not tasks:
        return
    outcomes: dict = {}
    lock = threading.Lock()
    abandoned = threading.Event()

    def keep(task, result):
        with lock:
            if not abandoned.is_set():
                outcomes[task] = result

    def probe():
        try:
            measure_ps_links(target, tasks, worker_device, config,
                             deadline=time.monotonic() + seconds, on_result=keep)
        except TimeoutError:
            pass
        except Exception as error:  # noqa: BLE001 - measuring must never stop a session
            for task in tasks:
                keep(task, f"failed: {type(error).__name__}: {_first_line(error)}")

    # A thread, because creating the probe's session can wait for a task without a deadline.
    thread = threading.Thread(target=probe, name="tfoverlap-link-probe", daemon=True)
    thread.start()
    thread.join(seconds)
    with lock:
        abandoned.set()
        found = dict(outcomes)
    for task in tasks:
        result = found.get(task, f"timed out: no answer within {seconds:g} s")
        if isinstance(result, tuple):
            bandwidth, round_trip = result
            record_link(_link_device(task), bandwidth, round_trip)
            logger.info("tfoverlap: measured the link to %s: %.3g Gbit/s, round trip %.3g ms",
                        task, bandwidth * 8 / 1e9, round_trip * 1e3)
        else:
            record_link_failure(_link_device(task), f"probe {result}")
            _warn_failure(task, result)


_coordinator_lock = threading.Lock()
_coordinator_figures: dict[tuple, tuple[float, float] | None] = {}


def coordinator_link(config, worker_device: str, seconds: float = PROBE_SECONDS
                     ) -> tuple[float, float] | None:
    """TF2 ``ParameterServerStrategy``: the link figures (bytes/s, round trip s) for a
    closure that a ``ClusterCoordinator`` sends to ``worker_device`` under ``config``,
    or None where the config gives the bandwidth, does not order, or no link could be
    measured.

    No session starts on a TF2 worker, and the worker's Grappler, which plans the
    closure's order, cannot measure its links. So the coordinator measures them, once
    per process, from the first worker it dispatches to, over every PS task of the
    cluster (a probe session on that worker's own server, as for a TF1 session). The
    slowest link is the one the pass is given, as TF1's pass takes it
    (:func:`tfoverlap.planning.tictac.link_figures`). Called for every closure: after
    the first, a lookup."""
    specs = _wants_measurement(config)
    if not specs:
        return None
    with _coordinator_lock:
        if tuple(specs) not in _coordinator_figures:
            _coordinator_figures[tuple(specs)] = _measure_cluster(
                specs, worker_device, probe_seconds(config, seconds))
        return _coordinator_figures[tuple(specs)]


def _measure_cluster(specs: list[str], worker_device: str, seconds: float
                     ) -> tuple[float, float] | None:
    """Measures the links from the PS tasks of this process's cluster that match
    ``specs`` to ``worker_device``; the slowest one's figures (None: none measured)."""
    from tensorflow.python.eager import context
    server_def = context.get_server_def()
    if server_def is None:
        return None
    addresses = {f"/job:{job.name}/replica:0/task:{index}": address
                 for job in server_def.cluster.job for index, address in job.tasks.items()}
    matchers = [DeviceMatcher(spec) for spec in specs]
    tasks = sorted(task for task in addresses if any(matches(task) for matches in matchers))
    worker_task = _task_of(worker_device)
    if not tasks or worker_task not in addresses:
        return None
    _measure_tasks("grpc://" + addresses[worker_task], tasks, _link_device(worker_task),
                   None, seconds)
    links = measured_links()
    measured = [links[_link_device(task)] for task in tasks if _link_device(task) in links]
    if not measured:
        return None
    from tfoverlap.options import DEFAULT_BANDWIDTH
    bandwidth = min(b for b, _ in measured)
    if len(measured) < len(tasks):      # an unmeasured link may be the slow one
        bandwidth = min(bandwidth, DEFAULT_BANDWIDTH)
    return bandwidth, max(r for _, r in measured)


def with_link(config, bandwidth: float, round_trip: float):
    """A copy of ``config`` whose TfOverlap optimizer is given the link's figures."""
    from tensorflow.core.protobuf import config_pb2
    given = config_pb2.ConfigProto()
    given.CopyFrom(config)
    for optimizer in given.graph_options.rewrite_options.custom_optimizers:
        if optimizer.name == OPTIMIZER_NAME:
            optimizer.parameter_map["bandwidth"].f = bandwidth
            optimizer.parameter_map["round_trip"].f = round_trip
    return given


def _warn_failure(task: str, reason: str) -> None:
    message = (f"tfoverlap: could not measure the link to {task} ({reason}); TicTac assumes "
               "1 Gbit/s (give the bandwidth option to skip the probe)")
    if _warned.is_set():
        logger.info(message)
        return
    _warned.set()
    logger.warning(message + "; later probe failures of this process are INFO lines")


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
