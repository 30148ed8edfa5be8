"""The graph-mode adapter: the wrapped optimizer's reduction intercepted, decoupled or
deferred updates planned and built (:mod:`tfoverlap.horovod.session`), and the Caramel pass
run on the graph being built and applied in place."""
from __future__ import annotations

import functools
import logging
import os
import weakref

from tfoverlap.horovod.core.contract import reduce_without_cond
from tfoverlap.horovod.core.decisions import planned
from tfoverlap.horovod.core.plans import plan_decoupling, plan_deferral, variable_ops
from tfoverlap.horovod.measure import EMULATION_OPTIONS, warmup_profile
from tfoverlap.horovod.settings import caramel_options, wrapper_option
from tfoverlap.log import logger

__all__ = ["attach", "schedule_in_place", "defer_and_schedule", "decouple_and_schedule",
           "record_graph_decision"]


def attach(wrapped, optimizer, reduction: dict) -> None:
    """Makes Horovod's graph-mode ``wrapped`` optimizer (around ``optimizer``) reduce with
    plain HorovodAllreduce ops that Caramel plans, decoupled or deferred where possible."""
    from tfoverlap.horovod.session.pending import watch_sessions
    watch_sessions()        # where tfoverlap.horovod came before TensorFlow
    pending: dict = {}      # what apply_gradients builds once the updates exist
    wrapped._allreduce_grads = functools.partial(  # noqa: SLF001 - Horovod's hook
        _reduce_and_schedule, optimizer, reduction, pending)
    wrapped.apply_gradients = functools.partial(
        _apply_and_defer, optimizer, wrapped.apply_gradients, pending)


def _reduce_and_schedule(optimizer, reduction, pending, grads, variables=None,
                         use_generic_names=False):
    """Horovod's reduction as plain ops; where a mechanism is asked for and the program
    allows it, what ``pending`` needs for apply_gradients; else the in-step plan now."""
    import tensorflow as tf

    from tfoverlap.horovod.session.decoupling import decoupling_refused
    from tfoverlap.horovod.session.deferral import deferral_refused, reducing_allreduce
    reduced = reduce_without_cond(grads, reduction)
    if reduction["process_set"].size() < 2:
        return reduced
    allreduces = [reducing_allreduce(r) if isinstance(r, tf.Tensor) else None
                  for r in reduced]
    # The rewrite re-points the consumers of each reduced tensor: these Identities.
    reduced = [tf.identity(r) if isinstance(r, tf.Tensor) else r for r in reduced]
    dense = [r for r in reduced if isinstance(r, tf.Tensor)]
    if not dense:
        return reduced
    gradients = [g for g in grads if isinstance(g, tf.Tensor)]
    decision = None
    for option, default, refusal in (("decouple", False, decoupling_refused),
                                     ("cross_step", "auto", deferral_refused)):
        mode = wrapper_option(option, default)
        if not mode:
            continue
        refused = (refusal(optimizer, variables, reduced, reduction)
                   if variables is not None else "Horovod did not name the variables")
        if not refused:
            pending.update(grads=list(grads), variables=list(variables),
                           reduced=reduced, allreduces=allreduces, gradients=gradients,
                           mode=mode, decouple=option == "decouple", reduction=reduction)
            return reduced
        # Asked for: a warning; on by default: one INFO line.
        logger.log(_decline_level(mode), "tfoverlap: %s: %s; the step is planned without it",
                   option, refused)
        declined = planned(option, mode, refused)
        record_graph_decision(optimizer, declined, option)
        if option == "cross_step":
            decision = declined
    schedule_in_place(dense[0].graph, gradients, cross_step=decision)
    return reduced


def _apply_and_defer(optimizer, original_apply, pending, grads_and_vars, global_step=None,
                     name=None):
    """The wrapped optimizer's apply_gradients, decoupled or deferred where
    :func:`_reduce_and_schedule` left what it needs in ``pending``."""
    if not pending:
        return original_apply(grads_and_vars, global_step=global_step, name=name)
    deferrable = dict(pending)
    pending.clear()

    def apply_in_step(pairs):
        return original_apply(pairs, global_step=global_step, name=name)
    if deferrable.pop("decouple", False):
        return decouple_and_schedule(optimizer, list(grads_and_vars), apply_in_step,
                                     **deferrable)
    deferrable.pop("reduction")
    return defer_and_schedule(optimizer, list(grads_and_vars), apply_in_step, **deferrable)


