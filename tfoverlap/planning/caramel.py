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
import math
import os
import sys

import numpy as np

from tfoverlap.costs.horovod_timeline import StepBreakdown, TensorRecord, step_breakdown
from tfoverlap.costs.network import ring_allreduce_seconds
from tfoverlap.costs.profile import load_profile
from tfoverlap.costs.static import OP_OVERHEAD_SECONDS, static_costs
from tfoverlap.costs.trace import op_type_starts, step_span
from tfoverlap.graph.frames import analysed
from tfoverlap.graph.model import GraphModel, is_variable_input, is_variable_op, tensor_bytes
from tfoverlap.planning.emulation import emulated_op_seconds
from tfoverlap.log import warn_once
from tfoverlap.options import link_bandwidth
from tfoverlap.rewriters.allreduce_grouping import CARAMEL_ATTR, is_plan_check
from tfoverlap.schedulers.caramel import (HOROVOD_FUSION_BYTES, Bucket,
                                          horovod_default_buckets, plan_buckets)
from tfoverlap.sim.engine import COLLECTIVE, COMPUTE, Problem, simulate

__all__ = ["ALLREDUCE_OP", "AllreducePlan", "GradientTimes", "allreduce_gradients",
           "bucket_problem", "plan_allreduce", "is_planned_allreduce", "plan_for_graph",
           "resolve_ranks", "request_latency", "horovod_cycle_seconds", "PlanInputs",
           "HOROVOD_REDUCE_OPS", "HOROVOD_GATHER_OPS", "gradient_submissions",
           "planning_inputs", "traced_step_breakdown",
           "waited_producers", "DEFERRED_ATTR", "deferred_chunks",
           "growing_runs", "gradient_gates", "CrossStepPlan", "plan_cross_step",
           "plan_cross_step_for_graph"]

ALLREDUCE_OP = "HorovodAllreduce"
#: the op types that hand gradients to Horovod for reduction: AllReduces, and decoupled
#: reduction's reduce-scatters.
HOROVOD_REDUCE_OPS = (ALLREDUCE_OP, "HorovodGroupedAllreduce", "HorovodReducescatter",
                      "HorovodGroupedReducescatter")
#: the op types that wait for a Horovod collective other than a reduction.
HOROVOD_GATHER_OPS = ("HorovodAllgather", "HorovodGroupedAllgather")
SPLIT_BYTES = 64e6      # gradients larger than this are planned in pieces


@dataclasses.dataclass
class GradientTimes:
    model: GraphModel
    nodes: list[int]          # the AllReduce nodes, in ready order
    sizes: list[int]          # bytes each reduces
    ready: list[float]        # when each one's input is ready (seconds into the step)
    tails: list[float]        # compute that follows each one's reduction
    producers: list[int]      # the ops computing only gradients, in simulated start order
    left_out: dict = dataclasses.field(default_factory=dict)   # reason -> AllReduce names
    # producer -> positions in ``nodes`` of the gradients it computes
    producer_gradients: dict = dataclasses.field(default_factory=dict)
    # (weight-gradient producer, an op it runs before): see ``weight_first``
    weight_first: list = dataclasses.field(default_factory=list)
    # when the next step's forward pass first uses each one's variable, and the ops that do
    needs: list = dataclasses.field(default_factory=list)
    needers: list = dataclasses.field(default_factory=list)


@dataclasses.dataclass
class AllreducePlan:
    algorithm: str
    model: GraphModel
    nodes: list[int]          # the AllReduce nodes, in ready order
    sizes: list[int]          # bytes each reduces
    ready: list[float]        # when each one's input is ready (seconds into the step)
    tails: list[float]        # compute that follows each one's reduction
    buckets: list[Bucket]     # pieces refer to positions in ``nodes``
    producers: list[int]      # the gradients' producers, in the order they should run
    left_out: dict = dataclasses.field(default_factory=dict)   # reason -> AllReduce names
    predicted_step: float = math.nan    # simulated step under these buckets (seconds)
    baseline_step: float = math.nan     # simulated step under Horovod's own fusion
    # (weight-gradient producer, an op of the backward chain it runs before)
    weight_first: list = dataclasses.field(default_factory=list)
    needs: list = dataclasses.field(default_factory=list)      # as GradientTimes'
    needers: list = dataclasses.field(default_factory=list)


def waited_producers(times: GradientTimes, buckets: list[Bucket]) -> set[int]:
    """The weight-gradient producers of the gradients in buckets that the ring waited for
    (launched the moment their last gradient was ready, the ring idle until then). There,
    each op the backward runs before such a weight gradient delays the ring by its time;
    elsewhere the ring is still busy with earlier buckets, and the backward chain may go
    first."""
    waited = {piece.gradient for bucket in buckets
              if bucket.start <= bucket.ready + 1e-12 for piece in bucket.pieces}
    return {producer for producer, gradients in times.producer_gradients.items()
            if waited.intersection(gradients) and producer in times.producers}


def _gradient_bytes(graph_def, model: GraphModel, node: int, succs,
                    known: dict | None = None) -> int:
    total = 0
    for producer, slot in model.data_inputs[node]:
        size = (known or {}).get(f"{model.names[producer]}:{slot}")
        if size is None:
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


