"""What-if simulation of a parameter-server graph: from a GraphDef to the simulator's tasks.

One worker is simulated in full; the other ``workers - 1`` are assumed to do the same at
the same time, so each PS task's link is shared by all of them: its bandwidth per worker
is ``bandwidth / workers`` (the testbed's two workers pulling from one PS showed exactly
this sharing). Compute times come from a profile (``tfoverlap.profile``) by node name;
ops it lacks cost nothing, and transfers it lacks are sized from the graph.

Variants: ``default`` (TensorFlow: every transfer requested at once, one PS link sends
them one at a time in a random order; the result is the median over ``seeds`` orders),
``tic`` and ``tac`` (the order the TicTac pass plans, enforced the way the pass does: the
read of transfer k+window waits for the arrival of transfer k, plus the control message
back to the PS).

Graphs with Horovod AllReduce ops and no PS are simulated with the ring model instead:
the buckets of Horovod's own fusion (``default``) or of Caramel's plan (``caramel``) are
reduced one after another, each ``2(n-1)/n * bytes / bandwidth + 2(n-1) * latency``.
"""
from __future__ import annotations

import dataclasses
import statistics

import numpy as np

from tfoverlap.caramel_plan import ALLREDUCE_OP
from tfoverlap.cost_model import Profile
from tfoverlap.graph_model import (RESOURCE_HANDLE_OPS, DeviceMatcher, GraphModel,
                                   is_variable_op, parse_device_spec, tensor_bytes)
from tfoverlap.options import Options
from tfoverlap.passes import PassContext
from tfoverlap.simulator import COMPUTE, TRANSFER, Problem, lower_bound, serial_sum, simulate
from tfoverlap.tictac_pass import plan_transfer_order

__all__ = ["Scenario", "Prediction", "ALGORITHMS", "predict", "prune_to_fetches",
           "SimulationError"]

ALGORITHMS = ("default", "tic", "tac")
ALLREDUCE_ALGORITHMS = ("default", "caramel")


class SimulationError(ValueError):
    """The graph or the scenario cannot be simulated (no parameters, bad option, ...)."""


@dataclasses.dataclass(frozen=True)
class Scenario:
    workers: int = 2
    bandwidth: float = 312.5e6     # bytes/s per link and direction
    latency: float = 100e-6        # seconds per transfer message
    threads: int = 2               # a worker's inter-op threads
    window: int = 1
    seeds: int = 16
    ps_devices: str = "/job:ps"
    ps_tasks: int = 0              # > 0: spread the variables over this many PS tasks
    chunk_bytes: float = 16e6      # see simulator.Problem.chunk_bytes (fitted: docs)

    def validate(self) -> None:
        if self.workers < 1:
            raise SimulationError(f"workers must be >= 1, got {self.workers}")
        if not self.bandwidth > 0 or self.bandwidth == float("inf"):
            raise SimulationError(f"bandwidth must be positive, got {self.bandwidth}")
        if self.latency < 0:
            raise SimulationError(f"latency must be >= 0, got {self.latency}")
        if self.threads < 1 or self.window < 1 or self.seeds < 1:
            raise SimulationError("threads, window and seeds must be >= 1")
        if not self.chunk_bytes > 0:
            raise SimulationError(f"chunk size must be positive, got {self.chunk_bytes}")
        if self.ps_tasks < 0:
            raise SimulationError(f"ps tasks must be >= 1 (0: as placed), got {self.ps_tasks}")


@dataclasses.dataclass
class Prediction:
    algorithm: str
    iteration: float       # predicted seconds
    comm: float            # the same iteration with zero compute
    comp: float            # the same iteration with free transfers
    lower: float           # no schedule can beat this
    upper: float           # serial sum
    transfers: int

    @property
    def efficiency(self) -> float:
        upper, lower = self.comm + self.comp, max(self.comm, self.comp)
        return float("nan") if upper == lower else (upper - self.iteration) / (upper - lower)


@dataclasses.dataclass
class _Tasks:
    """The iteration's tasks before they become a Problem."""

    kind: list = dataclasses.field(default_factory=list)
    resource: list = dataclasses.field(default_factory=list)
    work: list = dataclasses.field(default_factory=list)
    successors: list = dataclasses.field(default_factory=list)

    def add(self, kind: int, resource: int, work: float) -> int:
        self.kind.append(kind)
        self.resource.append(resource)
        self.work.append(float(work))
        self.successors.append([])
        return len(self.kind) - 1


