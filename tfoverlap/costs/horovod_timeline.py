"""Where a Horovod step's time goes: Horovod's timeline lined up with TensorFlow's trace.

Horovod's timeline (``HOROVOD_TIMELINE=path``, or ``hvd.start_timeline`` under
``HOROVOD_TIMELINE=DYNAMIC``; rank 0 writes it) records per tensor its negotiation
(``NEGOTIATE_ALLREDUCE``: from the first rank's request until every rank has asked) and its
reduction (``ALLREDUCE``: the fusion-buffer copies and the ring). Its header gives the
timeline's origin in microseconds since the epoch, the clock of TensorFlow's step stats,
so the two line up; measured here, a reduction's end and its TensorFlow op's end are 3-30
µs apart. From TensorFlow's trace of the same step come the step's bounds and when each
gradient was handed to Horovod (its AllReduce op started).

:func:`step_breakdown` splits one step, on rank 0's clock, into the compute until the
last gradient, and the tail after it: ring time, waits (negotiation, Horovod's cycle,
queued requests) and what follows the last reduction. Only the tail is communication the
step did not hide, so it bounds what any AllReduce schedule can gain.
"""
from __future__ import annotations

import dataclasses
import json

import numpy as np

__all__ = ["TensorRecord", "read_timeline", "StepBreakdown", "step_breakdown",
           "covered_micros"]

_ORIGIN_KEY = "start_time_since_epoch_in_micros"
_ITEMSIZE = {"float16": 2, "bfloat16": 2, "float64": 8, "int64": 8, "uint8": 1, "int8": 1}


@dataclasses.dataclass
class TensorRecord:
    """One tensor's phases in a timeline, in microseconds since the epoch. Its
    ``reductions`` are its collective's runs, whichever the collective (``operation``):
    an AllReduce, or decoupled reduction's reduce-scatter and all-gather."""

    negotiations: list[tuple[int, int]] = dataclasses.field(default_factory=list)
    reductions: list[tuple[int, int]] = dataclasses.field(default_factory=list)
    bytes: int = 0
    operation: str = ""      # its collective: ALLREDUCE, REDUCESCATTER, ALLGATHER, ...


def read_timeline(text: str) -> dict[str, TensorRecord]:
    """Tensor name -> its negotiations and reductions, from a timeline file's text (which
    Horovod leaves without its closing bracket while it runs).

    Raises:
      ValueError: the text is not a Horovod timeline.
    """
    body = text.rstrip().rstrip(",")
    try:
        events = json.loads(body if body.endswith("]") else body + "]")
    except json.JSONDecodeError as error:
        raise ValueError(f"not a Horovod timeline (bad JSON: {error})") from None
    if not isinstance(events, list):
        raise ValueError("not a Horovod timeline (expected a JSON list of events)")
    try:
        return _records(events)
    except (KeyError, TypeError, ValueError) as error:
        raise ValueError(f"not a Horovod timeline (an event lacks or mistypes "
                         f"{error})") from None


def _records(events: list) -> dict[str, TensorRecord]:
    origin = next((e["args"][_ORIGIN_KEY] for e in events if isinstance(e, dict)
                   and _ORIGIN_KEY in e.get("args", {})), 0)
    names = {e["pid"]: e["args"]["name"] for e in events if isinstance(e, dict)
             and e.get("name") == "process_name" and "name" in e.get("args", {})}
    records = {name: TensorRecord() for name in names.values()}
    open_phases: dict[int, list[tuple[str, int]]] = {}
    for event in events:
        if not isinstance(event, dict) or event.get("pid") not in names:
            continue
        pid, phase = event["pid"], event.get("ph")
        if phase == "B":
            open_phases.setdefault(pid, []).append((event["name"], event["ts"]))
        elif phase == "E" and open_phases.get(pid):
            name, begin = open_phases[pid].pop()
            record = records[names[pid]]
            interval = (origin + begin, origin + event["ts"])
            if name.startswith("NEGOTIATE_"):
                record.negotiations.append(interval)
            elif not open_phases[pid]:          # a top-level phase: the whole operation
                record.reductions.append(interval)
                record.operation = record.operation or name
                shape = event.get("args", {}).get("shape")
                if shape and not record.bytes:
                    dims = [int(d) for d in shape.strip("[]").split(",") if d.strip()]
                    itemsize = _ITEMSIZE.get(event["args"].get("dtype", ""), 4)
                    record.bytes = itemsize * int(np.prod(dims, dtype=np.int64))
    return records


