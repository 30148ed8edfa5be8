"""Reading what happened in a step from ``RunMetadata.step_stats``.

In distributed runs the receiving device's step stats hold one ``RecvTensor`` event per
transfer, labelled "[1.0MB] [3.5Gb/s] edge_9_<source node> from <device> to <device>".
These are the *observed* transfers that tests and benchmarks check orders against.

TF2 functions run by remote tasks (``ParameterServerStrategy``) leave no step stats at the
caller; there a task's own profiler capture (``*.xplane.pb``, written by
``tf.profiler.experimental``) shows when each of its ops ran: :func:`profiled_op_starts`.
"""
from __future__ import annotations

import dataclasses
import re

from tfoverlap.graph.devices import DeviceMatcher

__all__ = ["RecvEvent", "recv_events", "observed_transfer_order", "op_durations",
           "op_start_order", "step_timeline", "device_filter", "profiled_op_starts",
           "EMULATED_OP", "STREAM_WAIT_OP", "EmulatedKernel", "emulated_kernels",
           "step_span", "op_type_starts", "op_wall_shares"]

#: the op types of emulated-accelerator kernels and their waits (native/emulated_compute.cc).
EMULATED_OP = "TfOverlapEmulatedCompute"
STREAM_WAIT_OP = "TfOverlapStreamWait"

_RECV_LABEL = re.compile(
    r"\[(?P<size>[0-9.]+)(?P<unit>[KMG]?B)\].*?edge_\d+_(?P<source>\S+?)(?::\d+)? from "
    r"(?P<src>\S+) to (?P<dst>\S+)")
_UNITS = {"B": 1, "KB": 1 << 10, "MB": 1 << 20, "GB": 1 << 30}


@dataclasses.dataclass(frozen=True)
class RecvEvent:
    source: str          # the producing node's name
    source_device: str
    destination_device: str
    bytes: int
    start_micros: int
    duration_micros: int


@dataclasses.dataclass(frozen=True)
class EmulatedKernel:
    device: str
    stream: int
    seconds: float       # the stream time it takes (dilation applied)
    blocking: bool = False     # completes when it ends: its step stats show its time


def emulated_kernels(run_metadata) -> dict[str, EmulatedKernel]:
    """The emulated kernels of a step traced with ``output_partition_graphs=True``, by
    node name. A launched kernel completes for the executor at once; its stream time is
    in the graph, not in the step stats."""
    return {node.name: EmulatedKernel(node.device, node.attr["stream"].i,
                                      node.attr["duration_us"].f * 1e-6,
                                      node.attr["blocking"].b)
            for graph in run_metadata.partition_graphs for node in graph.node
            if node.op == EMULATED_OP}


def _stream_intervals(run_metadata, kernels: dict) -> dict[str, tuple[int, int]]:
    """Node -> (start, duration) in µs of each emulated kernel on its stream: launched in
    the order the step stats show, each starting when launched and its stream is free
    (the stream is taken as idle when the step began)."""
    launches = sorted((node.all_start_micros, node.node_name)
                      for device_stats in _step_stats(run_metadata).dev_stats
                      for node in device_stats.node_stats if node.node_name in kernels)
    busy: dict = {}
    intervals = {}
    for launched, name in launches:
        kernel = kernels[name]
        key = (kernel.device, kernel.stream)
        start = max(launched, busy.get(key, 0))
        duration = int(round(kernel.seconds * 1e6))
        busy[key] = start + duration
        intervals[name] = (start, duration)
    return intervals


def device_filter(spec: str):
    """A predicate on device names: those matching ``spec`` (see DeviceMatcher), or every
    device for an empty spec."""
    return DeviceMatcher(spec) if spec else (lambda device: True)


def _step_stats(run_metadata_or_step_stats):
    return getattr(run_metadata_or_step_stats, "step_stats", run_metadata_or_step_stats)


def recv_events(run_metadata) -> list[RecvEvent]:
    """All RecvTensor events of a traced step, by start time."""
    events = []
    for device_stats in _step_stats(run_metadata).dev_stats:
        for node in device_stats.node_stats:
            if node.node_name != "RecvTensor":
                continue
            match = _RECV_LABEL.search(node.timeline_label)
            if match is None:
                continue
            size = int(float(match.group("size")) * _UNITS[match.group("unit")])
            events.append(RecvEvent(match.group("source"), match.group("src"),
                                    match.group("dst"), size, node.all_start_micros,
                                    node.all_end_rel_micros))
    events.sort(key=lambda e: (e.start_micros, e.source))
    return events


def observed_transfer_order(run_metadata, destination_job: str = "worker",
                            min_bytes: int = 1) -> list[str]:
    """Source names of the data transfers into ``destination_job``, in start order.

    Zero-byte events (control messages of cross-device control edges) are left out.
    """
    matches = DeviceMatcher(f"/job:{destination_job}")
    return [e.source for e in recv_events(run_metadata)
            if matches(e.destination_device) and e.bytes >= min_bytes]


def _op_stats(run_metadata, devices: str):
    """The node stats of the ops (not transfers, not the executor's markers) that ran on
    devices matching the spec ``devices`` (all devices if empty)."""
    matches = device_filter(devices)
    for device_stats in _step_stats(run_metadata).dev_stats:
        if matches(device_stats.device):
            for node in device_stats.node_stats:
                if node.node_name not in ("RecvTensor", "_SOURCE", "_SINK"):
                    yield node


def _waits_for_a_stream(node) -> bool:
    """An emulation's stream wait: it takes the time the stream's kernels take, computing
    nothing (their own times are the kernels')."""
    return node.timeline_label.startswith(f"{node.node_name} = {STREAM_WAIT_OP}")