_FORWARDING_OPS = frozenset({"Identity", "IdentityN", "Snapshot"})


_READ_OPS = frozenset({"ReadVariableOp", "Identity", "Snapshot"})


def _variable_users(graph_def, model: GraphModel, node: int, succs, data_consumers,
                    size: int, in_step: set, variable: int | None = None,
                    limit: int = 256) -> list[int]:
    """The ops that use the value of the variable ``node``'s reduced gradient updates,
    outside its update: what the next step's forward pass waits for if that update is
    deferred. The variable is ``variable`` where the caller knows it (a wrapper plans
    before the update is built); else one its update (the ops downstream of ``node``)
    writes, of the gradient's size, whose reads feed ops that are not part of the update
    (a slot such as Adam's ``m`` is read only there; a step counter has another size). A
    gather uses the variable itself. Only ops in ``in_step`` count (the ones the step's
    reductions depend on, not an initializer or a save). Empty where none is found."""
    update, frontier = {node}, [node]
    while frontier and len(update) < limit:
        frontier = [c for f in frontier for c in succs[f] if c not in update]
        update.update(frontier)
    known = variable is not None
    sources = [variable] if known else list(dict.fromkeys(
        p for c in update for p, _ in model.data_inputs[c]
        if is_variable_input(graph_def, model, p)))
    users = []
    for source in sources:
        outside = [c for c in data_consumers[source] if c not in update and c in in_step]
        reads = [c for c in outside if model.ops[c] in _READ_OPS]
        if (not known and size and reads
                and tensor_bytes(graph_def, model, reads[0]) not in (None, size)):
            continue
        found = [c for c in outside if c not in reads]     # a gather reads the handle
        for _ in range(4):       # through Identities to the ops that compute with it
            following = [c for r in reads for c in data_consumers[r]
                         if c not in update and c in in_step]
            found += [c for c in following if model.ops[c] not in _FORWARDING_OPS]
            reads = [c for c in following if model.ops[c] in _FORWARDING_OPS]
        users += found
    return list(dict.fromkeys(users))


def _computing_producer(model: GraphModel, node: int) -> int:
    """The op that computes ``node``'s first input, looking through Identities (which
    Grappler removes, together with any control edge on them)."""
    producer = model.data_inputs[node][0][0]
    for _ in range(16):
        if model.ops[producer] not in _FORWARDING_OPS or not model.data_inputs[producer]:
            break
        producer = model.data_inputs[producer][0][0]
    return producer


def _feeds_only_allreduces(model: GraphModel, data_consumers, producer: int,
                           reduced: set) -> bool:
    """Whether everything ``producer`` computes goes (through Identities) to AllReduces:
    a weight gradient, not an op of the backward chain such as a batch-norm gradient,
    which also produces the next layer's input gradient. Only these are ordered, so the
    order never holds back the backward pass itself."""
    frontier = [producer]
    for _ in range(16):
        following = [c for f in frontier for c in data_consumers[f] if c not in reduced]
        if not following:
            return bool(data_consumers[producer])
        if any(model.ops[c] not in _FORWARDING_OPS for c in following):
            return False
        frontier = following
    return False


def _weight_gradient_producers(model: GraphModel, reductions: list[int]) -> list[int]:
    """The ops computing what the ``reductions`` reduce (through Identities) that compute
    nothing else (:func:`_feeds_only_allreduces`), in the reductions' order."""
    reduced = set(reductions)
    return [p for p in dict.fromkeys(_computing_producer(model, v) for v in reductions
                                     if model.data_inputs[v])
            if _feeds_only_allreduces(model, model.data_consumers(), p, reduced)]


def _reaches(successors, source: int, target: int, position) -> bool:
    """Whether ``target`` depends on ``source`` (nodes after ``target`` in the topological
    ``position`` cannot lead to it)."""
    limit = position[target]
    frontier, seen = [source], {source}
    while frontier:
        node = frontier.pop()
        if node == target:
            return True
        for following in successors[node]:
            if following not in seen and position[following] <= limit:
                seen.add(following)
                frontier.append(following)
    return False


def _may_wait(flow, first: int, then: int) -> bool:
    """Whether ``then`` may wait for ``first`` through a control edge: both run in one
    while-loop frame (the same iteration), ``then`` is no Switch, and ``first`` is live
    whenever ``then`` is (so the edge never kills ``then``)."""
    return (flow.frame[then] == flow.frame[first] == flow.output_frame[first]
            and then not in flow.switch_predicate
            and flow.live_when[first] <= flow.live_when[then])


def _upstream_siblings(model: GraphModel, flow, successors, producer: int, finish,
                       position, excluded: set) -> list[int]:
    """The ops other than ``producer`` that consume the input it receives last (in the
    simulated step: the upstream gradient, not a forward activation) and may wait for it,
    leaving out ``excluded`` ops, Identities and ops ``producer`` depends on."""
    inputs = model.data_inputs[producer]
    if not inputs:
        return []
    upstream = max(inputs, key=lambda pair: (finish[pair[0]], position[pair[0]]))
    return [consumer for consumer in dict.fromkeys(successors[upstream[0]])
            if consumer != producer and consumer not in excluded
            and model.ops[consumer] not in _FORWARDING_OPS      # Grappler drops these
            and upstream in model.data_inputs[consumer] and _may_wait(flow, producer, consumer)
            and not _reaches(successors, consumer, producer, position)]


