"""The Caramel pass: Horovod AllReduce training with a fixed backward order and planned buckets.

On a graph with ``HorovodAllreduce`` ops (what ``hvd.DistributedOptimizer`` and
``hvd.DistributedGradientTape`` leave once Grappler has folded their ``size() > 1`` cond):

1. *Computation order.* When communication is the bottleneck (the planned reductions
   take 1.5x the window in which gradients appear, or more), the ops that compute only
   gradients (weight gradients; not the ops of the backward chain, such as batch-norm
   gradients, which the chain would hold back) are chained by control edges in the order
   a critical-path list schedule of the step runs them (an AllReduce counts its ring time,
   so gradients with long transfers are produced early). The order is a linear extension
   of the graph, so the chain never closes a cycle, and it is a function of the graph
   and the options alone, so every rank produces its gradients in the same order. When
   compute is the bottleneck the reductions keep up anyway, and a fixed order would only
   risk holding back compute that runs differently from the estimates. Per layer, the
   weight gradient also runs before the other consumers of its upstream gradient (the
   layer's input gradient) where the plan has the ring waiting for that gradient's bucket
   (:func:`~tfoverlap.planning.caramel.waited_producers`), and the buckets are planned
   for the ready times that order gives; where the ring is still busy with earlier
   buckets, the executor keeps its own order.
   Otherwise, and wherever the pass plans no buckets (it declines, or the reductions run
   in a while loop such as Keras' ``steps_per_execution`` loop), each layer's weight
   gradient is still gated before the layer's input gradient where the graph does not
   already do so (:func:`~tfoverlap.planning.caramel.gradient_gates`): TF1's optimizers
   gate each op's gradients, a ``GradientTape`` does not, and without it the executor
   may leave the weight gradients, and the ring, to the end of the backward pass.
2. *Buckets.* :func:`tfoverlap.planning.caramel.plan_allreduce` picks bucket boundaries with the
   ring alpha-beta model and the expected ready times, splitting gradients larger than
   ``split_bytes``; each bucket becomes one ``HorovodGroupedAllreduce``, issued when its
   last input exists and the inputs of the bucket before it exist too (``bucket_chain``:
   so Horovod gets them in plan order, while both can be in flight; "finished" waits for
   the one before to be reduced); each update reads only its own bucket.
3. *Agreement.* Every bucket waits for a check that all ranks planned the same buckets; a
   mismatch fails the step on every rank with a message naming the first difference.

Before any of this, the plan is simulated against Horovod's own fusion; where it predicts
less than ``min_gain`` the pass leaves the graph to Horovod (``force`` overrides). Every
rank decides from the same inputs, so all decide alike.

Ready times come from the profile when one is given, else from static estimates
(:mod:`tfoverlap.costs.static`). After the rewrite no plain ``HorovodAllreduce`` is left, so a
second run changes nothing.
"""
from __future__ import annotations

import hashlib
import json

from tfoverlap.graph.model import dtype_bytes, parse_input
from tfoverlap.log import logger
from tfoverlap.passes.base import PassContext, PassResult
from tfoverlap.planning.caramel import gradient_gates, is_planned_allreduce, plan_for_graph
from tfoverlap.rewriters.allreduce_grouping import (CHECK_LENGTH, GROUP_ATTRS, BucketPieces,
                                                    add_plan_check, free_prefix,
                                                    group_allreduces)
from tfoverlap.rewriters.control_edges import add_ordering_edges

__all__ = ["caramel_pass", "ORDER_ATTR", "plan_digest", "plan_vector"]

ORDER_ATTR = "_tfoverlap_caramel_order"


def _bucket_description(names: list[str], bucket) -> list:
    return [[names[p.gradient], p.offset, p.size] for p in bucket.pieces]


def plan_vector(descriptions: list, settings: dict) -> list[int]:
    """CHECK_LENGTH int32 values that differ between two plans if the plans differ: the
    bucket count, one hash per bucket (the last slot hashes every bucket beyond and the
    settings)."""
    def digest(value) -> int:
        text = json.dumps(value, sort_keys=True).encode()
        return int.from_bytes(hashlib.sha256(text).digest()[:4], "big") & 0x7FFFFFFF

    head = CHECK_LENGTH - 2
    return ([len(descriptions) & 0x7FFFFFFF] + [digest(d) for d in descriptions[:head]]
            + [0] * max(0, head - len(descriptions)) + [digest([descriptions[head:], settings])])


