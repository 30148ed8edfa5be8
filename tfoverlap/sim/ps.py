"""What-if simulation of a parameter-server graph: from a GraphDef to the simulator's tasks.

One worker is simulated in full; the other ``workers - 1`` do the same work and share
every PS task's link with it. The link is full duplex: pulls (PS to worker) use one
direction, pushed gradients (worker to PS) the other, and a worker's own link carries
only its own transfers. How much of each PS link direction the simulated worker gets
depends on how the workers' phases line up; :mod:`tfoverlap.costs.contention` decides
which case applies, by the rule TicTac's gain estimate uses:

- *Lock step* (TIC and TAC, as the contention model assumes: the same order on every
  worker keeps them pulling together, computing together and pushing together; but not
  in training on the colocated layout, where ordered workers drift as the default's and
  take its step, as measured;
  TensorFlow's default where no PS link direction carries more per step than one
  worker's own step takes): while the simulated worker moves data, all the others move
  theirs in the same direction, so each PS link direction gives it ``bandwidth /
  workers``.
- *Drifted* (TensorFlow's default where a PS link direction is saturated): the workers
  drift apart, so the others' transfers are spread over the simulated worker's step:
  each direction of PS task k's link carries, on average, ``(workers - 1) * bytes_k /
  step`` of theirs, and the simulated worker gets the rest. The step is the fixed point:
  the ``step`` whose leftover bandwidth makes the simulated step last ``step``. It is never
  shorter than the busier direction's bytes of all workers over the bandwidth, and longer
  where one worker cannot keep both directions busy.

Layouts (``Scenario.layout``): *dedicated*, every PS task and every worker on a host of its
own, as above; *colocated*, PS task i on worker i's host behind that host's one link (the
testbed's ``--layout colocated``). There the simulated worker reaches its own host's PS
task off the link (those transfers cost a message's latency and no bandwidth); every
other PS task's link carries the pulls of ``workers - 1`` workers (its own host's worker
reads it locally), and each host's link carries its worker's traffic and its PS task's
at once: leaving it, the shard's pulls by the other workers and the worker's pushes to
the other shards; entering it, the worker's pulls from the other shards and the other
workers' pushes to its shard. In lock step the pulls and the pushes take turns (all
workers pull, then all push), so each phase loads a direction with one kind only: each
other PS task's link direction gives the simulated worker ``bandwidth / (workers - 1)``
and its own link is its own. Drifted, the others' average load of both kinds is taken
off every direction (the simulated worker's own link loses its shard's pulls by the
others and their pushes to it), and no step is shorter than the busiest direction's
bytes of both kinds of all workers over the bandwidth.

Compute times come from a profile (``tfoverlap.profile``) by node name. Ops it lacks cost
nothing: in a profiled run most of them did not exist under their names (TensorFlow's
optimizers removed Identity and NoOp nodes, folded constants, and fused ops such as a
Conv2D into the BiasAdd after it, whose profiled time then holds both). Transfers the
profile lacks are sized from the graph.

Variants: ``default`` (TensorFlow: every transfer requested at once, one PS link sends
them one at a time in a random order; the result is the median over ``seeds`` orders),
``tic`` and ``tac`` (the order the TicTac pass plans, enforced the way the pass does: the
reads of release group j+window wait for the arrival of every transfer of group j, or for
the consumer the plan gates on, plus the control message back to the PS). With
``ps_tasks`` the variables are first spread over that many PS tasks in a copy of the graph,
which both the simulation and the TicTac plan see, as the pass would see a cluster placed
that way.
"""
from __future__ import annotations

import dataclasses
import statistics
from typing import Callable

import numpy as np

from tfoverlap.costs.contention import (StepPrediction, ordered_workers_drift,
                                        predict_steps_for_compute)
from tfoverlap.costs.profile import Profile
from tfoverlap.graph.devices import DeviceMatcher, parse_device_spec, task_of
from tfoverlap.graph.model import (RESOURCE_HANDLE_OPS, GraphModel, edge_bytes, is_variable_op,
                                   tensor_bytes)
from tfoverlap.options import parse_options
from tfoverlap.planning.tictac import plan_transfer_order
from tfoverlap.sim.engine import COMPUTE, TRANSFER, Problem, lower_bound, serial_sum, simulate
from tfoverlap.sim.scenario import (ALONE, COLOCATED, DRIFTED, LOCK_STEP, Prediction,
                                    Scenario, SimulationError)

