"""Decoupled reduction's plan: reduce-scatter under the backward pass, each rank updating
its own shard, all-gather under the next step's forward pass.

A ring AllReduce is a reduce-scatter followed by an all-gather, each half its bytes and
half its latency steps. Inside one step the ring cannot start before the first gradient
exists and is then busy to the end of the step. Decoupled, the reduce-scatters run as the
backward pass produces gradients (half the bytes of the AllReduces), each rank updates the
1/n of every bucket it owns (optimizer state for that shard only), and the all-gathers of
the updated parameters run at the next step's start, first layers first, each layer's
forward ops waiting only for their own bucket.

The plan here, on plain data:

- :func:`reduce_scatter_buckets`: Caramel's network-aware buckets for reduce-scatters
  (whole gradients, no pieces: a bucket's shard is one flat slice of its gradients);
- :func:`gathered_variables`: which variable each gradient updates and which ops read it
  in the forward pass (the ops that wait for its all-gather);
- :func:`decoupled_problem`: one steady-state step as simulator tasks; its makespan is the
  predicted step. :func:`plan_decoupled` keeps the fastest of a few bucket caps and
  all-gather request counts, and predicts Horovod's, the in-step plan's and cross-step
  overlap's steps beside it.
"""
from __future__ import annotations

import dataclasses
import math

import numpy as np

from tfoverlap.costs.network import ring_allreduce_seconds
from tfoverlap.graph.model import GraphModel, is_variable_op
from tfoverlap.options import link_bandwidth
from tfoverlap.planning.caramel import (SPLIT_BYTES, AllreducePlan, PlanInputs,
                                        allreduce_gradients, growing_runs, plan_allreduce,
                                        plan_cross_step, planning_inputs)
from tfoverlap.schedulers.caramel import Bucket, plan_buckets
from tfoverlap.sim.engine import COLLECTIVE, COMPUTE, Problem, simulate

__all__ = ["DecoupledPlan", "reduce_scatter_seconds", "reduce_scatter_buckets",
           "gathered_variables", "gather_chunks", "decoupled_problem", "plan_decoupled",
           "plan_decoupled_for_graph"]


def reduce_scatter_seconds(num_bytes, ranks: int, bandwidth: float, latency: float):
    """A ring reduce-scatter (or all-gather) of ``num_bytes``: half a ring AllReduce,
    ``(n-1) latency + (n-1)/n * bytes / bandwidth``."""
    return ring_allreduce_seconds(num_bytes, ranks, bandwidth, latency) / 2


@dataclasses.dataclass
class DecoupledPlan:
    """Buckets index ``plan.nodes`` positions (whole gradients, in ready order)."""

    plan: AllreducePlan                 # the gradients in ready order; its buckets: ours
    buckets: list[Bucket]               # reduce-scatters, in launch order
    gather_chunks: list[list[int]]      # all-gathers: bucket indices, first needed first
    variables: list[int | None]         # per gradient: the variable node it updates
    readers: dict                       # variable node -> its forward reads
    updates: set                        # the ops that update the variables
    scatter: tuple[float, float]        # (bandwidth, latency) a reduce-scatter is priced at
    gather: tuple[float, float]         # the same for an all-gather
    predicted_step: float = math.nan    # decoupled, simulated (seconds)
    horovod_step: float = math.nan      # Horovod's own fusion, simulated
    caramel_step: float = math.nan      # Caramel's in-step plan, simulated
    cross_step_step: float = math.nan   # Caramel with cross-step overlap, predicted

    @property
    def predicted_gain(self) -> float:
        """Over the best of Horovod's fusion, Caramel's in-step plan and cross-step
        overlap."""
        best = min(self.horovod_step, self.caramel_step, self.cross_step_step)
        return 1.0 - self.predicted_step / best if best > 0 else 0.0

    def problem(self, op_seconds: dict, ranks: int, threads: int, compute_scale: float = 1.0,
                collective_scale: float = 1.0) -> Problem:
        """The plan's step as simulator tasks (:func:`decoupled_problem`)."""
        return decoupled_problem(self.plan, self.buckets, self.gather_chunks, self.variables,
                                 self.readers, self.updates, op_seconds, ranks, self.scatter,
                                 self.gather, threads, compute_scale, collective_scale)


def reduce_scatter_buckets(sizes, ready, ranks: int, bandwidth: float, latency: float,
                           tails=None, threads: int = 1,
                           max_bucket_bytes: float = math.inf) -> list[Bucket]:
    """Caramel's buckets (:func:`~tfoverlap.schedulers.caramel.plan_buckets`) priced as
    reduce-scatters: every term of a ring AllReduce halves, which is the AllReduce's cost
    at twice the bandwidth and half the latency. Gradients are not split. The buckets'
    start and finish times are the reduce-scatters'."""
    return plan_buckets(sizes, ready, ranks, 2 * bandwidth, latency / 2, math.inf, tails,
                        threads, max_bucket_bytes)