def gradient_gates(graph_def) -> list[tuple[str, str]]:
    """(weight-gradient producer, backward op) pairs, by name, that make each layer's
    reduced weight gradient run before the layer's other ops on the same upstream gradient
    (its input gradient), wherever that order is not in the graph yet.

    TF1's ``tf.gradients`` gates each op's gradients this way (``GATE_OP``, its optimizers'
    default); a ``GradientTape`` does not, and TensorFlow's executor may then run the
    backward chain ahead and leave the weight gradients, and with them the reductions, to
    the end of the step. Pairs come from every frame (Keras' ``steps_per_execution`` loop
    too), each within one frame, and none where the ops after the sibling already wait
    for the producer.

    The edges close no cycle. In a topological order, each pair's op comes after its
    producer's last input (it consumes it), and anything the producer depends on comes no
    later than that input; so along a cycle of pairs and graph paths, each pair's op would
    come after the one before it, back to itself."""
    model, flow = analysed(graph_def)
    reduced = {v for v in range(model.num_nodes) if is_planned_allreduce(graph_def.node[v])}
    if not reduced:
        return []
    succs = model.successors()
    position = np.empty(model.num_nodes, dtype=np.int64)
    position[model.topological_order()] = np.arange(model.num_nodes)
    producers = _weight_gradient_producers(model, sorted(reduced))
    excluded = set(producers) | reduced
    # Where everything that takes the sibling's output already waits for the producer
    # (TF1's gradient tuples), the backward pass cannot run ahead of it: no pair.
    pairs = [(p, sibling) for p in producers
             for sibling in _upstream_siblings(model, flow, succs, p, position, position,
                                               excluded)
             if not all(_reaches(succs, p, after, position)
                        for after in succs[sibling] or [sibling])]
    return [(model.names[p], model.names[sibling]) for p, sibling in pairs]


#: marks an AllReduce of a gradient deferred to the next step (tfoverlap.horovod's
#: cross_step): it reduces a buffer at the step's start, apart from the buckets.
DEFERRED_ATTR = "_tfoverlap_deferred"


def is_planned_allreduce(node_def) -> bool:
    """A HorovodAllreduce that Caramel may bucket (not one of its own plan-check ops, nor a
    deferred gradient's)."""
    return (node_def.op == ALLREDUCE_OP and CARAMEL_ATTR not in node_def.attr
            and DEFERRED_ATTR not in node_def.attr)


def deferred_chunks(plan: AllreducePlan, ring_seconds, chunks: int = 4,
                    request_seconds: float = 0.0) -> list[list[int]]:
    """Which gradients to reduce under the next step's forward pass, in chunks (positions
    in ``plan.nodes``; first chunk first; each chunk in the order the forward pass needs
    its variables).

    The last gradients to become ready are the first layers' (the forward pass needs them
    first); after the last one the ring still has ``plan``'s tail to reduce. Those are
    deferred, from the last-ready backwards, while their ring time (``ring_seconds[i]``,
    the bandwidth term: a chunk goes as one request) plus ``request_seconds`` per chunk
    stays within both that tail and the forward pass (the time to the first gradient), and
    cut into up to ``chunks`` runs, each of about twice the ring time of the one before:
    the forward pass waits for the first chunk's updates before it starts, and for the
    later ones while it computes the layers before them."""
    if chunks < 1:
        raise ValueError(f"deferred_chunks needs chunks >= 1, not {chunks}")
    if not plan.buckets or not plan.nodes:
        return []
    window = min(plan.ready[0], max(0.0, plan.buckets[-1].finish - plan.ready[-1]))
    for chunks in range(chunks, 0, -1):       # fewer chunks where less fits
        budget = window - chunks * request_seconds
        chosen, total = [], 0.0
        for position in reversed(range(len(plan.nodes))):
            if total + ring_seconds[position] > budget + 1e-12:
                break
            chosen.append(position)
            total += ring_seconds[position]
        # Enough to fill the chunks, and more ring time than their requests cost.
        if len(chosen) >= chunks and total > chunks * request_seconds:
            break
    if not chosen or total <= chunks * request_seconds:
        return []
    return growing_runs(chosen, [ring_seconds[position] for position in chosen], chunks)


def growing_runs(items: list, weights, runs: int) -> list[list]:
    """``items`` cut, in order, into up to ``runs`` runs of about twice the weight of the
    run before: run k ends where the first k + 1 hold (2^(k+1) - 1) / (2^runs - 1) of the
    total weight."""
    total = float(sum(weights))
    ends = [total * (2 ** (k + 1) - 1) / (2 ** runs - 1) for k in range(runs)]
    result, current, filled = [], [], 0.0
    for item, weight in zip(items, weights):
        current.append(item)
        filled += weight
        if filled >= ends[len(result)] - 1e-12 and len(result) < runs - 1:
            result.append(current)
            current = []
    if current:
        result.append(current)
    return result