__all__ = ["PS_ALGORITHMS", "predict_ps", "spread_variables"]

PS_ALGORITHMS = ("default", "tic", "tac")

#: the drifted step's fixed point is found to this share of itself (the median over the
#: default's random orders moves in small jumps), in at most this many rounds.
_FIXED_POINT_TOLERANCE = 1e-3
_FIXED_POINT_ROUNDS = 16


def spread_variables(graph_def, ps_devices: str, num_tasks: int):
    """A copy of ``graph_def`` with its variables on PS tasks 0..num_tasks-1 of their job:
    largest first, each to the least loaded task; every other PS-side node goes where the
    variable it uses goes (task 0 if it uses none)."""
    model = GraphModel.from_graph_def(graph_def)
    devices = model.colocated_devices()
    is_ps = DeviceMatcher(ps_devices)
    root = {}
    for node in range(model.num_nodes):
        if not (devices[node] and is_ps(devices[node])):
            continue
        if is_variable_op(model.ops[node]):
            root[node] = node
        else:
            root[node] = next((p for p, _ in model.data_inputs[node]
                               if is_variable_op(model.ops[p])), None)
    variables = sorted({r for r in root.values() if r is not None},
                       key=lambda v: -(tensor_bytes(graph_def, model, v) or 0))
    load = [0] * num_tasks
    task_of_variable = {}
    for variable in variables:
        task = load.index(min(load))
        task_of_variable[variable] = task
        load[task] += tensor_bytes(graph_def, model, variable) or 0
    spread = type(graph_def)()
    spread.CopyFrom(graph_def)
    for node, variable in root.items():
        device = _on_task(devices[node], task_of_variable.get(variable, 0))
        if not is_ps(device):
            raise SimulationError(f"cannot spread the variables over {num_tasks} PS tasks: "
                                  f"{device} is not one of the PS devices {ps_devices!r}")
        spread.node[node].device = device
    return spread


def _on_task(device: str, task: int) -> str:
    fields = {**parse_device_spec(device), "task": str(task)}
    name = "".join(f"/{key}:{fields[key]}" for key in ("job", "replica", "task") if key in fields)
    if "type" in fields:
        name += f"/device:{fields['type']}:{fields.get('index', '0')}"
    return name


@dataclasses.dataclass
class _Tasks:
    """The iteration's tasks before they become a Problem."""

    kind: list = dataclasses.field(default_factory=list)
    resource: list = dataclasses.field(default_factory=list)
    work: list = dataclasses.field(default_factory=list)
    successors: list = dataclasses.field(default_factory=list)
    local: list = dataclasses.field(default_factory=list)   # a transfer off the link

    def add(self, kind: int, resource: int, work: float, local: bool = False) -> int:
        self.kind.append(kind)
        self.resource.append(resource)
        self.work.append(float(work))
        self.successors.append([])
        self.local.append(local)
        return len(self.kind) - 1