class _PsGraph:
    """The simulated worker's part of a PS graph as tasks, with its transfers marked."""

    def __init__(self, graph_def, scenario: Scenario, profile: Profile | None):
        self.model = model = GraphModel.from_graph_def(graph_def)
        devices = model.colocated_devices()
        is_ps = DeviceMatcher(scenario.ps_devices)
        ps_tasks = sorted({self._task_of(d) for d in devices if d and is_ps(d)})
        if not ps_tasks:
            raise SimulationError(f"the graph has no node on a PS device ({scenario.ps_devices}); "
                                  "is it a parameter-server graph? (see --ps-devices)")
        workers = sorted({d for d in devices if d and not is_ps(d)})
        self.worker_device = workers[0] if workers else ""
        self.num_ps = scenario.ps_tasks or len(ps_tasks)
        worker_host = self.num_ps
        host = []
        for device in devices:
            if device and is_ps(device):
                host.append(ps_tasks.index(self._task_of(device)))
            elif device in ("", self.worker_device):
                host.append(worker_host)
            else:
                host.append(-1)   # another worker's node: not simulated
        if scenario.ps_tasks:
            self._spread_variables(graph_def, host, devices, is_ps, scenario.ps_tasks)
        self.host = host
        op_seconds = profile.op_seconds if profile else {}
        tasks = _Tasks()
        node_task = [-1] * model.num_nodes
        for node in range(model.num_nodes):
            if host[node] >= 0:
                seconds = op_seconds.get(model.names[node], 0.0) if host[node] == worker_host else 0.0
                node_task[node] = tasks.add(COMPUTE, host[node], seconds)
        self.channels: list[tuple[int, int]] = []
        channel_index: dict[tuple[int, int], int] = {}
        self.pull_of_source: dict[int, int] = {}    # PS source node -> its pull transfer
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
                    if link not in channel_index:
                        channel_index[link] = len(self.channels)
                        self.channels.append(link)
                    size = 0.0
                    if producer in data:
                        size = self._bytes(graph_def, producer, consumer, transfer_bytes)
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

    def _spread_variables(self, graph_def, host, devices, is_ps, num_tasks: int) -> None:
        """What if the variables lived on ``num_tasks`` PS tasks: largest first, each to
        the least loaded task; PS ops go where the variable they use goes."""
        model = self.model
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
        task_of = {}
        for variable in variables:
            task = load.index(min(load))
            task_of[variable] = task
            load[task] += tensor_bytes(graph_def, model, variable) or 0
        for node, variable in root.items():
            host[node] = task_of.get(variable, 0)

    @staticmethod
    def _task_of(device: str) -> str:
        fields = parse_device_spec(device)
        return f"{fields.get('job', '')}:{fields.get('task', '0')}"

    def _bytes(self, graph_def, producer: int, consumer: int, profiled: dict) -> float:
        model = self.model
        name = model.names[producer]
        if name in profiled:
            return float(profiled[name])
        size = tensor_bytes(graph_def, model, producer)
        if size is None:
            # A gradient pushed to its apply op: as large as the variable it updates.
            for source, _ in model.data_inputs[consumer]:
                if is_variable_op(model.ops[source]):
                    size = tensor_bytes(graph_def, model, source)
                    break
        return float(size or 0)


def _problem(graph: _PsGraph, scenario: Scenario, priority, extra_edges=(),
             compute_scale: float = 1.0, transfer_scale: float = 1.0) -> Problem:
    tasks = graph.tasks
    successors = [list(s) for s in tasks.successors]
    for before, after in extra_edges:
        successors[before].append(after)
    kind = np.array(tasks.kind, dtype=np.int8)
    work = np.array(tasks.work, dtype=float)
    work[kind == COMPUTE] *= compute_scale
    work[kind == TRANSFER] *= transfer_scale
    hosts = graph.num_ps + 1
    link = np.full(hosts, float(scenario.bandwidth))
    link[:graph.num_ps] /= scenario.workers
    return Problem(kind=kind, resource=np.array(tasks.resource), work=work,
                   successors=successors, priority=np.asarray(priority, float),
                   threads=[2] * graph.num_ps + [scenario.threads],
                   channels=graph.channels, egress=link, ingress=link.copy(),
                   latency=scenario.latency * transfer_scale, chunk_bytes=scenario.chunk_bytes)


def _gate_edges(graph: _PsGraph, graph_def, scenario: Scenario, algorithm: str,
                profile_path: str) -> tuple[list[tuple[int, int]], int]:
    """The pass's enforcement as task edges: arrival of k -> control message -> read k+w."""
    options = Options(schedule=algorithm, window=scenario.window,
                      ps_devices=scenario.ps_devices, profile=profile_path,
                      bandwidth=scenario.bandwidth)
    _, transfers, orders, _, _, _ = plan_transfer_order(graph_def, PassContext(options=options))
    order = orders.get(graph.worker_device) or next(iter(orders.values()), [])
    sources = [transfers[t].source for t in order]
    edges = []
    for k in range(scenario.window, len(sources)):
        arrived = graph.pull_of_source.get(sources[k - scenario.window])
        read = graph.node_task[sources[k]]
        if arrived is not None and read >= 0:
            edges.append((arrived, read))
    return edges, len(sources)