@dataclasses.dataclass
class CrossStepPlan:
    """What cross-step overlap would defer: ``chunks`` of gradients (positions in the
    plan's ``nodes``, first chunk issued first), chosen as ``order`` ("next-forward
    need", "readiness suffix"; "" where there is no candidate) because the simulated step
    with them, ``predicted_step`` (drain share included), is the shortest of the
    deferring ``candidates`` (order -> predicted step; "in-step" the step with nothing
    deferred, which may be shorter still). ``drain``: the seconds the chunks' reductions
    take when exposed, one after the other (a drain)."""

    chunks: list
    order: str
    predicted_step: float
    in_step: float
    candidates: dict
    drain: float = 0.0


def _need_chunks(plan: AllreducePlan, ring_seconds, positions: list[int], chunks: int,
                 request_seconds: float) -> list[list[int]]:
    """``positions`` in next-forward need order, cut into the runs (1 to ``chunks``,
    each about twice the ring time of the one before) whose reductions, one after the
    other from the step's start, keep the forward pass waiting least."""
    ordered = sorted(positions, key=lambda position: (plan.needs[position], -position))
    best, best_wait = [ordered], math.inf
    for count in range(1, min(chunks, len(ordered)) + 1):
        runs = growing_runs(ordered, [ring_seconds[p] for p in ordered], count)
        done, wait = 0.0, 0.0
        for run in runs:
            done += sum(ring_seconds[p] for p in run) + request_seconds
            wait = max(wait, done - min(plan.needs[p] for p in run))
        if wait < best_wait - 1e-12:
            best, best_wait = runs, wait
    return best