def gathered_variables(model: GraphModel, nodes) -> tuple[list[int | None], dict, set]:
    """(the variable node each reduction's gradient updates, None where none is found
    within a few ops downstream; variable node -> the ops that read it outside the
    updates: the forward pass's reads, which wait for the variable's all-gather; the
    update ops: those downstream of a reduction that use a variable)."""
    successors = model.successors()
    variables: list[int | None] = []
    downstream: set[int] = set()
    updates: set[int] = set()
    for node in nodes:
        frontier, seen, variable = [node], {node}, None
        for _ in range(4):
            frontier = [c for f in frontier for c in successors[f] if c not in seen]
            seen.update(frontier)
            using = [(c, p) for c in frontier for p, _ in model.data_inputs[c]
                     if is_variable_op(model.ops[p])]
            if using:
                variable = using[0][1]
                updates.update(c for c, _ in using)
                break
        downstream |= seen
        variables.append(variable)
    readers = {variable: [c for c in dict.fromkeys(successors[variable])
                          if c not in downstream]
               for variable in variables if variable is not None}
    return variables, readers, updates


def gather_chunks(sizes, chunks: int = 4) -> list[list[int]]:
    """The all-gathers of buckets with ``sizes`` (bytes, in the order the forward pass needs
    them), as up to ``chunks`` runs of consecutive buckets, each about twice the bytes of
    the one before: the forward pass waits for the whole first one before it starts, and
    for each later one while it computes the layers before it. Each run is one request
    (they go one after another, so fewer requests wait fewer Horovod cycles)."""
    if chunks < 1:
        raise ValueError(f"gather_chunks needs chunks >= 1, not {chunks}")
    return growing_runs(list(range(len(sizes))), sizes, max(1, min(chunks, len(sizes))))


def decoupled_problem(plan: AllreducePlan, buckets: list[Bucket], gathers: list[list[int]],
                      variables, readers: dict, updates: set, op_seconds: dict, ranks: int,
                      scatter: tuple[float, float], gather: tuple[float, float],
                      threads: int, compute_scale: float = 1.0,
                      collective_scale: float = 1.0) -> Problem:
    """One steady-state step, decoupled, as simulator tasks.

    The all-gathers of the previous step's updates (``gathers``: runs of bucket indices) are
    ready at the step's start and go first on the ring, in order, each priced with
    ``gather`` (bandwidth, latency: :func:`reduce_scatter_seconds`); each variable's
    readers wait for the all-gather of its bucket. The reduce-scatters (priced with
    ``scatter``) follow, each when its gradients are ready; each gradient's update
    waits for its bucket's, and the ``updates`` (ops) cost 1/``ranks`` of their time on
    the whole variable."""
    model = plan.model
    reduced = set(plan.nodes)
    work = []
    for v, name in enumerate(model.names):
        seconds = 0.0 if v in reduced else op_seconds.get(name, 0.0) * compute_scale
        if v in updates:
            seconds /= ranks
        work.append(seconds)
    kind = [COMPUTE] * model.num_nodes
    priority = list(range(model.num_nodes))
    successors = [list(dict.fromkeys(s)) for s in model.successors()]

    def collective(seconds: float, order: float) -> int:
        kind.append(COLLECTIVE)
        work.append(collective_scale * float(seconds))
        successors.append([])
        priority.append(order)
        return len(kind) - 1

    for number, chunk in enumerate(gathers):
        task = collective(reduce_scatter_seconds(sum(buckets[i].size for i in chunk),
                                                 ranks, *gather), number - len(gathers))
        for piece in (piece for index in chunk for piece in buckets[index].pieces):
            successors[task].extend(readers.get(variables[piece.gradient], []))
    for number, bucket in enumerate(buckets):
        task = collective(reduce_scatter_seconds(bucket.size, ranks, *scatter),
                          model.num_nodes + number)
        for node in dict.fromkeys(plan.nodes[piece.gradient] for piece in bucket.pieces):
            for pred in dict.fromkeys(model.predecessors(node)):
                successors[pred].append(task)
            successors[task].append(node)
    link = np.array([float(scatter[0])])     # collectives take their own times
    return Problem(kind=np.array(kind, dtype=np.int8),
                   resource=np.zeros(len(kind), np.int64), work=np.array(work),
                   successors=successors, priority=np.array(priority, dtype=float),
                   threads=[threads], channels=[], egress=link, ingress=link)


