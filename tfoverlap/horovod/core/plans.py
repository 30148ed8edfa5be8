"""The plans of both mechanisms for one wrapped optimizer or step, from its GraphDef, each
with its decision dict: what cross-step overlap defers, and decoupled reduction's buckets
and all-gather requests."""
from __future__ import annotations

from tfoverlap.horovod.core.decisions import planned
from tfoverlap.horovod.settings import caramel_options, decoupled_network
from tfoverlap.log import logger

__all__ = ["plan_deferral", "plan_decoupling", "variable_ops"]


def variable_ops(graph, own: dict, variables) -> dict:
    """AllReduce name -> the op in ``graph`` that holds the variable its gradient updates
    (``own``: AllReduce name -> index into ``variables``), for the plan to see what the
    next forward pass reads before the updates are built: a graph's variable handle, or in
    a function (and a loop body inside it) the placeholder that captures it, directly or
    through an outer function's. Variables not found are left out."""
    chain = []
    current = graph
    while current is not None and hasattr(current, "captures"):
        chain.append(current)
        current = getattr(current, "outer_graph", None)
    found = {}
    for name, index in own.items():
        try:
            tensor = variables[index].handle
        except (AttributeError, NotImplementedError):      # a reference variable
            continue
        known = [tensor]
        for level in reversed(chain):        # the outermost function first
            inner = next((inner for outer, inner in level.captures
                          if any(outer is seen for seen in known)), None)
            if inner is not None:
                known.append(inner)
        if getattr(known[-1], "graph", None) is graph:
            found[name] = known[-1].op.name
    return found


def plan_deferral(graph_def, own: dict, mode, drain_every: int = 0,
                  variables: dict | None = None) -> tuple[list[list[int]], dict]:
    """(chunks of the reductions to defer to the next step, the decision). ``own``: this
    optimizer's HorovodAllreduce nodes in ``graph_def`` -> the indices chunks hold. ``mode``
    "auto" defers where the step gains min_gain over the in-step plan; True wherever a
    reduction fits under the next forward pass. ``drain_every`` N: the deferred reductions
    are exposed once every N steps (Keras' drain), charged to each step. ``variables``:
    AllReduce name -> the op of its variable (:func:`variable_ops`), for graphs whose
    updates are not built yet. The plan compares deferring the gradients ready last with
    deferring those the next forward pass needs last
    (:func:`tfoverlap.planning.caramel.plan_cross_step`). Without a plan, nothing is
    deferred, with a warning."""
    from tfoverlap.options import parse_options
    from tfoverlap.planning.caramel import plan_cross_step_for_graph
    decision = planned("cross_step", mode)
    chunks = []
    try:
        options = parse_options(caramel_options())
        plan, cross = plan_cross_step_for_graph(graph_def, options, set(own), drain_every,
                                                variables)
        in_step, predicted = cross.in_step, cross.predicted_step
        gain = 1.0 - predicted / in_step if in_step > 0 else 0.0
        decision.update(in_step_ms=round(in_step * 1e3, 3),
                        predicted_step_ms=round(predicted * 1e3, 3),
                        predicted_gain=round(gain, 4), order=cross.order,
                        candidates_ms={order: round(step * 1e3, 3)
                                       for order, step in cross.candidates.items()})
        chunks = [[own[plan.model.names[plan.nodes[p]]] for p in chunk]
                  for chunk in cross.chunks]
        decision["chunks"] = [len(chunk) for chunk in chunks]
        if drain_every and chunks:
            decision["drain_predicted_ms"] = round(cross.drain * 1e3, 3)
        if not chunks:
            decision["reason"] = "no reduction fits under the next forward pass"
        elif mode == "auto" and gain < options.min_gain:
            decision["reason"] = (f"deferring would take the step from {in_step * 1e3:.3g} "
                                  f"to {predicted * 1e3:.3g} ms ({gain:+.1%}), below "
                                  f"min_gain {options.min_gain:.1%}")
            chunks, decision["chunks"] = [], []
    except Exception as error:  # noqa: BLE001 - nothing is changed yet: train as planned
        logger.warning("tfoverlap: cross_step: no plan to defer with (%s: %s); nothing "
                       "deferred", type(error).__name__, error)
        decision["reason"] = f"no plan ({type(error).__name__}: {error})"
    return chunks, decision


def plan_decoupling(graph_def, own: dict, count: int,
                    mode) -> tuple[list[list[int]], list[list[int]], dict]:
    """(buckets of the ``count`` gradients in reduce-scatter order, all-gather requests as
    bucket indices, the decision); ``own`` as :func:`plan_deferral`'s. Gradients the plan
    does not cover form a last bucket, gathered first. ``mode`` "auto" decouples where the
    step gains min_gain over the best of the others. Without a plan, nothing is decoupled,
    with a warning."""
    from tfoverlap.options import parse_options
    from tfoverlap.planning.decoupled import plan_decoupled_for_graph
    decision = planned("decouple", mode)
    try:
        options = parse_options(caramel_options())
        halves = decoupled_network() or {}
        plan, _ = plan_decoupled_for_graph(graph_def, options, halves.get("scatter"),
                                           halves.get("gather"))
    except Exception as error:  # noqa: BLE001 - nothing is changed yet: train as planned
        logger.warning("tfoverlap: decouple: no plan (%s: %s); nothing decoupled",
                       type(error).__name__, error)
        decision["reason"] = f"no plan ({type(error).__name__}: {error})"
        return [], [], decision
    names = plan.plan.model.names
    buckets, kept = [], []
    for number, bucket in enumerate(plan.buckets):
        members = [own[names[plan.plan.nodes[piece.gradient]]] for piece in bucket.pieces
                   if names[plan.plan.nodes[piece.gradient]] in own]
        if members:
            buckets.append(members)
            kept.append(number)
    position = {number: index for index, number in enumerate(kept)}
    gathers = [[position[b] for b in chunk if b in position] for chunk in plan.gather_chunks]
    gathers = [chunk for chunk in gathers if chunk]
    covered = {i for bucket in buckets for i in bucket}
    missing = [i for i in range(count) if i not in covered]
    if missing:
        buckets.append(missing)
        gathers = [[len(buckets) - 1] + (gathers[0] if gathers else [])] + gathers[1:]
    decision.update(scatter=list(plan.scatter), gather=list(plan.gather),
                    predicted_step_ms=round(plan.predicted_step * 1e3, 3),
                    horovod_step_ms=round(plan.horovod_step * 1e3, 3),
                    in_step_ms=round(plan.caramel_step * 1e3, 3),
                    cross_step_ms=round(plan.cross_step_step * 1e3, 3),
                    predicted_gain=round(plan.predicted_gain, 4))
    if mode == "auto" and plan.predicted_gain < options.min_gain:
        decision["reason"] = (f"decoupling would take the step to "
                              f"{plan.predicted_step * 1e3:.3g} ms "
                              f"({plan.predicted_gain:+.1%} over the best of the others), "
                              f"below min_gain {options.min_gain:.1%}")
        return [], [], decision
    return buckets, gathers, decision