class _PsGraph:
    """The simulated worker's part of a PS graph as tasks, with its transfers marked, and
    the bytes it pulls from (``pull_bytes[k]``) and pushes to (``push_bytes[k]``) each PS
    task k per step. Hosts 0..num_ps-1 are the PS tasks, host num_ps the worker.

    Colocated, PS task ``own`` shares the worker's host: the transfers between them are
    *local* tasks, a message's latency on device num_ps + 1 (as many threads as they are
    many) and no link; their bytes still count in ``pull_bytes[own]`` and
    ``push_bytes[own]``, which the other workers move over this host's link."""

    def __init__(self, graph_def, scenario: Scenario, profile: Profile | None):
        self.model = model = GraphModel.from_graph_def(graph_def)
        devices = model.colocated_devices()
        is_ps = DeviceMatcher(scenario.ps_devices)
        self.ps_tasks = ps_tasks = sorted({task_of(d) for d in devices if d and is_ps(d)})
        if not ps_tasks:
            raise SimulationError(f"the graph has no node on a PS device ({scenario.ps_devices}); "
                                  "is it a parameter-server graph? (see --ps-devices)")
        workers = sorted({d for d in devices if d and not is_ps(d)})
        self.worker_device = workers[0] if workers else ""
        self.num_ps = len(ps_tasks)
        worker_host = self.num_ps
        self.own = -1
        if scenario.layout == COLOCATED:
            self.own = self._own_task(scenario)
        host = []
        for device in devices:
            if device and is_ps(device):
                host.append(ps_tasks.index(task_of(device)))
            elif device in ("", self.worker_device):
                host.append(worker_host)
            else:
                host.append(-1)   # another worker's node: not simulated
        op_seconds = profile.op_seconds if profile else {}
        tasks = _Tasks()
        node_task = [-1] * model.num_nodes
        for node in range(model.num_nodes):
            if host[node] >= 0:
                seconds = (op_seconds.get(model.names[node], 0.0) if host[node] == worker_host
                           else 0.0)
                node_task[node] = tasks.add(COMPUTE, host[node], seconds)
        self.channels: list[tuple[int, int]] = []
        channel_index: dict[tuple[int, int], int] = {}
        self.pull_of_source: dict[int, int] = {}    # PS source node -> its pull transfer
        self.pull_bytes = np.zeros(self.num_ps)
        self.push_bytes = np.zeros(self.num_ps)
        transfer_of: dict[tuple[int, int], int] = {}
        transfer_bytes = profile.transfer_bytes if profile else {}
        for consumer in range(model.num_nodes):
            if host[consumer] < 0:
                continue
            data = {p for p, _ in model.data_inputs[consumer]}
            for producer in dict.fromkeys(model.predecessors(consumer)):
                if host[producer] < 0:
                    continue
                if host[producer] == host[consumer] or model.ops[producer] in RESOURCE_HANDLE_OPS:
                    tasks.successors[node_task[producer]].append(node_task[consumer])
                    continue
                key = (producer, host[consumer] if producer in data else -1 - consumer)
                if key not in transfer_of:
                    link = (host[producer], host[consumer])
                    size = 0.0
                    if producer in data:
                        size = self._bytes(graph_def, producer, consumer, transfer_bytes)
                    if link[1] == worker_host:
                        self.pull_bytes[link[0]] += size
                    elif link[0] == worker_host:
                        self.push_bytes[link[1]] += size
                    if self.own >= 0 and set(link) == {self.own, worker_host}:
                        transfer = tasks.add(COMPUTE, worker_host + 1, 0.0, local=True)
                    else:
                        if link not in channel_index:
                            channel_index[link] = len(self.channels)
                            self.channels.append(link)
                        transfer = tasks.add(TRANSFER, channel_index[link], size)
                    tasks.successors[node_task[producer]].append(transfer)
                    transfer_of[key] = transfer
                    if producer in data and host[consumer] == worker_host:
                        self.pull_of_source[producer] = transfer
                tasks.successors[transfer_of[key]].append(node_task[consumer])
        self.tasks, self.node_task = tasks, node_task
        self.worker_host = worker_host
        if profile is not None and self.pull_of_source:
            names = [model.names[source] for source in self.pull_of_source]
            known = sum(name in profile.transfer_seconds or name in profile.transfer_bytes
                        for name in names)
            if known * 2 < len(names):
                raise SimulationError(
                    f"the profile does not match this graph: only {known} of its {len(names)} "
                    f"transfers (e.g. {names[0]!r}) are in it; profile this model again")

    def _own_task(self, scenario: Scenario) -> int:
        """The index of the PS task on the simulated worker's host: the one whose task
        number is the worker's."""
        if self.num_ps > scenario.workers:
            raise SimulationError(
                f"the colocated layout puts PS task i on worker i's host: the graph's "
                f"{self.num_ps} PS tasks need as many workers, got {scenario.workers}")
        number = task_of(self.worker_device).rpartition(":")[2]
        own = [k for k, task in enumerate(self.ps_tasks) if task.rpartition(":")[2] == number]
        if len(own) != 1:
            raise SimulationError(
                f"colocated layout: no single PS task shares the host of worker "
                f"{self.worker_device or '(none)'} (PS tasks {', '.join(self.ps_tasks)})")
        return own[0]

    def _bytes(self, graph_def, producer: int, consumer: int, profiled: dict) -> float:
        model = self.model
        name = model.names[producer]
        if name in profiled:
            return float(profiled[name])
        return float(edge_bytes(graph_def, model, producer, consumer) or 0)


@dataclasses.dataclass(frozen=True)
class _Links:
    """Bytes/s of each host's link per direction, as the simulated worker sees them."""

    egress: np.ndarray
    ingress: np.ndarray