def op_durations(run_metadata, devices: str = "") -> dict[str, int]:
    """Compute time (op start to op end, microseconds) per node on devices matching the
    spec ``devices`` (all devices if empty); an emulation's stream waits are left out."""
    return {node.node_name: max(0, node.op_end_rel_micros - node.op_start_rel_micros)
            for node in _op_stats(run_metadata, devices) if not _waits_for_a_stream(node)}


def op_wall_shares(run_metadata, devices: str = "") -> dict[str, float]:
    """Each op's share of the step's compute time on matching devices, in µs: every moment
    that k ops ran is split among them, 1/k each. The shares sum to the time some op ran,
    and a replay that runs them one at a time takes that time, where replaying the ops'
    own durations would count twice what ops that ran together (on shared cores) took."""
    events = []
    for node in _op_stats(run_metadata, devices):
        if node.op_end_rel_micros > node.op_start_rel_micros and not _waits_for_a_stream(node):
            events.append((node.all_start_micros + node.op_start_rel_micros, 1, node.node_name))
            events.append((node.all_start_micros + node.op_end_rel_micros, -1, node.node_name))
    events.sort(key=lambda event: (event[0], event[1]))
    shares: dict[str, float] = {}
    running: dict[str, int] = {}
    last = None
    for time_micros, change, name in events:
        if running and last is not None and time_micros > last:
            each = (time_micros - last) / len(running)
            for member in running:
                shares[member] = shares.get(member, 0.0) + each
        last = time_micros
        if change > 0:
            running[name] = running.get(name, 0) + 1
        elif running.get(name, 0) > 1:
            running[name] -= 1
        else:
            running.pop(name, None)
    return shares


def op_start_order(run_metadata, devices: str, names) -> list[str]:
    """Which of ``names`` ran on a matching device, in the order they started.

    For single-process sessions, where transfers between devices leave no RecvTensor
    event, the start order of the PS-side reads is the observed transfer order.
    """
    matches = device_filter(devices)
    wanted = set(names)
    starts = {}
    for device_stats in _step_stats(run_metadata).dev_stats:
        if matches(device_stats.device):
            for node in device_stats.node_stats:
                if node.node_name in wanted:
                    starts[node.node_name] = node.all_start_micros
    return sorted(starts, key=lambda name: (starts[name], name))


def step_span(run_metadata, devices: str = "") -> tuple[int, int]:
    """(first op start, last op end) of a traced step on matching devices, in
    microseconds since the epoch."""
    nodes = list(_op_stats(run_metadata, devices))
    if not nodes:
        raise ValueError("the trace has no ops")
    return (min(node.all_start_micros for node in nodes),
            max(node.all_start_micros + node.all_end_rel_micros for node in nodes))


def op_type_starts(run_metadata, op_types, devices: str = "") -> list[tuple[int, str]]:
    """(start in µs since the epoch, node name) of the ops of the given types, in order:
    for Horovod's AllReduce ops, when each gradient was handed to Horovod."""
    wanted = set(op_types)
    return sorted((node.all_start_micros, node.node_name)
                  for node in _op_stats(run_metadata, devices)
                  if node.timeline_label.partition(" = ")[2].partition("(")[0] in wanted)


def step_timeline(run_metadata, devices: str = "", origin: int | None = None) -> dict:
    """One traced step as plain lists, times in microseconds since its first event (or
    since ``origin``, µs since the epoch):

    ``compute``: [node name, start, duration] of ops on matching devices (emulated kernels
    as they occupy their stream, where the step was traced with its partition graphs),
    ``transfers``: [source node, start, duration, bytes] of data received by them.
    """
    matches = device_filter(devices)
    kernels = {name: kernel for name, kernel in emulated_kernels(run_metadata).items()
               if not kernel.blocking}
    stream = _stream_intervals(run_metadata, kernels) if kernels else {}
    compute = []
    for node in _op_stats(run_metadata, devices):
        if node.node_name in stream:
            compute.append([node.node_name, *stream[node.node_name]])
            continue
        if _waits_for_a_stream(node):
            continue
        duration = node.op_end_rel_micros - node.op_start_rel_micros
        if duration > 0:
            compute.append([node.node_name, node.all_start_micros + node.op_start_rel_micros,
                            duration])
    transfers = [[e.source, e.start_micros, e.duration_micros, e.bytes]
                 for e in recv_events(run_metadata)
                 if matches(e.destination_device) and e.bytes > 0]
    if origin is None:
        origin = min([c[1] for c in compute] + [t[1] for t in transfers], default=0)
    for event in compute + transfers:
        event[1] -= origin
    return {"compute": compute, "transfers": transfers}


def profiled_op_starts(xspace_path: str, names) -> list[tuple[str, int]]:
    """(node name, start in ns) of every run of a node in ``names`` that a profiler capture
    (an XSpace file, ``*.xplane.pb``) recorded on its host threads, by start time.

    Each op run is one event named "node name:op type".
    """
    from tensorflow.tsl.profiler.protobuf import xplane_pb2
    space = xplane_pb2.XSpace()
    with open(xspace_path, "rb") as stream:
        space.ParseFromString(stream.read())
    wanted = set(names)
    starts = []
    for plane in space.planes:
        for line in plane.lines:
            for event in line.events:
                node = plane.event_metadata[event.metadata_id].name.rsplit(":", 1)[0]
                if node in wanted:
                    starts.append((node, line.timestamp_ns + event.offset_ps // 1000))
    starts.sort(key=lambda start: (start[1], start[0]))
    return starts
