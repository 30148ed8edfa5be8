"""The TicTac pass: order parameter-server transfers and enforce the order with control edges.

The plan (:mod:`tfoverlap.planning.tictac`) says which gate each transfer's PS-side source
waits for; the pass strips the edges of an earlier run, adds the plan's, and reports.
Where ordering cannot gain ``min_gain`` of a step (the computation hides the transfers, the
transfers dwarf it, or the workers share their PS links better without it), even with its
figures off by DECISION_MARGIN, the pass leaves the graph as it is and says why, unless
``force``; a process decides once per graph and keeps to it.
"""
from __future__ import annotations

from tfoverlap.log import info_once, logger, warn_once
from tfoverlap.passes.base import PassContext, PassResult
from tfoverlap.planning.tictac import estimate_gain, plan_transfer_order
from tfoverlap.rewriters.control_edges import add_ordering_edges, strip_ordering_edges

__all__ = ["tictac_pass"]


def tictac_pass(graph_def, context: PassContext) -> PassResult:
    """Orders PS transfers (TIC or TAC) and enforces the order with control edges."""
    options = context.options
    clean, stripped = strip_ordering_edges(graph_def, keep=context.preserved_nodes)
    plan = plan_transfer_order(clean, options)
    if not plan.transfers:
        # A job that asked for Caramel alone is a Horovod job: TicTac runs there only
        # because it is the default schedule, and no PS is expected.
        if options.allreduce == "none" or "schedule" in options.given:
            info_once(f"tfoverlap: a graph has no transfer from a parameter-server device "
                      f"({options.ps_devices}) outside control flow; nothing to order "
                      "(said once per process)")
        return _unchanged(graph_def, clean, stripped,
                          {"transfers": 0, **_counted(plan.notes)})
    bandwidth, round_trip, link_source = plan.link
    summary = {"schedule": options.schedule, "transfers": len(plan.transfers),
               "link": f"{bandwidth * 8 / 1e9:.3g} Gbit/s, round trip "
                       f"{round_trip * 1e3:.3g} ms ({link_source})"}
    estimate = _estimate(clean, plan, options)
    if estimate is not None:
        summary.update(predicted_gain=round(estimate.gain, 4),
                       predicted_gain_low=round(estimate.low_gain, 4),
                       comm_ms=round(estimate.comm_seconds * 1e3, 3),
                       comp_ms=round(estimate.comp_seconds * 1e3, 3),
                       default_ms=round(estimate.steps.default * 1e3, 3),
                       ordered_ms=round(estimate.steps.ordered * 1e3, 3),
                       workers_drift=estimate.steps.saturated)
        decision = _decide(plan, options, estimate)
        summary["decided_by"] = decision
        if decision.startswith("declined"):
            reason = decision.removeprefix("declined: ")
            logger.info("tfoverlap: graph %s: %s", context.item_id or "", reason)
            return _unchanged(graph_def, clean, stripped,
                              {**summary, "declined": reason, **_counted(plan.notes)})
    used = {gate for gate, _ in plan.edges}
    rewritten, added = add_ordering_edges(clean, plan.edges,
                                          [a for a in plan.arrivals if a.name in used])
    model = plan.model
    summary.update({
        "window": options.window,
        "gate": options.gate,
        "credit_bytes": {d: int(c) for d, c in plan.credit.items()},
        "release_groups": {d: [len(group) for group in groups]
                           for d, groups in plan.groups.items()},
        "order": {destination: [model.names[plan.transfers[t].source] for t in order]
                  for destination, order in plan.orders.items()},
        "ordering_edges": added,
        "gates": len(used),
        **_counted(plan.notes),
    })
    # Without earlier edges, any addition is a change; with them, unchanged means the same
    # edges and gates were added back (the costly comparison only happens then).
    modified = (added > 0 if not stripped else
                rewritten.SerializeToString(deterministic=True)
                != graph_def.SerializeToString(deterministic=True))
    return PassResult(rewritten if modified else graph_def, modified=modified, summary=summary)


#: a graph's shape and options -> the decision this process made for it: Grappler runs the
#: pass several times per graph and a program may build it again, and each time the same
#: graph must be ordered, or not, alike.
_decisions: dict[tuple, str] = {}
_MOST_DECISIONS = 1024


def _decide(plan, options, estimate) -> str:
    """"ordered: ..." or "declined: ..." with the figures that decided it, the first
    decision of this process for a graph of this shape under these options."""
    devices = plan.model.colocated_devices()
    transfers = tuple(sorted((devices[t.source], t.destination, round(size))
                             for t, size in zip(plan.transfers, plan.sizes)))
    # A training and an inference graph of the same variables move the same pulls; only
    # the training one pushes, and the decision may differ.
    shape = (options, plan.link, estimate.workers, transfers, estimate.steps.push_seconds > 0)
    if shape not in _decisions:
        if len(_decisions) >= _MOST_DECISIONS:
            _decisions.clear()
        verdict = "ordered" if estimate.low_gain >= options.min_gain else "declined"
        relation = "at least" if verdict == "ordered" else "below"
        _decisions[shape] = (
            f"{verdict}: {estimate.describe()}; {relation} min_gain {options.min_gain:.1%}"
            + ("" if verdict == "ordered" else
               "; left unchanged (force=True orders anyway)"))
    return _decisions[shape]


def _estimate(graph_def, plan, options):
    """The gain estimate, or None (with one warning) where it cannot be made: the pass
    then orders, as it would with ``force``."""
    if options.force:
        return None
    try:
        return estimate_gain(graph_def, plan, options)
    except Exception as error:  # noqa: BLE001 - an estimate must never stop the pass
        warn_once(f"tfoverlap: cannot estimate what ordering gains ({type(error).__name__}: "
                  f"{error}); ordering anyway")
        return None


def _unchanged(graph_def, clean, stripped: int, summary: dict) -> PassResult:
    """The graph without tfoverlap's edges: the input itself unless an earlier run left
    edges, which then go."""
    modified = stripped > 0
    return PassResult(clean if modified else graph_def, modified=modified, summary=summary)


def _counted(notes: dict) -> dict:
    """The plan's notes for the report, with a count per reason a transfer was left out."""
    left_out = notes.get("transfers_left_out")
    if not left_out:
        return notes
    return {**notes, "transfers_left_out": {reason: len(names)
                                            for reason, names in left_out.items()},
            "transfers_left_out_names": left_out}
