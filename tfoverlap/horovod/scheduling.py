"""The plan glue of the graph-mode wrapper: the Caramel pass run on the graph being built
and applied in place, and cross-step overlap's decision (what to defer, the predicted
step, why nothing was) before the deferral is built (:mod:`tfoverlap.horovod.deferred`)."""
from __future__ import annotations

import logging
import os
import weakref

from tfoverlap.horovod.measure import EMULATION_OPTIONS, warmup_profile
from tfoverlap.horovod.settings import caramel_options, decoupled_network, wrapper_option
from tfoverlap.log import logger

__all__ = ["schedule_in_place", "defer_and_schedule", "plan_deferral",
           "decouple_and_schedule", "plan_decoupling", "record_graph_decision"]


def schedule_in_place(graph, gradients=(), cross_step: dict | None = None,
                      decouple: dict | None = None) -> None:
    """Runs the Caramel pass on ``graph`` as built so far and applies it in place.

    With ``profile_steps`` configured it plans with the op times of a profiled warm-up of
    ``gradients``. With ``emulate`` configured Caramel plans with the emulated op times,
    and the emulation itself, which replaces ops (a graph being built cannot have ops
    replaced), is left to the sessions: every session created afterwards runs the emulate
    pass."""
    from tfoverlap.api import enable_for_sessions
    from tfoverlap.integrations.live_graph import apply_rewrite
    from tfoverlap.options import parse_options
    from tfoverlap.passes.base import REPORTS, PassContext
    from tfoverlap.passes.pipeline import run_pipeline
    options = caramel_options()
    steps = wrapper_option("profile_steps", 0)
    profiled = warmup_profile(graph, gradients, steps, options) if steps and gradients else ""
    if profiled:
        options["profile"] = profiled
    before = graph.as_graph_def()
    context = PassContext(options=parse_options(options), skip=("emulate",))
    try:
        after, report = run_pipeline(before, context)
    finally:
        if profiled:
            os.remove(profiled)
    if options.get("emulate"):
        enable_for_sessions(schedule="none", **{name: options[name]
                                                for name in EMULATION_OPTIONS if name in options})
    if report.modified:
        apply_rewrite(graph, before, after)
    for key, decision in (("cross_step", cross_step), ("decouple", decouple)):
        if decision is None:
            continue
        for result in report.passes:
            if result.name == "caramel":
                result.summary[key] = decision
    REPORTS.append(report)
    logger.info("%s", report)


def defer_and_schedule(optimizer, grads_and_vars, apply_in_step, mode, grads, variables,
                        reduced, allreduces, gradients, decouple: dict | None = None):
    """cross_step: builds the step with the updates of the gradients that become ready
    last deferred to the next step (:mod:`tfoverlap.horovod.deferred`), then plans the
    rest of the step; returns the train op. ``mode`` "auto" defers where the predicted
    step gains at least min_gain over the in-step plan's; True wherever a reduction fits
    under the forward pass. ``decouple``: decoupling's decision, where it decoupled
    nothing (for the report)."""
    from tfoverlap.horovod.deferred import defer_updates
    graph = grads_and_vars[0][1].graph
    # Pair i of grads_and_vars is entry reduced_at[i] of what the reduction returned.
    reduced_at = [next((j for j, variable in enumerate(variables) if variable is pair[1]),
                       None) for pair in grads_and_vars]
    pair_of = {allreduces[j].name: i for i, j in enumerate(reduced_at)
               if j is not None and allreduces[j] is not None}
    chunks, decision = plan_deferral(graph.as_graph_def(), pair_of, mode)
    if chunks:
        train = defer_updates(optimizer, grads_and_vars, _aligned(grads, reduced_at),
                              _aligned(reduced, reduced_at), _aligned(allreduces, reduced_at),
                              chunks, apply_in_step,
                              logging.WARNING if mode is True else logging.INFO)
        from tfoverlap.horovod.deferred import deferral_summary
        decision["deferred"] = deferral_summary(graph).get("deferred", 0)
        if not decision["deferred"]:
            decision["reason"] = "outside the contract (see the log line before)"
    else:
        logger.log(_decline_level(mode), "tfoverlap: cross_step: nothing deferred: %s",
                   decision.get("reason"))
        train = apply_in_step(grads_and_vars)
    record_graph_decision(optimizer, decision, "cross_step")
    schedule_in_place(graph, gradients, cross_step=decision, decouple=decouple)
    return train


def _decline_level(mode) -> int:
    """A mechanism asked for (True) that declines says so in a warning; "auto" in a line."""
    return logging.WARNING if mode is True else logging.INFO


def record_graph_decision(optimizer, decision: dict, mechanism: str) -> None:
    """Keeps what ``mechanism`` decided for the graph-mode ``optimizer``
    (:func:`tfoverlap.horovod.decisions`)."""
    from tfoverlap.horovod.decisions import record
    record(decision, "graph", key=weakref.ref(optimizer), name=optimizer.get_name(),
           mechanism=mechanism)