def _lock_step_links(graph: _PsGraph, scenario: Scenario) -> _Links:
    """Every worker moves data when the simulated one does, in the same direction: each
    PS link direction gives each worker that uses it an equal share (all workers use it,
    or, colocated, all but the one on the PS task's host, and the simulated worker's own
    link carries only its own transfers while the pulls and the pushes take turns)."""
    sharing = scenario.workers
    if scenario.layout == COLOCATED:
        sharing = max(1, scenario.workers - 1)
    share = np.full(graph.num_ps, scenario.bandwidth / sharing)
    return _with_worker_link(share, share, scenario)


def _drifted_links(graph: _PsGraph, scenario: Scenario, step: float) -> _Links:
    """The others' average load at one step per ``step`` seconds taken off each PS link
    direction (``step`` at least the busiest direction's bytes of all workers over the
    bandwidth, so every worker keeps at least 1/workers of it)."""
    others = scenario.workers - 1
    bandwidth = scenario.bandwidth
    if scenario.layout != COLOCATED:
        return _with_worker_link(bandwidth - others * graph.pull_bytes / step,
                                 bandwidth - others * graph.push_bytes / step, scenario)
    leaving, entering = _colocated_bytes(graph, scenario.workers - 2)
    own = graph.own
    # A direction the simulated worker does not use may be left with nothing: the engine
    # needs a positive rate all the same.
    floor = bandwidth * 1e-3
    ps_egress = np.maximum(bandwidth - leaving / step, floor)
    ps_ingress = np.maximum(bandwidth - entering / step, floor)
    worker = _Links(egress=np.array([max(bandwidth - others * graph.pull_bytes[own] / step,
                                         floor)]),
                    ingress=np.array([max(bandwidth - others * graph.push_bytes[own] / step,
                                          floor)]))
    return _Links(egress=np.concatenate([ps_egress, worker.egress]),
                  ingress=np.concatenate([ps_ingress, worker.ingress]))


def _colocated_bytes(graph: _PsGraph, remote_workers: int) -> tuple[np.ndarray, np.ndarray]:
    """Colocated: the bytes per step that leave (``leaving[k]``) and enter
    (``entering[k]``) PS task k's host: ``remote_workers`` workers' pulls of its shard and
    pushes to it (all workers but its own host's: ``workers - 1``; of those, the ones the
    simulated worker shares the link with: ``workers - 2``), and its own host's worker's
    pushes to (leaving) and pulls from (entering) the other shards. Every worker moves
    what the simulated one does."""
    remote_workers = max(remote_workers, 0)
    pulled, pushed = graph.pull_bytes.sum(), graph.push_bytes.sum()
    leaving = remote_workers * graph.pull_bytes + (pushed - graph.push_bytes)
    entering = remote_workers * graph.push_bytes + (pulled - graph.pull_bytes)
    return leaving, entering


def _with_worker_link(ps_egress: np.ndarray, ps_ingress: np.ndarray,
                      scenario: Scenario) -> _Links:
    worker = [float(scenario.bandwidth)]
    return _Links(egress=np.concatenate([ps_egress, worker]),
                  ingress=np.concatenate([ps_ingress, worker]))


def _problem(graph: _PsGraph, scenario: Scenario, priority, links: _Links, extra_edges=(),
             compute_scale: float = 1.0, transfer_scale: float = 1.0) -> Problem:
    tasks = graph.tasks
    successors = [list(s) for s in tasks.successors]
    for before, after in extra_edges:
        successors[before].append(after)
    kind = np.array(tasks.kind, dtype=np.int8)
    work = np.array(tasks.work, dtype=float)
    local = np.array(tasks.local, dtype=bool)
    work[kind == COMPUTE] *= compute_scale
    work[kind == TRANSFER] *= transfer_scale
    work[local] = scenario.latency * transfer_scale
    return Problem(kind=kind, resource=np.array(tasks.resource), work=work,
                   successors=successors, priority=np.asarray(priority, float),
                   threads=[2] * graph.num_ps + [scenario.threads, max(1, int(local.sum()))],
                   channels=graph.channels, egress=links.egress.copy(),
                   ingress=links.ingress.copy(), latency=scenario.latency * transfer_scale,
                   chunk_bytes=scenario.chunk_bytes)


