"""Caramel's plan for a Horovod graph: which gradients, how large, when ready, which buckets.

The gradients are the inputs of the graph's ``HorovodAllreduce`` ops. Their sizes come
from static shapes, else from the variable the reduced gradient updates. When each is
ready comes from a compute-only simulation of the graph with the profile's op times
(without a profile compute is free, every gradient is ready at once, and the plan is one
bucket). The buckets come from :mod:`tfoverlap.schedulers.caramel`: ``"caramel"`` is the
network-aware plan, ``"default"`` what Horovod's own fusion would do.
"""
from __future__ import annotations

import dataclasses

import numpy as np

from tfoverlap.cost_model import ring_allreduce_seconds
from tfoverlap.graph_model import GraphModel, is_variable_op, tensor_bytes
from tfoverlap.schedulers.caramel import Bucket, horovod_default_buckets, plan_buckets
from tfoverlap.simulator import COLLECTIVE, COMPUTE, Problem, simulate

__all__ = ["ALLREDUCE_OP", "AllreducePlan", "allreduce_gradients", "bucket_problem",
           "plan_allreduce"]

ALLREDUCE_OP = "HorovodAllreduce"
SPLIT_BYTES = 64e6      # gradients larger than this are planned in pieces


@dataclasses.dataclass
class AllreducePlan:
    algorithm: str
    model: GraphModel
    nodes: list[int]          # the AllReduce nodes, in ready order
    sizes: list[int]          # bytes each reduces
    ready: list[float]        # when each one's input is ready (seconds into the step)
    tails: list[float]        # compute that follows each one's reduction
    buckets: list[Bucket]     # pieces refer to positions in ``nodes``


def _gradient_bytes(graph_def, model: GraphModel, node: int, succs) -> int:
    total = 0
    for producer, slot in model.data_inputs[node]:
        size = tensor_bytes(graph_def, model, producer, slot)
        if size is None:
            # The reduced gradient updates a variable a few ops downstream: its size.
            frontier, seen = [node], {node}
            for _ in range(4):
                frontier = [c for f in frontier for c in succs[f] if c not in seen]
                seen.update(frontier)
                variable = next((p for c in frontier for p, _ in model.data_inputs[c]
                                 if is_variable_op(model.ops[p])), None)
                if variable is not None:
                    size = tensor_bytes(graph_def, model, variable)
                    break
        total += size or 0
    return total


def allreduce_gradients(graph_def, op_seconds: dict, threads: int = 2):
    """(model, AllReduce nodes in ready order, their sizes, their ready times, the compute
    that follows each one's reduction: its tail)."""
    model = GraphModel.from_graph_def(graph_def)
    succs = model.successors()
    nodes = [v for v in range(model.num_nodes) if model.ops[v] == ALLREDUCE_OP]
    work = np.array([0.0 if model.ops[v] == ALLREDUCE_OP else op_seconds.get(name, 0.0)
                     for v, name in enumerate(model.names)])
    problem = Problem(kind=np.full(model.num_nodes, COMPUTE, dtype=np.int8),
                      resource=np.zeros(model.num_nodes, dtype=np.int64), work=work,
                      successors=succs, priority=np.arange(model.num_nodes, dtype=float),
                      threads=[threads], channels=[], egress=np.ones(1), ingress=np.ones(1))
    started = simulate(problem).start
    nodes.sort(key=lambda v: (started[v], v))
    sizes = [_gradient_bytes(graph_def, model, v, succs) for v in nodes]
    after = [0.0] * model.num_nodes          # the longest compute path after each node
    for node in reversed(model.topological_order()):
        after[node] = max((work[c] + after[c] for c in succs[node]), default=0.0)
    return (model, nodes, sizes, [float(started[v]) for v in nodes],
            [after[v] for v in nodes])


def bucket_problem(plan: AllreducePlan, op_seconds: dict, ranks: int, bandwidth: float,
                   latency: float, threads: int, compute_scale: float = 1.0,
                   collective_scale: float = 1.0) -> Problem:
    """One iteration under ``plan`` as simulator tasks: the graph's ops on one device, one
    collective per bucket between its gradients' producers and their AllReduce nodes."""
    model = plan.model
    reduced = set(plan.nodes)
    kind = [COMPUTE] * model.num_nodes
    work = [0.0 if v in reduced else op_seconds.get(name, 0.0) * compute_scale
            for v, name in enumerate(model.names)]
    successors = [list(dict.fromkeys(s)) for s in model.successors()]
    for bucket in plan.buckets:
        collective = len(kind)
        kind.append(COLLECTIVE)
        work.append(collective_scale * float(ring_allreduce_seconds(bucket.size, ranks,
                                                                    bandwidth, latency)))
        successors.append([])
        for node in dict.fromkeys(plan.nodes[piece.gradient] for piece in bucket.pieces):
            for pred in dict.fromkeys(model.predecessors(node)):
                successors[pred].append(collective)
            successors[collective].append(node)
    link = np.array([float(bandwidth)])
    return Problem(kind=np.array(kind, dtype=np.int8), resource=np.zeros(len(kind), np.int64),
                   work=np.array(work), successors=successors,
                   priority=np.arange(len(kind), dtype=float), threads=[threads], channels=[],
                   egress=link, ingress=link)


def plan_allreduce(graph_def, algorithm: str, ranks: int, bandwidth: float, latency: float,
                   op_seconds: dict | None = None, threads: int = 2,
                   chunk_bytes: float = SPLIT_BYTES) -> AllreducePlan:
    """The buckets ``algorithm`` ("caramel" or Horovod's "default") makes of the graph.

    Caramel's dynamic program models the step coarsely (a bucket's updates as a tail); the
    plan it returns is the faster, in a simulation of the whole step, of its own and
    Horovod's fusion, so it never loses to Horovod's default under the simulator's model.
    """
    if algorithm not in ("caramel", "default"):
        raise ValueError(f"unknown AllReduce algorithm {algorithm!r}: caramel or default")
    op_seconds = op_seconds or {}
    model, nodes, sizes, ready, tails = allreduce_gradients(graph_def, op_seconds, threads)
    default = AllreducePlan("default", model, nodes, sizes, ready, tails,
                            horovod_default_buckets(sizes, ready, ranks, bandwidth, latency))
    if algorithm == "default":
        return default
    caramel = AllreducePlan("caramel", model, nodes, sizes, ready, tails, plan_buckets(
        sizes, ready, ranks, bandwidth, latency, chunk_bytes, tails, threads))

    def step(plan):
        return simulate(bucket_problem(plan, op_seconds, ranks, bandwidth, latency,
                                       threads)).makespan

    if step(default) < step(caramel):
        caramel.buckets = default.buckets
    return caramel
