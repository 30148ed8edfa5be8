"""A discrete-event simulator of one training/inference iteration, on plain data.

The iteration is a DAG of *tasks*. A compute task runs on a device that has a number of
threads (TensorFlow's inter-op pool); a transfer task moves bytes over a *channel* from
one host to another. What the testbed showed decides the network model:

- transfers on one channel (one PS task to one worker) go one at a time, in the order
  they became ready (ties by ``priority``: a random permutation for TensorFlow's
  default order, the schedule's position for an ordered one), in chunks of at most
  ``chunk_bytes``: a larger transfer sends one chunk per round and lets the others go
  in between (gRPC's HTTP/2 streams interleave large messages; small ones go whole);
- concurrent transfers on different channels share the hosts' links: a transfer gets
  ``min(egress(src) / transfers leaving src, ingress(dst) / transfers entering dst)``;
- each transfer also pays a fixed ``latency`` (seconds, per message).

A *collective* task (one ring AllReduce of a Horovod bucket) runs on the collective
channel (one at a time, Horovod's background thread) for
``2 (n-1)/n * bytes / bandwidth + 2 (n-1) * latency`` seconds.

Ready compute tasks start in priority order (then readiness order) when a thread is free.
Tasks with zero work complete the moment they are ready. The result is every task's start
and end and the makespan.
"""
from __future__ import annotations

import dataclasses
import heapq
import math
from typing import Sequence

import numpy as np

__all__ = ["COMPUTE", "TRANSFER", "COLLECTIVE", "Problem", "Schedule", "simulate",
           "lower_bound", "serial_sum"]

COMPUTE, TRANSFER, COLLECTIVE = 0, 1, 2
_TIME_EPSILON = 1e-9


@dataclasses.dataclass
class Problem:
    """One iteration as plain arrays.

    kind[t]:      COMPUTE, TRANSFER or COLLECTIVE.
    resource[t]:  the device (compute) or channel (transfer) index; ignored for collectives.
    work[t]:      seconds (compute, collective) or bytes (transfer).
    successors:   successors[t] = tasks that wait for t.
    priority[t]:  order among ready tasks of one resource, lower first.
    threads[d]:   parallel slots of device d.
    channels[c]:  (source host, destination host) of channel c.
    egress[h], ingress[h]: bytes/s of host h's link in each direction.
    latency:      seconds per transfer message.
    chunk_bytes:  the most one transfer sends before the channel serves the next.
    """

    kind: np.ndarray
    resource: np.ndarray
    work: np.ndarray
    successors: list[list[int]]
    priority: np.ndarray
    threads: Sequence[int]
    channels: Sequence[tuple[int, int]]
    egress: np.ndarray
    ingress: np.ndarray
    latency: float = 0.0
    chunk_bytes: float = math.inf

    @property
    def num_tasks(self) -> int:
        return len(self.kind)

    def validate(self) -> None:
        n = self.num_tasks
        for name in ("resource", "work", "priority"):
            if len(getattr(self, name)) != n or len(self.successors) != n:
                raise ValueError(f"problem arrays disagree in length ({name})")
        if np.any(self.work < 0) or not np.all(np.isfinite(self.work)):
            raise ValueError("task work must be finite and non-negative")
        if any(t < 1 for t in self.threads):
            raise ValueError("every device needs at least one thread")
        if np.any(self.egress <= 0) or np.any(self.ingress <= 0):
            raise ValueError("link bandwidths must be positive")
        if self.latency < 0:
            raise ValueError("latency must be non-negative")
        if not self.chunk_bytes > 0:
            raise ValueError("chunk_bytes must be positive")


@dataclasses.dataclass
class Schedule:
    start: np.ndarray
    end: np.ndarray

    @property
    def makespan(self) -> float:
        return float(self.end.max()) if len(self.end) else 0.0


def _transfer_rate(problem: Problem, channel: int, leaving: np.ndarray,
                   entering: np.ndarray) -> float:
    source, destination = problem.channels[channel]
    return min(problem.egress[source] / leaving[source],
               problem.ingress[destination] / entering[destination])