#: the bucket caps the plan tries (bytes; each at most the caller's cap)
_BUCKET_CAPS = (4 * 2 ** 20, 16 * 2 ** 20, 64 * 2 ** 20, math.inf)
#: the most all-gather requests the plan tries
_GATHER_REQUESTS = 4


def plan_decoupled(graph_def, ranks: int, bandwidth: float, latency: float,
                   op_seconds: dict | None = None, threads: int = 2,
                   tensor_sizes: dict | None = None,
                   max_bucket_bytes: float = math.inf,
                   split_bytes: float = SPLIT_BYTES,
                   scatter: tuple[float, float] | None = None,
                   gather: tuple[float, float] | None = None) -> DecoupledPlan:
    """The decoupled plan of a Horovod graph and its predicted step, beside Horovod's own
    fusion, Caramel's in-step plan (which splits gradients larger than ``split_bytes``)
    and cross-step overlap, on the same op times. ``max_bucket_bytes`` caps the
    reduce-scatter buckets too. ``scatter`` and ``gather``: the (bandwidth, latency) of a
    reduce-scatter and of an all-gather (:func:`reduce_scatter_seconds`) where they were
    measured; by default each is half the ring AllReduce of ``bandwidth`` and ``latency``.

    Raises:
      ValueError: the graph has no AllReduce to decouple.
    """
    op_seconds = op_seconds or {}
    plan = plan_allreduce(graph_def, "caramel", ranks, bandwidth, latency, op_seconds,
                          threads, split_bytes, tensor_sizes, max_bucket_bytes)
    if not plan.nodes:
        raise ValueError("no AllReduce in the step to decouple")
    times = allreduce_gradients(graph_def, op_seconds, threads, tensor_sizes,
                                (ranks, bandwidth, latency))
    variables, readers, updates = gathered_variables(times.model, times.nodes)
    scatter = scatter or (bandwidth, latency)
    gather = gather or (bandwidth, latency)
    result = None
    # The bucket dynamic program sees the reduce-scatters alone; on the ring they follow
    # the all-gathers, so where requests are dear larger buckets win. The plan is the
    # fastest, in a simulation of the whole step, of the bucket caps and request counts.
    for cap in dict.fromkeys(min(max_bucket_bytes, cap) for cap in _BUCKET_CAPS):
        buckets = reduce_scatter_buckets(times.sizes, times.ready, ranks, *scatter,
                                         times.tails, threads, cap)
        in_ready_order = AllreducePlan("decoupled", times.model, times.nodes, times.sizes,
                                       times.ready, times.tails, buckets, times.producers,
                                       times.left_out)
        # The last buckets reduced hold the first layers: the forward pass needs them first.
        needed = list(reversed(range(len(buckets))))
        for requests in range(1, _GATHER_REQUESTS + 1):
            gathers = [[needed[i] for i in chunk]
                       for chunk in gather_chunks([buckets[i].size for i in needed], requests)]
            candidate = DecoupledPlan(in_ready_order, buckets, gathers, variables, readers,
                                      updates, scatter, gather)
            candidate.predicted_step = simulate(candidate.problem(op_seconds, ranks,
                                                                  threads)).makespan
            if result is None or candidate.predicted_step < result.predicted_step * (1 - 1e-9):
                result = candidate
    result.caramel_step = plan.predicted_step
    result.horovod_step = plan.baseline_step
    # Cross-step overlap as the graph-mode wrapper plans it.
    result.cross_step_step = plan_cross_step(plan, op_seconds, ranks, bandwidth, latency,
                                             threads).predicted_step
    return result


def plan_decoupled_for_graph(graph_def, options, scatter: tuple[float, float] | None = None,
                             gather: tuple[float, float] | None = None,
                             ) -> tuple[DecoupledPlan, PlanInputs]:
    """(plan, what it was planned with) for ``graph_def`` under ``options``, with the op
    times and network Caramel's in-step plan uses (its bucket cap, for AllReduces that
    pipeline with their copies, is not the decoupled plan's); ``tfoverlap schedule --algo
    decoupled`` shows it. ``scatter``, ``gather``: as :func:`plan_decoupled`'s."""
    inputs, op_seconds, tensor_sizes = planning_inputs(graph_def, options)
    plan = plan_decoupled(graph_def, inputs.ranks, link_bandwidth(options),
                          inputs.request_latency(options), op_seconds, inputs.threads,
                          tensor_sizes, split_bytes=options.split_bytes, scatter=scatter,
                          gather=gather)
    return plan, inputs