def plan_deferral(graph_def, own: dict, mode,
                  drain_every: int = 0) -> tuple[list[list[int]], dict]:
    """Which of an optimizer's reductions to defer to the next step, in chunks, and the
    decision as the Caramel report gives it. ``own`` maps the names of this optimizer's
    HorovodAllreduce nodes in ``graph_def`` (which may hold other optimizers' too) to the
    indices the chunks are made of. ``mode`` "auto" defers where the predicted step gains
    at least min_gain over the in-step plan's; True wherever a reduction fits under the
    forward pass. ``drain_every`` N: what is deferred is reduced exposed once every N
    steps (Keras' drain after each call of N steps), which the prediction charges to each
    step. Never raises: without a plan nothing is deferred, with a warning."""
    from tfoverlap.costs.network import ring_allreduce_seconds
    from tfoverlap.options import link_bandwidth, parse_options
    from tfoverlap.planning.caramel import deferred_chunks, deferred_step, plan_for_graph
    decision = {"mode": "auto" if mode == "auto" else "on", "deferred": 0}
    chunks = []
    try:
        options = parse_options(caramel_options())
        plan, inputs = plan_for_graph(graph_def, options)
        latency = inputs.request_latency(options)
        rings = [float(ring_allreduce_seconds(size, inputs.ranks, link_bandwidth(options),
                                              0.0)) for size in plan.sizes]
        request = float(ring_allreduce_seconds(0, inputs.ranks, 1.0, latency))
        positions = [[p for p in chunk if plan.model.names[plan.nodes[p]] in own]
                     for chunk in deferred_chunks(plan, rings, request_seconds=request)]
        positions = [chunk for chunk in positions if chunk]
        in_step = min(plan.predicted_step, plan.baseline_step)
        predicted = deferred_step(plan, rings, positions, request)
        if drain_every and positions:
            drain = sum(rings[p] for chunk in positions for p in chunk) \
                + len(positions) * request
            predicted += drain / drain_every
            decision["drain_predicted_ms"] = round(drain * 1e3, 3)
        gain = 1.0 - predicted / in_step if in_step > 0 else 0.0
        decision.update(in_step_ms=round(in_step * 1e3, 3),
                        predicted_step_ms=round(predicted * 1e3, 3),
                        predicted_gain=round(gain, 4))
        chunks = [[own[plan.model.names[plan.nodes[p]]] for p in chunk]
                  for chunk in positions]
        if not chunks:
            decision["reason"] = ("no reduction of the plan's tail fits under the forward "
                                  "pass")
        elif mode == "auto" and gain < options.min_gain:
            decision["reason"] = (f"deferring would take the step from {in_step * 1e3:.3g} "
                                  f"to {predicted * 1e3:.3g} ms ({gain:+.1%}), below "
                                  f"min_gain {options.min_gain:.1%}")
            chunks = []
    except Exception as error:  # noqa: BLE001 - nothing is changed yet: train as planned
        logger.warning("tfoverlap: cross_step: no plan to defer with (%s: %s); nothing "
                       "deferred", type(error).__name__, error)
        decision["reason"] = f"no plan ({type(error).__name__}: {error})"
    return chunks, decision


def decouple_and_schedule(optimizer, grads_and_vars, apply_in_step, mode, grads, variables,
                          reduced, allreduces, gradients, reduction):
    """decouple: builds the step with the gradients reduce-scattered, each rank's shard
    updated and the parameters all-gathered under the next forward pass
    (:mod:`tfoverlap.horovod.decoupled`), where the plan and the program allow it; else
    cross-step overlap as configured (:func:`defer_and_schedule`), else the in-step
    plan. Returns the train op."""
    from tfoverlap.horovod.decoupled import decouple_updates, decoupling_summary
    graph = grads_and_vars[0][1].graph
    reduced_at = [next((j for j, variable in enumerate(variables) if variable is pair[1]),
                       None) for pair in grads_and_vars]
    pair_of = {allreduces[j].name: i for i, j in enumerate(reduced_at)
               if j is not None and allreduces[j] is not None}
    buckets, gathers, decision = plan_decoupling(graph.as_graph_def(), pair_of,
                                                 len(grads_and_vars), mode)
    train = None
    if buckets and None not in reduced_at:
        train = decouple_updates(optimizer, grads_and_vars, _aligned(grads, reduced_at),
                                 _aligned(reduced, reduced_at),
                                 _aligned(allreduces, reduced_at), buckets, gathers,
                                 apply_in_step, reduction,
                                 logging.WARNING if mode is True else logging.INFO)
    elif buckets:
        decision["reason"] = "a gradient given to apply_gradients was not reduced"
    if train is None:
        decision["decoupled"] = 0
        decision.setdefault("reason", "outside the contract (see the log line before)")
        logger.log(_decline_level(mode), "tfoverlap: decouple: nothing decoupled: %s",
                   decision["reason"])
        record_graph_decision(optimizer, decision, "decouple")
        cross_step = wrapper_option("cross_step", "auto")
        if cross_step:
            return defer_and_schedule(optimizer, grads_and_vars, apply_in_step, cross_step,
                                      grads, variables, reduced, allreduces, gradients,
                                      decouple=decision)
        train = apply_in_step(grads_and_vars)
    else:
        decision["decoupled"] = decoupling_summary(graph).get("decoupled", 0)
    record_graph_decision(optimizer, decision, "decouple")
    schedule_in_place(graph, [] if decision["decoupled"] else gradients,
                      decouple=decision)
    return train


def plan_decoupling(graph_def, own: dict, count: int,
                    mode) -> tuple[list[list[int]], list[list[int]], dict]:
    """(buckets of an optimizer's ``count`` gradients in reduce-scatter order, the
    all-gather requests as lists of bucket indices, the decision as the Caramel report
    gives it). ``own`` maps the names of this optimizer's HorovodAllreduce nodes in
    ``graph_def`` to gradient indices; gradients the plan does not cover form a last
    bucket, gathered first. ``mode`` "auto" decouples where the predicted step gains at
    least min_gain over the best of Horovod's, the in-step plan's and cross-step
    overlap's. Never raises: without a plan nothing is decoupled, with a warning."""
    from tfoverlap.options import parse_options
    from tfoverlap.planning.decoupled import plan_decoupled_for_graph
    decision = {"mode": "auto" if mode == "auto" else "on", "decoupled": 0}
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


def _aligned(values, indices):
    """``values`` reordered by ``indices`` (None where an index is None)."""
    return [None if index is None else values[index] for index in indices]