def simulate(problem: Problem) -> Schedule:
    """Runs the iteration (a collective's ``work`` is its duration in seconds)."""
    problem.validate()
    n = problem.num_tasks
    kind, resource, work, priority = (problem.kind, problem.resource, problem.work,
                                      problem.priority)
    indegree = np.zeros(n, dtype=np.int64)
    for consumers in problem.successors:
        for consumer in consumers:
            indegree[consumer] += 1
    start = np.full(n, np.nan)
    end = np.full(n, np.nan)
    num_hosts = len(problem.egress)
    free_threads = list(problem.threads)
    device_queue: list[list] = [[] for _ in problem.threads]
    channel_queue: list[list] = [[] for _ in problem.channels]
    channel_busy = [False] * len(problem.channels)
    collective_queue: list = []
    collective_busy = False
    running: list = []                   # heap of (end time, task) of the collective
    computing: dict[int, float] = {}     # compute task -> seconds of work left
    active: dict[int, float] = {}        # transfer -> bytes of its current chunk left
    unsent = np.array(work, dtype=float)  # transfer -> bytes not yet sent
    rounds = np.zeros(n, dtype=np.int64)
    leaving = np.zeros(num_hosts)
    entering = np.zeros(num_hosts)
    ready_sequence = 0
    done = 0
    now = 0.0
    instant: list[int] = []

    def make_ready(task: int) -> None:
        nonlocal ready_sequence
        ready_sequence += 1
        entry = (priority[task], ready_sequence, task)
        if kind[task] == COMPUTE:
            if work[task] == 0:
                instant.append(task)
            else:
                heapq.heappush(device_queue[resource[task]], entry)
        elif kind[task] == TRANSFER:
            heapq.heappush(channel_queue[resource[task]], (0,) + entry)
        else:
            heapq.heappush(collective_queue, entry)

    def finish(task: int) -> None:
        nonlocal done
        end[task] = now
        done += 1
        for consumer in problem.successors[task]:
            indegree[consumer] -= 1
            if indegree[consumer] == 0:
                make_ready(consumer)

    def dispatch() -> None:
        nonlocal collective_busy
        while instant:
            task = instant.pop()
            start[task] = now
            finish(task)
        for device, queue in enumerate(device_queue):
            while queue and free_threads[device] > 0:
                task = heapq.heappop(queue)[2]
                free_threads[device] -= 1
                start[task] = now
                computing[task] = work[task]
        for channel, queue in enumerate(channel_queue):
            if queue and not channel_busy[channel]:
                task = heapq.heappop(queue)[3]
                channel_busy[channel] = True
                source, destination = problem.channels[channel]
                leaving[source] += 1
                entering[destination] += 1
                chunk = min(unsent[task], problem.chunk_bytes)
                unsent[task] -= chunk
                if rounds[task] == 0:
                    start[task] = now
                    alone = min(problem.egress[source], problem.ingress[destination])
                    chunk += problem.latency * alone
                active[task] = chunk
        if collective_queue and not collective_busy:
            task = heapq.heappop(collective_queue)[2]
            collective_busy = True
            start[task] = now
            heapq.heappush(running, (now + work[task], task))

    for task in range(n):
        if indegree[task] == 0:
            make_ready(task)
    while True:
        dispatch()
        if done == n:
            break
        rates = {task: _transfer_rate(problem, resource[task], leaving, entering)
                 for task in active}
        next_time = running[0][0] if running else math.inf
        for task, left in active.items():
            next_time = min(next_time, now + left / rates[task])
        for left in computing.values():
            next_time = min(next_time, now + left)
        if next_time == math.inf:
            raise ValueError("the simulation is stuck: the task graph has a cycle")
        for task in active:
            active[task] -= rates[task] * (next_time - now)
        for task in computing:
            computing[task] -= next_time - now
        now = next_time
        while running and running[0][0] <= now + _TIME_EPSILON:
            task = heapq.heappop(running)[1]
            collective_busy = False
            finish(task)
        for task in [t for t, left in computing.items() if left <= _TIME_EPSILON]:
            del computing[task]
            free_threads[resource[task]] += 1
            finish(task)
        # Done when less than a nanosecond of sending is left (a float remainder would
        # otherwise schedule events closer together than ``now`` can resolve).
        for task in [t for t, left in active.items() if left <= rates[t] * _TIME_EPSILON]:
            del active[task]
            channel = resource[task]
            channel_busy[channel] = False
            source, destination = problem.channels[channel]
            leaving[source] -= 1
            entering[destination] -= 1
            if unsent[task] > 0:
                rounds[task] += 1
                heapq.heappush(channel_queue[channel],
                               (rounds[task], priority[task], ready_sequence, task))
            else:
                finish(task)
    return Schedule(start=start, end=end)


def _alone_seconds(problem: Problem, task: int) -> float:
    if problem.kind[task] == COMPUTE:
        return float(problem.work[task])
    if problem.kind[task] == COLLECTIVE:
        return float(problem.work[task])
    source, destination = problem.channels[problem.resource[task]]
    return float(problem.work[task] / min(problem.egress[source], problem.ingress[destination])
                 + problem.latency)


def serial_sum(problem: Problem) -> float:
    """Every task one after another at full speed: an upper bound of the makespan."""
    return sum(_alone_seconds(problem, t) for t in range(problem.num_tasks))


def lower_bound(problem: Problem) -> float:
    """The largest of: the critical path at full speed, each device's work over its
    threads, each channel's and each host link's bytes over its bandwidth."""
    n = problem.num_tasks
    alone = [_alone_seconds(problem, t) for t in range(n)]
    indegree = [0] * n
    for consumers in problem.successors:
        for consumer in consumers:
            indegree[consumer] += 1
    finish_by = [0.0] * n
    ready = [t for t in range(n) if indegree[t] == 0]
    earliest = [0.0] * n
    while ready:
        task = ready.pop()
        finish_by[task] = earliest[task] + alone[task]
        for consumer in problem.successors[task]:
            earliest[consumer] = max(earliest[consumer], finish_by[task])
            indegree[consumer] -= 1
            if indegree[consumer] == 0:
                ready.append(consumer)
    bounds = [max(finish_by, default=0.0)]
    for device, threads in enumerate(problem.threads):
        mask = (problem.kind == COMPUTE) & (problem.resource == device)
        bounds.append(float(problem.work[mask].sum()) / threads)
    transfers = problem.kind == TRANSFER
    for channel, (source, destination) in enumerate(problem.channels):
        mask = transfers & (problem.resource == channel)
        bounds.append(float(problem.work[mask].sum())
                      / min(problem.egress[source], problem.ingress[destination]))
    for host in range(len(problem.egress)):
        out_bytes = sum(float(problem.work[transfers & (problem.resource == c)].sum())
                        for c, (s, _) in enumerate(problem.channels) if s == host)
        in_bytes = sum(float(problem.work[transfers & (problem.resource == c)].sum())
                       for c, (_, d) in enumerate(problem.channels) if d == host)
        bounds += [out_bytes / problem.egress[host], in_bytes / problem.ingress[host]]
    collectives = np.flatnonzero(problem.kind == COLLECTIVE)
    bounds.append(sum(alone[t] for t in collectives))
    return max(bounds)