def plan_digest(descriptions: list, settings: dict) -> str:
    return hashlib.sha256(json.dumps([descriptions, settings], sort_keys=True).encode()
                          ).hexdigest()[:16]


ORDER_WHEN_COMM_OVER_BACKWARD = 1.5


def _communication_bound(plan) -> bool:
    """Whether ordering the backward pass can pay: the planned reductions take longer than
    the window in which the gradients appear (by a margin, since static estimates run
    fast). Otherwise the reductions keep up anyway, and a fixed order only risks holding
    back compute whose real timing differs from the estimate."""
    if not plan.buckets:
        return False
    communication = sum(bucket.finish - bucket.start for bucket in plan.buckets)
    window = plan.ready[-1] - plan.ready[0]
    return communication >= ORDER_WHEN_COMM_OVER_BACKWARD * window


def _requests(plan, names: list[str], node_defs: dict):
    """(element counts of the pieces of each split gradient, the Horovod requests): a
    bucket whose members differ in dtype or reduction becomes several requests."""
    piece_elements: dict[str, list[int]] = {}
    piece_index: dict[tuple[int, int], int] = {}
    for gradient, name in enumerate(names):
        offsets = sorted({p.offset for b in plan.buckets for p in b.pieces
                          if p.gradient == gradient})
        for number, offset in enumerate(offsets):
            piece_index[(gradient, offset)] = number
        if len(offsets) > 1:
            itemsize = dtype_bytes(node_defs[name].attr["T"].type)
            bounds = offsets + [plan.sizes[gradient]]
            piece_elements[name] = [(b - a) // itemsize for a, b in zip(bounds, bounds[1:])]
    requests: list[BucketPieces] = []
    for bucket in plan.buckets:
        parts: dict[tuple, list] = {}
        for piece in bucket.pieces:
            node = node_defs[names[piece.gradient]]
            key = tuple(node.attr[a].SerializeToString() if a in node.attr else b""
                        for a in GROUP_ATTRS) + (node.device,)
            parts.setdefault(key, []).append(
                (names[piece.gradient], piece_index[(piece.gradient, piece.offset)]))
        requests.extend(BucketPieces(tuple(members)) for members in parts.values())
    return piece_elements, requests


def _chain_edges(graph_def, requests: list[str], chain: str) -> list[tuple[str, str]]:
    """(before, after) edges that make each request wait for the one before it: for its
    completion ("finished"), or for its inputs ("issued")."""
    if chain == "finished":
        return list(zip(requests, requests[1:]))
    if chain == "none":
        return []
    node_defs = {node.name: node for node in graph_def.node}
    edges = []
    for before, after in zip(requests, requests[1:]):
        inputs = dict.fromkeys(parse_input(text)[0] for text in node_defs[before].input
                               if not text.startswith("^"))
        edges.extend((name, after) for name in inputs)
    return edges


def _gated(graph_def, gates: list[tuple[str, str]], report: dict) -> PassResult:
    """``graph_def`` with only the weight gradients gated (no buckets): what the pass
    returns where it plans nothing or declines."""
    if not gates:
        return PassResult(graph_def, False, report)
    gated, edges = add_ordering_edges(graph_def, gates, marker=ORDER_ATTR)
    return PassResult(gated, edges > 0, {**report, "gated_gradients": edges})


def caramel_pass(graph_def, context: PassContext) -> PassResult:
    options = context.options
    if not any(is_planned_allreduce(node) for node in graph_def.node):
        return PassResult(graph_def, False, {"allreduces": 0})
    # Each layer's weight gradient before its input gradient, as TF1 gates them: whatever
    # the buckets, a tape's step then hands Horovod its gradients as the backward pass
    # makes them (and the plan's ready times hold).
    gates = gradient_gates(graph_def)
    plan, inputs = plan_for_graph(graph_def, options)
    model = plan.model
    left_out = {reason: len(nodes) for reason, nodes in plan.left_out.items()}
    if not plan.nodes:
        return _gated(graph_def, gates, {"allreduces": 0, "allreduces_left_out": left_out,
                                         "allreduces_left_out_names": plan.left_out})
    predicted_gain = (1.0 - plan.predicted_step / plan.baseline_step
                      if plan.baseline_step > 0 else 0.0)
    prediction = {"predicted_gain": round(predicted_gain, 4),
                  "predicted_step_s": round(plan.predicted_step, 6),
                  "predicted_horovod_step_s": round(plan.baseline_step, 6)}
    if predicted_gain < options.min_gain and not options.force:
        # Every rank plans from the same inputs, so every rank declines alike.
        reason = (f"Caramel's buckets would take the step from {plan.baseline_step * 1e3:.3g} "
                  f"ms with Horovod's fusion to {plan.predicted_step * 1e3:.3g} ms "
                  f"({predicted_gain:+.1%}), below min_gain {options.min_gain:.1%}; Horovod's "
                  "own fusion is left as it is (force=True plans anyway)")
        logger.info("tfoverlap: graph %s: %s", context.item_id or "", reason)
        return _gated(graph_def, gates, {"allreduces": len(plan.nodes), **prediction,
                                         "declined": reason, "ranks": inputs.ranks})
    names = [model.names[v] for v in plan.nodes]
    node_defs = {node.name: node for node in graph_def.node}
    piece_elements, requests = _requests(plan, names, node_defs)
    prefix = free_prefix(graph_def)
    rewritten = group_allreduces(graph_def, requests, piece_elements, prefix)
    descriptions = [_bucket_description(names, b) for b in plan.buckets]
    settings = inputs.settings(options)
    digest = plan_digest(descriptions, settings)
    first = descriptions[0][:3] if descriptions else []
    message = (f"tfoverlap: the Horovod ranks planned different Caramel AllReduce buckets "
               f"(this rank: plan {digest}, {len(descriptions)} buckets, the first starting "
               f"with {first}; planned with {inputs.describe(options)}). Every rank must run "
               "the same graph with the same tfoverlap options and host facts (the Horovod "
               "wrappers use rank 0's; with the session flag, set ranks, threads, cycle_ms, "
               "flops and bandwidth explicitly). First differing plan entry "
               f"(0 = bucket count, k = bucket k-1, {CHECK_LENGTH - 1} = the rest):")
    grouped = [node.name for node in rewritten.node
               if node.op == "HorovodGroupedAllreduce" and node.name.startswith(prefix)]
    add_plan_check(rewritten, plan_vector(descriptions, settings), message, grouped,
                   node_defs[names[0]].device, prefix)
    order_backward = _communication_bound(plan)
    producers = [model.names[p] for p in plan.producers] if order_backward else []
    weight_first = ([(model.names[p], model.names[s]) for p, s in plan.weight_first]
                    if order_backward else [])
    # Requests are issued in plan order: each waits for the one before it (see the option
    # bucket_chain). TensorFlow's executor would otherwise hand Horovod two ready buckets
    # in either order.
    rewritten, edges = add_ordering_edges(
        rewritten, list(zip(producers, producers[1:])) + weight_first
        + ([] if order_backward else gates)
        + _chain_edges(rewritten, grouped, options.bucket_chain), marker=ORDER_ATTR)
    return PassResult(rewritten, True, {
        "allreduces": len(names), "buckets": len(plan.buckets), "requests": len(requests),
        "bucket_bytes": [b.size for b in plan.buckets],
        "split_gradients": sorted(piece_elements), "order_edges": edges,
        "order_backward": order_backward, "gradient_order": producers,
        "weight_first": weight_first, "gated_gradients": 0 if order_backward else len(gates),
        "bucket_chain": options.bucket_chain, **prediction,
        "ranks": inputs.ranks, "threads": inputs.threads,
        "ready_times_from": inputs.ready_times_from, "plan_digest": digest,
        "predicted_last_bucket_end_s": round(plan.buckets[-1].finish, 6)
        if plan.buckets else 0.0,
        **({"allreduces_left_out": left_out, "allreduces_left_out_names": plan.left_out}
           if left_out else {})})