def schedule_in_place(graph, gradients=(), cross_step: dict | None = None,
                      decouple: dict | None = None) -> None:
    """Runs the Caramel pass on ``graph`` as built so far and applies it in place (with a
    profiled warm-up of ``gradients`` where configured); ``emulate``, which replaces ops,
    is left to every session created afterwards."""
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
    """cross_step: builds the step with the updates the plan picks deferred to the next
    step, where the plan (``mode``) says so, then plans the rest of the step;
    returns the train op. ``decouple``: decoupling's decision where it declined."""
    from tfoverlap.horovod.session.deferral import defer_updates
    graph = grads_and_vars[0][1].graph
    reduced_at, pair_of = _pairing(grads_and_vars, variables, allreduces)
    chunks, decision = plan_deferral(
        graph.as_graph_def(), pair_of, mode,
        variables=variable_ops(graph, pair_of, [v for _, v in grads_and_vars]))
    if chunks:
        train = defer_updates(optimizer, grads_and_vars, _aligned(grads, reduced_at),
                              _aligned(reduced, reduced_at), _aligned(allreduces, reduced_at),
                              chunks, apply_in_step, _decline_level(mode))
        from tfoverlap.horovod.session.deferral import deferral_summary
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
    """Keeps what ``mechanism`` decided for the graph-mode ``optimizer``."""
    from tfoverlap.horovod.core.decisions import record
    record(decision, "graph", key=weakref.ref(optimizer), name=optimizer.get_name(),
           mechanism=mechanism)


def decouple_and_schedule(optimizer, grads_and_vars, apply_in_step, mode, grads, variables,
                          reduced, allreduces, gradients, reduction):
    """decouple: builds the step decoupled where the plan and the program allow it, else
    deferred as configured (:func:`defer_and_schedule`), else in-step; returns the train
    op."""
    from tfoverlap.horovod.session.decoupling import decouple_updates, decoupling_summary
    graph = grads_and_vars[0][1].graph
    reduced_at, pair_of = _pairing(grads_and_vars, variables, allreduces)
    buckets, gathers, decision = plan_decoupling(graph.as_graph_def(), pair_of,
                                                 len(grads_and_vars), mode)
    train = None
    built = buckets and None not in reduced_at
    if built:
        train = decouple_updates(optimizer, grads_and_vars, _aligned(grads, reduced_at),
                                 _aligned(reduced, reduced_at),
                                 _aligned(allreduces, reduced_at), buckets, gathers,
                                 apply_in_step, reduction, _decline_level(mode))
    elif buckets:
        decision["reason"] = "a gradient given to apply_gradients was not reduced"
    if train is None:
        decision["decoupled"] = 0
        decision.setdefault("reason", "outside the contract (see the log line before)")
        # Where decouple_updates refused, it said why (once).
        logger.log(logging.INFO if built else _decline_level(mode),
                   "tfoverlap: decouple: nothing decoupled: %s", decision["reason"])
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


def _pairing(grads_and_vars, variables, allreduces) -> tuple[list, dict]:
    """(reduced_at: pair i is entry reduced_at[i] of what the reduction returned, or None;
    pair_of: each pair's HorovodAllreduce op name -> the pair's index)."""
    reduced_at = [next((j for j, variable in enumerate(variables) if variable is pair[1]),
                       None) for pair in grads_and_vars]
    pair_of = {allreduces[j].name: i for i, j in enumerate(reduced_at)
               if j is not None and allreduces[j] is not None}
    return reduced_at, pair_of


def _aligned(values, indices):
    """``values`` reordered by ``indices`` (None where an index is None)."""
    return [None if index is None else values[index] for index in indices]