def plan_cross_step(plan: AllreducePlan, op_seconds: dict, ranks: int, bandwidth: float,
                    latency: float, threads: int, eligible=None, chunks: int = 4,
                    fuse_queued: bool = True, drain_every: int = 0,
                    sizes_tried: int = 16) -> CrossStepPlan:
    """Which reductions to move under the next step's forward pass, and in which order.

    Two families of candidates, each simulated as the step after a deferring one
    (:func:`bucket_problem` with ``deferred``): the *readiness suffix*, the gradients
    ready last (the first layers', which the forward pass needs first,
    :func:`deferred_chunks`); and *next-forward need*, the gradients whose variables the
    forward pass uses last (the top layers'; ``sizes_tried`` sizes of that set, up to
    three forward passes of ring time, alone and with the suffix), issued in need order
    so that each update lands before its first use while the forward pass computes the
    layers below. Where a step is bound by its reductions, these are what the ring should
    still be doing when the next step starts. Only
    positions in ``eligible`` (all if None) are deferred, never all of them (a step keeps
    something of its own to reduce). ``drain_every`` N charges a drain of the deferred
    reductions, exposed once every N steps, to each step."""
    rings = [float(ring_allreduce_seconds(size, ranks, bandwidth, 0.0)) for size in plan.sizes]
    request = float(ring_allreduce_seconds(0, ranks, 1.0, latency))
    allowed = set(range(len(plan.nodes)) if eligible is None else eligible)

    def drain(candidate):
        return sum(rings[p] for chunk in candidate for p in chunk) + len(candidate) * request

    def step(candidate):
        simulated = simulate(bucket_problem(plan, op_seconds, ranks, bandwidth, latency,
                                            threads, fuse_queued=fuse_queued,
                                            deferred=candidate)).makespan
        return simulated + (drain(candidate) / drain_every if drain_every and candidate
                            else 0.0)

    in_step = min(plan.predicted_step, plan.baseline_step)
    options = {}
    suffix = [[p for p in chunk if p in allowed]
              for chunk in deferred_chunks(plan, rings, chunks, request)]
    suffix = [chunk for chunk in suffix if chunk]

    def partial(candidate):
        return 0 < sum(len(chunk) for chunk in candidate) < len(allowed)
    if partial(suffix):
        options["readiness suffix"] = (step(suffix), suffix)
    known = sorted((p for p in allowed if plan.needers[p] and plan.needs[p] > 0),
                   key=lambda p: (-plan.needs[p], p))
    # Sets of the latest-needed gradients up to three forward passes of ring time (a
    # forward pass that waits a little for a large gradient can still gain), alone and
    # with the suffix (which the forward pass needs first).
    forward = max((plan.needs[p] for p in known), default=0.0)
    half = max(1, sizes_tried // 2)
    totals = np.cumsum([rings[p] for p in known])
    limits = np.concatenate([np.linspace(forward / half, forward, half),
                             np.linspace(forward, 3 * forward, sizes_tried - half + 1)[1:]])
    counts = {int(np.searchsorted(totals, limit, side="right")) for limit in limits} - {0}
    first = [p for chunk in suffix for p in chunk]
    for count in sorted(counts):
        need = known[:count]
        with_suffix = [first + [p for p in need if p not in first]] if first else []
        for positions in [need] + with_suffix:
            candidate = _need_chunks(plan, rings, positions, chunks, request)
            if not partial(candidate):
                continue
            predicted = step(candidate)
            if predicted < options.get("next-forward need", (math.inf,))[0]:
                options["next-forward need"] = (predicted, candidate)
    candidates = {"in-step": in_step, **{order: predicted
                                         for order, (predicted, _) in options.items()}}
    order = min(options, key=lambda name: options[name][0], default="")
    if not order:
        return CrossStepPlan([], "", in_step, in_step, candidates)
    chosen = options[order][1]
    return CrossStepPlan(chosen, order, options[order][0], in_step, candidates, drain(chosen))


def allreduce_gradients(graph_def, op_seconds: dict, threads: int = 2,
                        tensor_sizes: dict | None = None,
                        network: tuple[int, float, float] | None = None,
                        weight_first: frozenset = frozenset(),
                        variables: dict | None = None) -> GradientTimes:
    """The graph's AllReduce nodes in the order their gradients become ready.

    One compute-only simulation of the step with ``op_seconds`` on ``threads`` threads
    (TensorFlow's inter-op pool). Ready ops run in critical-path priority: the longest
    remaining path, where an AllReduce counts its ring time under ``network`` (ranks,
    bytes/s, latency), so that gradients whose communication is long are produced early.
    The weight-gradient producers in ``weight_first`` run before any other ready op; the
    result's ``weight_first`` pairs each with the ops of the backward chain that it then
    runs before (the other consumers of its upstream gradient).
    """
    model, flow = analysed(graph_def)
    succs = model.successors()
    nodes, left_out = [], {}
    for v in range(model.num_nodes):
        if not is_planned_allreduce(graph_def.node[v]):
            continue
        # A bucket is one op of the root frame: only reductions that run in every step there.
        inputs = model.data_inputs[v]
        if flow.is_plain(v) and all(flow.is_plain_output(p, s) for p, s in inputs):
            nodes.append(v)
        else:
            reason = flow.why_not_plain(v) or next(
                "input " + (flow.why_not_plain(p) or "in a cond branch") for p, s in inputs
                if not flow.is_plain_output(p, s))
            left_out.setdefault(reason, []).append(model.names[v])
    sizes_by_node = {v: _gradient_bytes(graph_def, model, v, succs, tensor_sizes)
                     for v in nodes}
    work = np.array([0.0 if model.ops[v] == ALLREDUCE_OP else op_seconds.get(name, 0.0)
                     for v, name in enumerate(model.names)])
    comm = np.zeros(model.num_nodes)
    if network is not None:
        for v in nodes:
            comm[v] = ring_allreduce_seconds(sizes_by_node[v], *network)
    topological = model.topological_order()
    position = np.empty(model.num_nodes, dtype=np.int64)
    position[topological] = np.arange(model.num_nodes)
    remaining = np.zeros(model.num_nodes)      # critical path from each node to the end
    after = np.zeros(model.num_nodes)          # compute after each node (its tail)
    for node in reversed(topological):
        remaining[node] = work[node] + comm[node] + max(
            (remaining[c] for c in succs[node]), default=0.0)
        after[node] = max((work[c] + after[c] for c in succs[node]), default=0.0)
    # Lower priority runs first: the longest remaining path, then topological position.
    urgent = np.zeros(model.num_nodes, dtype=bool)
    urgent[list(weight_first)] = True
    priority = np.empty(model.num_nodes)
    priority[np.lexsort((position, -remaining, ~urgent))] = np.arange(model.num_nodes)
    problem = Problem(kind=np.full(model.num_nodes, COMPUTE, dtype=np.int8),
                      resource=np.zeros(model.num_nodes, dtype=np.int64), work=work,
                      successors=succs, priority=priority,
                      threads=[threads], channels=[], egress=np.ones(1), ingress=np.ones(1))
    schedule = simulate(problem)
    started = schedule.start
    nodes.sort(key=lambda v: (started[v], position[v]))
    reduced = set(nodes)
    producers = [p for p in _weight_gradient_producers(model, nodes) if flow.is_plain(p)]
    producers.sort(key=lambda p: (started[p], position[p]))
    producer_gradients: dict[int, list[int]] = {}
    for index, node in enumerate(nodes):
        if model.data_inputs[node]:
            producer_gradients.setdefault(_computing_producer(model, node), []).append(index)
    finish = started + work
    excluded = set(producers) | reduced
    consumers = model.data_consumers()
    in_step, frontier = set(nodes), list(nodes)
    while frontier:
        frontier = [p for f in frontier for p in model.predecessors(f) if p not in in_step]
        in_step.update(frontier)
    index = {name: node for node, name in enumerate(model.names)}
    variable_of = {node: index.get((variables or {}).get(model.names[node])) for node in nodes}
    needers = [_variable_users(graph_def, model, v, succs, consumers, sizes_by_node[v],
                               in_step, variable_of[v]) for v in nodes]
    needs = [min((float(started[u]) for u in users), default=0.0) for users in needers]

    def order(node):     # the simulated order: a linear extension of the graph
        return (started[node], position[node])

    # Only pairs the simulation ran in this order: with the producer chain (same order)
    # they can never close a cycle.
    pairs = [(p, sibling) for p in producers if p in weight_first
             for sibling in _upstream_siblings(model, flow, succs, p, finish, position,
                                               excluded) if order(p) < order(sibling)]
    return GradientTimes(model=model, nodes=nodes, sizes=[sizes_by_node[v] for v in nodes],
                         ready=[float(started[v]) for v in nodes],
                         tails=[float(after[v]) for v in nodes], producers=producers,
                         left_out=left_out, producer_gradients=producer_gradients,
                         weight_first=pairs, needs=needs, needers=needers)


def bucket_problem(plan: AllreducePlan, op_seconds: dict, ranks: int, bandwidth: float,
                   latency: float, threads: int, compute_scale: float = 1.0,
                   collective_scale: float = 1.0, fuse_queued: bool = True,
                   deferred: list[list[int]] = ()) -> Problem:
    """One iteration under ``plan`` as simulator tasks: the graph's ops on one device, one
    collective per request between its gradients' producers and their AllReduce nodes.

    With ``fuse_queued`` the requests are what Horovod makes of the buckets: every cycle
    its background thread fuses the buckets that were handed to it while the ring was
    busy (:func:`~tfoverlap.schedulers.caramel.horovod_default_buckets` over the buckets'
    sizes and ready times), so queued buckets pay one request, not one each.

    ``deferred``: chunks of gradients (positions in ``plan.nodes``) reduced under this
    step's forward pass instead, as the step after a cross-step one runs: they leave the
    buckets, and each chunk is one request at the step's start (first chunk first) that
    the ops using its variables (``plan.needers``) wait for; all ops, where a variable's
    users are unknown."""
    model = plan.model
    buckets = plan.buckets
    if deferred:
        moved = {position for chunk in deferred for position in chunk}
        buckets = []
        for bucket in plan.buckets:
            pieces = tuple(piece for piece in bucket.pieces if piece.gradient not in moved)
            if pieces:
                ready = max(plan.ready[piece.gradient] for piece in pieces)
                buckets.append(Bucket(pieces, ready, bucket.start, bucket.finish))
    reduced = set(plan.nodes)
    kind = [COMPUTE] * model.num_nodes
    work = [0.0 if v in reduced else op_seconds.get(name, 0.0) * compute_scale
            for v, name in enumerate(model.names)]
    successors = [list(dict.fromkeys(s)) for s in model.successors()]
    if fuse_queued and buckets:
        fused = horovod_default_buckets([b.size for b in buckets], [b.ready for b in buckets],
                                        ranks, bandwidth, latency)
        requests = [[piece for member in request.pieces
                     for piece in buckets[member.gradient].pieces] for request in fused]
    else:
        requests = [list(bucket.pieces) for bucket in buckets]
    for pieces in requests:
        collective = len(kind)
        kind.append(COLLECTIVE)
        size = sum(piece.size for piece in pieces)
        work.append(collective_scale * float(ring_allreduce_seconds(size, ranks, bandwidth,
                                                                    latency)))
        successors.append([])
        for node in dict.fromkeys(plan.nodes[piece.gradient] for piece in pieces):
            for pred in dict.fromkeys(model.predecessors(node)):
                successors[pred].append(collective)
            successors[collective].append(node)
    priority = list(range(len(kind)))
    sources = [v for v in range(model.num_nodes) if not model.predecessors(v)]
    for number, chunk in enumerate(deferred):
        kind.append(COLLECTIVE)
        work.append(collective_scale * float(ring_allreduce_seconds(
            sum(plan.sizes[position] for position in chunk), ranks, bandwidth, latency)))
        users = [user for position in chunk for user in plan.needers[position]]
        unknown = any(not plan.needers[position] for position in chunk)
        successors.append(list(dict.fromkeys(sources if unknown else users)))
        priority.append(number - len(deferred))
    link = np.array([float(bandwidth)])
    return Problem(kind=np.array(kind, dtype=np.int8), resource=np.zeros(len(kind), np.int64),
                   work=np.array(work), successors=successors,
                   priority=np.array(priority, dtype=float), threads=[threads], channels=[],
                   egress=link, ingress=link)


def plan_allreduce(graph_def, algorithm: str, ranks: int, bandwidth: float, latency: float,
                   op_seconds: dict | None = None, threads: int = 2,
                   chunk_bytes: float = SPLIT_BYTES,
                   tensor_sizes: dict | None = None,
                   max_bucket_bytes: float = math.inf,
                   fuse_queued: bool = True, variables: dict | None = None) -> AllreducePlan:
    """The buckets ``algorithm`` ("caramel" or Horovod's "default") makes of the graph.
    ``variables``: AllReduce name -> the op of the variable its gradient updates, where
    known (:func:`allreduce_gradients`).

    Caramel's dynamic program models the step coarsely (a bucket's updates as a tail); the
    plan it returns is the faster, in a simulation of the whole step, of its own and
    Horovod's fusion with a buffer of at most ``max_bucket_bytes``. ``fuse_queued``: the
    simulation lets Horovod fuse buckets queued behind a busy ring (buckets issued as
    soon as they exist; not where each waits for the one before to be reduced).
    """
    if algorithm not in ("caramel", "default"):
        raise ValueError(f"unknown AllReduce algorithm {algorithm!r}: caramel or default")
    op_seconds = op_seconds or {}
    network = (ranks, bandwidth, latency)
    times = allreduce_gradients(graph_def, op_seconds, threads, tensor_sizes, network,
                                variables=variables)

    def plan(name, buckets, times=times):
        return AllreducePlan(name, times.model, times.nodes, times.sizes, times.ready,
                             times.tails, buckets, times.producers, times.left_out,
                             weight_first=times.weight_first, needs=times.needs,
                             needers=times.needers)

    def caramel_buckets(times):
        return plan_buckets(times.sizes, times.ready, ranks, bandwidth, latency, chunk_bytes,
                            times.tails, threads, max_bucket_bytes)

    default = plan("default", horovod_default_buckets(times.sizes, times.ready, *network))
    if algorithm == "default":
        return default
    buckets = caramel_buckets(times)
    waited = waited_producers(times, buckets)
    if waited:
        # Where the ring waits for a gradient, its weight gradient goes first: the
        # gradients are ready earlier, and the buckets are planned for those times.
        times = allreduce_gradients(graph_def, op_seconds, threads, tensor_sizes, network,
                                    weight_first=frozenset(waited), variables=variables)
        buckets = caramel_buckets(times)
    caramel = plan("caramel", buckets, times)

    def step(candidate):
        return simulate(bucket_problem(candidate, op_seconds, ranks, bandwidth, latency,
                                       threads, fuse_queued=fuse_queued)).makespan

    # Horovod's fusion with a buffer no larger than the bucket cap, if that is faster.
    fused = plan("default", horovod_default_buckets(
        times.sizes, times.ready, *network,
        fusion_bytes=min(HOROVOD_FUSION_BYTES, max_bucket_bytes)), times)
    caramel.predicted_step = step(caramel)
    fused_step = step(fused)
    if fused_step < caramel.predicted_step:
        caramel.buckets, caramel.predicted_step = fused.buckets, fused_step
    caramel.baseline_step = step(default)
    return caramel


def resolve_ranks(requested: int) -> int:
    """``requested``, or the job's size: Horovod's if it is initialized in this process,
    else the launcher's environment; 1 (with a warning) if nothing says."""
    if requested:
        return requested
    horovod = sys.modules.get("horovod.tensorflow")
    if horovod is not None:
        try:
            return int(horovod.size())
        except (ValueError, RuntimeError):
            pass
    for variable in ("HOROVOD_SIZE", "OMPI_COMM_WORLD_SIZE", "PMI_SIZE"):
        if os.environ.get(variable, "").isdigit():
            return int(os.environ[variable])
    warn_once("tfoverlap: Caramel cannot tell how many Horovod ranks the job has (Horovod "
              "is not initialized here, and HOROVOD_SIZE / OMPI_COMM_WORLD_SIZE are unset); "
              "it plans for one rank. Set the 'ranks' option.")
    return 1


def horovod_cycle_seconds(cycle_ms: float) -> float:
    """Horovod's cycle: ``cycle_ms`` if set, else HOROVOD_CYCLE_TIME (ms), else 1 ms."""
    if cycle_ms > 0:
        return cycle_ms / 1e3
    try:
        return float(os.environ.get("HOROVOD_CYCLE_TIME", "1")) / 1e3
    except ValueError:
        return 1e-3


def request_latency(latency: float, ranks: int, cycle: float) -> float:
    """The alpha to plan with: the ring's per-step latency plus Horovod's cycle (seconds),
    spread over the ring's 2 (n-1) steps. Each bucket waits for the one before it, so it is
    announced just after a cycle began and waits about one cycle to start."""
    return latency + (cycle / (2 * (ranks - 1)) if ranks > 1 else 0.0)


#: Caramel's FLOP rate when none is given: a constant, since every rank must plan alike.
DEFAULT_FLOPS = 2e10


def planning_flops(options) -> float:
    return options.flops or DEFAULT_FLOPS


def _op_costs(graph_def, options) -> tuple[dict, dict, str]:
    """(op seconds, known tensor sizes, where the times came from)."""
    sizes: dict = {}
    try:
        estimate = static_costs(graph_def, planning_flops(options))
        sizes = estimate.tensor_bytes
    except Exception as error:  # noqa: BLE001 - TensorFlow cannot import it: unit costs
        warn_once(f"tfoverlap: Caramel cannot estimate op times ({type(error).__name__}: "
                  f"{error}); it orders by graph structure with equal op costs")
        estimate = None
    if options.profile:
        profile = load_profile(options.profile)
        return dict(profile.op_seconds), sizes, "profile"
    if estimate is None:
        return ({node.name: OP_OVERHEAD_SECONDS for node in graph_def.node}, sizes,
                "unit costs")
    emulated, described = emulated_op_seconds(graph_def, options)
    if emulated:
        return {**estimate.op_seconds, **emulated}, sizes, f"static estimate, {described}"
    return estimate.op_seconds, sizes, "static estimate"


@dataclasses.dataclass(frozen=True)
class PlanInputs:
    """What a Caramel plan depends on besides the graph: all ranks must agree on these."""

    ranks: int
    threads: int
    cycle_seconds: float
    ready_times_from: str       # "profile", "static estimate" or "unit costs"

    def settings(self, options) -> dict:
        """The options a plan digest covers (host facts only shape the buckets, which the
        digest covers anyway)."""
        return {"ranks": self.ranks, "bandwidth": link_bandwidth(options),
                "latency": options.latency, "split_bytes": options.split_bytes,
                "bucket_bytes": options.bucket_bytes}

    def request_latency(self, options) -> float:
        """The alpha the plan uses (:func:`request_latency`)."""
        return request_latency(options.latency, self.ranks, self.cycle_seconds)

    def describe(self, options) -> str:
        """This rank's planning inputs, for a mismatch message that lets ranks be compared."""
        return (f"ranks={self.ranks}, threads={self.threads}, "
                f"cycle={self.cycle_seconds * 1e3:g} ms, "
                f"bandwidth={link_bandwidth(options):.6g} B/s, "
                f"latency={options.latency:.6g} s, flops={planning_flops(options):.6g}, "
                f"op times from {self.ready_times_from}")


def planning_inputs(graph_def, options) -> tuple[PlanInputs, dict, dict]:
    """(what a plan of ``graph_def`` under ``options`` is made with, the op seconds, the
    known tensor sizes)."""
    ranks = resolve_ranks(options.ranks)
    threads = options.threads or os.cpu_count() or 1
    cycle = horovod_cycle_seconds(options.cycle_ms)
    op_seconds, tensor_sizes, source = _op_costs(graph_def, options)
    return PlanInputs(ranks, threads, cycle, source), op_seconds, tensor_sizes


def plan_for_graph(graph_def, options) -> tuple[AllreducePlan, PlanInputs]:
    """(plan, what it was planned with): exactly what the pass plans for ``graph_def``
    under ``options``; ``tfoverlap schedule --algo caramel`` shows it."""
    plan, inputs, _ = _planned(graph_def, options)
    return plan, inputs


def _planned(graph_def, options, variables: dict | None = None
             ) -> tuple[AllreducePlan, PlanInputs, dict]:
    inputs, op_seconds, tensor_sizes = planning_inputs(graph_def, options)
    plan = plan_allreduce(graph_def, "caramel", inputs.ranks, link_bandwidth(options),
                          inputs.request_latency(options), op_seconds, inputs.threads,
                          options.split_bytes, tensor_sizes, options.bucket_bytes,
                          fuse_queued=options.bucket_chain != "finished",
                          variables=variables)
    return plan, inputs, op_seconds


def plan_cross_step_for_graph(graph_def, options, eligible_names=None, drain_every: int = 0,
                              variables: dict | None = None
                              ) -> tuple[AllreducePlan, CrossStepPlan]:
    """(the in-step plan, what cross-step overlap defers) for ``graph_def`` under
    ``options``, deferring only the AllReduces named in ``eligible_names`` (all if
    None); :func:`plan_cross_step`'s ``drain_every``; ``variables`` as
    :func:`plan_allreduce`'s."""
    plan, inputs, op_seconds = _planned(graph_def, options, variables)
    eligible = None if eligible_names is None else [
        position for position, node in enumerate(plan.nodes)
        if plan.model.names[node] in eligible_names]
    cross = plan_cross_step(plan, op_seconds, inputs.ranks, link_bandwidth(options),
                            inputs.request_latency(options), inputs.threads, eligible,
                            fuse_queued=options.bucket_chain != "finished",
                            drain_every=drain_every)
    return plan, cross


def gradient_submissions(run_metadata, devices: str = "") -> tuple[list[int], set[str]]:
    """(when each gradient was handed to Horovod in a traced step, µs since the epoch;
    the names of all its collective ops: reductions and all-gathers, which last until
    their collective is done). Caramel's plan check reduces at the step's start and is
    not a gradient."""
    submitted = op_type_starts(run_metadata, HOROVOD_REDUCE_OPS, devices)
    gathers = op_type_starts(run_metadata, HOROVOD_GATHER_OPS, devices)
    return ([micros for micros, name in submitted if not is_plan_check(name)],
            {name for _, name in submitted + gathers})


def traced_step_breakdown(run_metadata, records: dict[str, TensorRecord],
                          devices: str = "") -> StepBreakdown:
    """Where rank 0's traced step went, given Horovod's timeline of the same run.

    Raises:
      ValueError: no gradient in the step, or no reduction of the timeline inside it
        (a timeline of another run).
    """
    start, end = step_span(run_metadata, devices)
    ready, _ = gradient_submissions(run_metadata, devices)
    breakdown = step_breakdown(start, end, ready, records)
    if breakdown.ring <= 0:
        raise ValueError("the timeline has no reduction inside the traced step (is it the "
                         "timeline of the same run, written by rank 0?)")
    return breakdown