def covered_micros(intervals, within: tuple[float, float]) -> float:
    """How much of ``within`` the union of ``intervals`` covers."""
    low, high = within
    clipped = sorted((max(b, low), min(e, high)) for b, e in intervals if e > low and b < high)
    covered, reach = 0.0, low
    for begin, end in clipped:
        if end > reach:
            covered += end - max(begin, reach)
            reach = end
    return covered


@dataclasses.dataclass(frozen=True)
class StepBreakdown:
    """One step on rank 0's clock, in seconds. ``step = until_last_gradient + tail`` and
    ``tail = tail_ring + tail_wait + after_last_reduction``."""

    step: float
    first_gradient: float          # step start -> first gradient handed to Horovod
    until_last_gradient: float     # step start -> last gradient: forward and backward
    tail: float                    # last gradient -> step end
    tail_ring: float               # of the tail, reductions running
    tail_wait: float               # of the tail, nothing reducing before the last one ends
    after_last_reduction: float    # of the tail, after the last reduction (updates)
    ring: float                    # reductions running, whole step
    ring_idle: float               # first gradient -> last reduction end, nothing reducing
    negotiation: float             # some tensor negotiating, whole step
    requests: int                  # fused requests reduced in the step

    @property
    def in_step_bound(self) -> float:
        """The step if the ring never idled once the first gradient was ready and the
        compute kept its pace: what a perfect AllReduce schedule of this step could reach.
        Only a step that reduces its own gradients is bound by it: the previous step's
        deferred reductions count in ``ring`` too."""
        return max(self.until_last_gradient, self.first_gradient + self.ring) \
            + self.after_last_reduction

    def as_dict(self) -> dict:
        return {**dataclasses.asdict(self), "in_step_bound": self.in_step_bound}


def step_breakdown(step_start: float, step_end: float, gradient_ready,
                   records: dict[str, TensorRecord]) -> StepBreakdown:
    """Split one step (µs since the epoch) given when each gradient was handed to Horovod
    and the timeline's records (only their phases inside the step count).

    Raises:
      ValueError: no gradient, or an empty step.
    """
    if not step_end > step_start:
        raise ValueError("the step has no length")
    ready = sorted(r for r in gradient_ready if step_start <= r <= step_end)
    if not ready:
        raise ValueError("no gradient was handed to Horovod inside the step")
    window = (step_start, step_end)
    reductions = [i for r in records.values() for i in r.reductions
                  if i[1] > step_start and i[0] < step_end]
    negotiations = [i for r in records.values() for i in r.negotiations
                    if i[1] > step_start and i[0] < step_end]
    first, last = ready[0], ready[-1]
    last_reduction = max([min(e, step_end) for _, e in reductions] + [last])
    tail_ring = covered_micros(reductions, (last, step_end))
    return StepBreakdown(
        step=(step_end - step_start) * 1e-6, first_gradient=(first - step_start) * 1e-6,
        until_last_gradient=(last - step_start) * 1e-6, tail=(step_end - last) * 1e-6,
        tail_ring=tail_ring * 1e-6,
        tail_wait=((last_reduction - last) - tail_ring) * 1e-6,
        after_last_reduction=(step_end - last_reduction) * 1e-6,
        ring=covered_micros(reductions, window) * 1e-6,
        ring_idle=((last_reduction - first) - covered_micros(reductions, (first, last_reduction)))
        * 1e-6,
        negotiation=covered_micros(negotiations, window) * 1e-6,
        requests=_request_count(reductions))


def _request_count(reductions) -> int:
    """Fused requests among the tensors' reductions: Horovod stamps the tensors of one
    request one after another (µs apart), all before the first of them ends."""
    count, earliest_end = 0, -np.inf
    for begin, end in sorted(reductions):
        if begin >= earliest_end:
            count, earliest_end = count + 1, end
        else:
            earliest_end = min(earliest_end, end)
    return count