def _gate_edges(graph: _PsGraph, graph_def, scenario: Scenario, algorithm: str,
                profile_path: str) -> tuple[list[tuple[int, int]], int]:
    """The pass's enforcement as task edges: gate (the arrivals of a release group, or a
    consumer) -> control message -> the reads it releases."""
    options = parse_options({"schedule": algorithm, "window": scenario.window,
                             "credit": scenario.credit, "ps_devices": scenario.ps_devices,
                             "profile": profile_path, "bandwidth": scenario.bandwidth},
                            check_files=False)
    plan = plan_transfer_order(graph_def, options)
    model = graph.model
    index = model.index
    gate_tasks: dict[str, list[int]] = {}
    for arrival in plan.arrivals:
        sources = [index.get(tensor.split(":")[0]) for tensor in arrival.tensors]
        gate_tasks[arrival.name] = [graph.pull_of_source[s] for s in sources
                                    if s in graph.pull_of_source]
    edges = []
    for gate, source in plan.edges:
        read = graph.node_task[index[source]]
        if gate not in gate_tasks:       # a consumer gate
            gate_tasks[gate] = [graph.node_task[index[gate]]] if gate in index else []
        edges.extend((before, read) for before in gate_tasks[gate] if before >= 0 and read >= 0)
    order = plan.orders.get(graph.worker_device) or next(iter(plan.orders.values()), [])
    return edges, len(order)


def _contention(graph: _PsGraph, scenario: Scenario, compute_seconds: float) -> StepPrediction:
    """The contention model's view of this worker's step: its bytes per PS task and
    direction, and its compute."""
    own = graph.ps_tasks[graph.own] if graph.own >= 0 else None
    return predict_steps_for_compute(dict(zip(graph.ps_tasks, graph.pull_bytes)),
                                     dict(zip(graph.ps_tasks, graph.push_bytes)),
                                     scenario.workers, scenario.bandwidth, compute_seconds,
                                     own_task=own)


def _shortest_step(graph: _PsGraph, scenario: Scenario) -> float:
    """The busiest PS link direction's bytes of all workers over the bandwidth: however
    the workers' phases line up, no step is shorter. Colocated, every host's link
    directions carry a worker's and a PS task's bytes (a host without a PS task, only its
    worker's)."""
    if scenario.layout != COLOCATED:
        return scenario.workers * max(graph.pull_bytes.max(), graph.push_bytes.max()) / (
            scenario.bandwidth)
    leaving, entering = _colocated_bytes(graph, scenario.workers - 1)
    busiest = max(leaving.max(), entering.max())
    if scenario.workers > graph.num_ps:
        busiest = max(busiest, graph.pull_bytes.sum(), graph.push_bytes.sum())
    return busiest / scenario.bandwidth


def _drifted_step(graph: _PsGraph, scenario: Scenario, iteration: Callable[[_Links], float],
                  lock_step: float) -> tuple[float, _Links]:
    """The fixed point ``step == iteration(_drifted_links(step))`` and its links.

    ``iteration`` falls as ``step`` grows (the others leave more of each link), so the
    fixed point is bracketed by the busiest direction's bytes of all workers over the
    bandwidth (no step is shorter) and the lock-step iteration (dedicated, the drifted
    links leave each worker at least its lock-step share; colocated, where they may not,
    the upper end doubles until it brackets); regula falsi with the Illinois rule finds it.
    """
    shortest = _shortest_step(graph, scenario)
    if shortest <= 0:
        return lock_step, _lock_step_links(graph, scenario)

    def excess(step: float) -> tuple[float, _Links]:
        links = _drifted_links(graph, scenario, step)
        return iteration(links) - step, links

    low, (low_excess, low_links) = shortest, excess(shortest)
    high, (high_excess, high_links) = lock_step, excess(lock_step)
    for _ in range(_FIXED_POINT_ROUNDS):
        # Colocated, the drifted links may leave less than the lock-step share (each host
        # direction carries both kinds at once): move the upper end until it brackets.
        if low_excess <= 0 or high_excess <= 0:
            break
        low, low_excess, low_links = high, high_excess, high_links
        high *= 2
        high_excess, high_links = excess(high)
    if low_excess <= 0 or high_excess >= 0:    # no sign change: an end is the fixed point
        return (low, low_links) if low_excess <= 0 else (high, high_links)
    moved = ""
    for _ in range(_FIXED_POINT_ROUNDS):
        step = (low * high_excess - high * low_excess) / (high_excess - low_excess)
        step_excess, links = excess(step)
        if abs(step_excess) <= _FIXED_POINT_TOLERANCE * step:
            break
        if step_excess > 0:
            low, low_excess = step, step_excess
            if moved == "low":     # the same end twice: Illinois halves the other's excess
                high_excess /= 2
            moved = "low"
        else:
            high, high_excess = step, step_excess
            if moved == "high":
                low_excess /= 2
            moved = "high"
    return step, links


