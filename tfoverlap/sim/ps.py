"""What-if simulation of a parameter-server graph: from a GraphDef to the simulator's tasks.

One worker is simulated in full; the other ``workers - 1`` are assumed to do the same at
the same time, so each PS task's link is shared by all of them: its bandwidth per worker
is ``bandwidth / workers`` (the testbed's two workers pulling from one PS showed exactly
this sharing). Compute times come from a profile (``tfoverlap.profile``) by node name;
ops it lacks cost nothing, and transfers it lacks are sized from the graph.

Variants: ``default`` (TensorFlow: every transfer requested at once, one PS link sends
them one at a time in a random order; the result is the median over ``seeds`` orders),
``tic`` and ``tac`` (the order the TicTac pass plans, enforced the way the pass does: the
reads of release group j+window wait for the arrival of every transfer of group j, or for
the consumer the plan gates on, plus the control message back to the PS).
"""
from __future__ import annotations

import dataclasses
import statistics

import numpy as np

from tfoverlap.costs.profile import Profile
from tfoverlap.graph.devices import DeviceMatcher, task_of
from tfoverlap.graph.model import (RESOURCE_HANDLE_OPS, GraphModel, edge_bytes, is_variable_op,
                                   tensor_bytes)
from tfoverlap.options import parse_options
from tfoverlap.planning.tictac import plan_transfer_order
from tfoverlap.sim.engine import COMPUTE, TRANSFER, Problem, lower_bound, serial_sum, simulate
from tfoverlap.sim.scenario import Prediction, Scenario, SimulationError

__all__ = ["PS_ALGORITHMS", "predict_ps"]

PS_ALGORITHMS = ("default", "tic", "tac")


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
        ps_tasks = sorted({task_of(d) for d in devices if d and is_ps(d)})
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
                host.append(ps_tasks.index(task_of(device)))
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
                seconds = (op_seconds.get(model.names[node], 0.0) if host[node] == worker_host
                           else 0.0)
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

    def _bytes(self, graph_def, producer: int, consumer: int, profiled: dict) -> float:
        model = self.model
        name = model.names[producer]
        if name in profiled:
            return float(profiled[name])
        return float(edge_bytes(graph_def, model, producer, consumer) or 0)


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


def predict_ps(graph_def, scenario: Scenario, algorithms=PS_ALGORITHMS,
               profile: Profile | None = None, profile_path: str = "") -> list[Prediction]:
    """Predicted iteration time, comm, comp and bounds of each algorithm on a PS graph."""
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