def prune_to_fetches(graph_def, fetches):
    """The part of ``graph_def`` that running ``fetches`` (node names) executes."""
    model = GraphModel.from_graph_def(graph_def)
    roots = []
    for name in fetches:
        node = model.index.get(name.split(":")[0].lstrip("^"))
        if node is None:
            raise SimulationError(f"fetch {name!r} is not a node of the graph")
        roots.append(node)
    keep = set(roots)
    stack = list(roots)
    while stack:
        for pred in model.predecessors(stack.pop()):
            if pred not in keep:
                keep.add(pred)
                stack.append(pred)
    pruned = type(graph_def)()
    pruned.versions.CopyFrom(graph_def.versions)
    pruned.library.CopyFrom(graph_def.library)
    pruned.node.extend(node for i, node in enumerate(graph_def.node) if i in keep)
    return pruned


def predict(graph_def, scenario: Scenario, algorithms=ALGORITHMS, profile: Profile | None = None,
            profile_path: str = "", fetches=()) -> list[Prediction]:
    """Predicted iteration time, comm, comp and bounds of each algorithm.

    ``fetches``: simulate only what running these nodes executes (default: the whole graph).
    """
    scenario.validate()
    if fetches:
        graph_def = prune_to_fetches(graph_def, fetches)
    if any(node.op == ALLREDUCE_OP for node in graph_def.node) and not any(
            DeviceMatcher(scenario.ps_devices)(node.device) for node in graph_def.node):
        unknown = [a for a in algorithms if a not in ALLREDUCE_ALGORITHMS]
        if unknown:
            raise SimulationError(f"{unknown[0]!r} does not apply to AllReduce (Horovod) "
                                  f"graphs; choose from {ALLREDUCE_ALGORITHMS}")
        return [_predict_allreduce(graph_def, scenario, a, profile) for a in algorithms]
    unknown = [a for a in algorithms if a not in ALGORITHMS]
    if unknown:
        raise SimulationError(f"{unknown[0]!r} does not apply to parameter-server graphs; "
                              f"choose from {ALGORITHMS}")
    graph = _PsGraph(graph_def, scenario, profile)
    if not graph.pull_of_source:
        raise SimulationError("the graph has no parameter transfers to the worker "
                              f"(PS devices {scenario.ps_devices!r})")
    num_tasks = len(graph.tasks.kind)
    pulls = list(graph.pull_of_source.values())
    predictions = []
    for algorithm in algorithms:
        if algorithm == "default":
            edges, count = [], len(pulls)
            priorities = []
            for seed in range(scenario.seeds):
                priority = np.arange(num_tasks, dtype=float)
                priority[pulls] = np.random.default_rng(seed).permutation(len(pulls))
                priorities.append(priority)
        else:
            edges, count = _gate_edges(graph, graph_def, scenario, algorithm, profile_path)
            priorities = [np.arange(num_tasks, dtype=float)]
        makespans = [simulate(_problem(graph, scenario, p, edges)).makespan for p in priorities]
        problem = _problem(graph, scenario, priorities[0], edges)
        comm = simulate(_problem(graph, scenario, priorities[0], edges, compute_scale=0.0))
        comp = simulate(_problem(graph, scenario, priorities[0], edges, transfer_scale=0.0))
        predictions.append(Prediction(
            algorithm=algorithm, iteration=statistics.median(makespans),
            comm=comm.makespan, comp=comp.makespan, lower=lower_bound(problem),
            upper=serial_sum(problem), transfers=count))
    return predictions


def _predict_allreduce(graph_def, scenario: Scenario, algorithm: str, profile) -> Prediction:
    """One iteration of a Horovod graph: the plan's buckets reduced one after another on
    Horovod's background thread, each a ring AllReduce over ``workers`` ranks."""
    from tfoverlap.caramel_plan import bucket_problem, plan_allreduce
    op_seconds = profile.op_seconds if profile else {}
    network = (scenario.workers, scenario.bandwidth, scenario.latency)
    plan = plan_allreduce(graph_def, algorithm, *network, op_seconds, scenario.threads)

    def run(compute_scale: float = 1.0, collective_scale: float = 1.0) -> Problem:
        return bucket_problem(plan, op_seconds, *network, scenario.threads, compute_scale,
                              collective_scale)

    problem = run()
    return Prediction(algorithm=algorithm, iteration=simulate(problem).makespan,
                      comm=simulate(run(compute_scale=0.0)).makespan,
                      comp=simulate(run(collective_scale=0.0)).makespan,
                      lower=lower_bound(problem), upper=serial_sum(problem),
                      transfers=len(plan.buckets))