def predict_ps(graph_def, scenario: Scenario, algorithms=PS_ALGORITHMS,
               profile: Profile | None = None, profile_path: str = "") -> list[Prediction]:
    """Predicted iteration time, comm, comp and bounds of each algorithm on a PS graph,
    and the workers' phase each assumes."""
    if scenario.ps_tasks:
        graph_def = spread_variables(graph_def, scenario.ps_devices, scenario.ps_tasks)
    graph = _PsGraph(graph_def, scenario, profile)
    if not graph.pull_of_source:
        raise SimulationError("the graph has no parameter transfers to the worker "
                              f"(PS devices {scenario.ps_devices!r})")
    num_tasks = len(graph.tasks.kind)
    pulls = list(graph.pull_of_source.values())
    lock_step_links = _lock_step_links(graph, scenario)
    ordered_drift = ordered_workers_drift(scenario.workers, bool(graph.push_bytes.any()),
                                          scenario.layout == COLOCATED)
    default_priorities = []
    for seed in range(scenario.seeds):
        priority = np.arange(num_tasks, dtype=float)
        priority[pulls] = np.random.default_rng(seed).permutation(len(pulls))
        default_priorities.append(priority)
    default_phase: list = []     # (step, links, phase) of the default, once simulated

    def iteration(links: _Links, priorities, edges) -> float:
        return statistics.median(simulate(_problem(graph, scenario, p, links, edges)).makespan
                                 for p in priorities)

    def compute_only(priorities, edges):
        return simulate(_problem(graph, scenario, priorities[0], lock_step_links, edges,
                                 transfer_scale=0.0))

    def phase_and_step(priorities, edges, comp, drifts: bool) -> tuple[float, _Links, str]:
        """The step, the links it had and the workers' phase (drifted only if ``drifts``
        and the contention model says a link direction is saturated); ``comp`` is the
        compute-only simulation of the same priorities and edges."""
        step, links = iteration(lock_step_links, priorities, edges), lock_step_links
        phase = ALONE if scenario.workers == 1 else LOCK_STEP
        if (drifts and phase != ALONE
                and _contention(graph, scenario, comp.makespan).saturated):
            phase = DRIFTED
            step, links = _drifted_step(
                graph, scenario, lambda l: iteration(l, priorities, edges), step)
        return step, links, phase

    predictions = []
    for algorithm in algorithms:
        if algorithm == "default":
            edges, count, priorities = [], len(pulls), default_priorities
        else:
            edges, count = _gate_edges(graph, graph_def, scenario, algorithm, profile_path)
            priorities = [np.arange(num_tasks, dtype=float)]
        comp = compute_only(priorities, edges)
        if algorithm == "default" or ordered_drift:
            # Ordered workers that drift as the default's take the default's step
            # (tfoverlap.costs.contention): their order no longer decides arrivals.
            if not default_phase:
                default_comp = (comp if algorithm == "default"
                                else compute_only(default_priorities, []))
                default_phase.append(phase_and_step(default_priorities, [], default_comp,
                                                    True))
            step, links, phase = default_phase[0]
            if algorithm != "default":
                phase = DRIFTED
        else:
            step, links, phase = phase_and_step(priorities, edges, comp, False)
        problem = _problem(graph, scenario, priorities[0], links, edges)
        comm = simulate(_problem(graph, scenario, priorities[0], links, edges, compute_scale=0.0))
        lower = lower_bound(problem)
        if phase == DRIFTED:   # the drifted links count only the others' average load
            lower = max(lower, _shortest_step(graph, scenario))
        predictions.append(Prediction(
            algorithm=algorithm, iteration=step, comm=comm.makespan, comp=comp.makespan,
            lower=lower, upper=serial_sum(problem), transfers=count, phase=phase))
    return predictions
