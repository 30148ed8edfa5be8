"""The TicTac pass: order parameter-server transfers and enforce the order with control edges.

The plan (:mod:`tfoverlap.planning.tictac`) says which gate each transfer's PS-side source
waits for; the pass strips the edges of an earlier run, adds the plan's, and reports.
"""
from __future__ import annotations

from tfoverlap.log import logger
from tfoverlap.passes.base import PassContext, PassResult
from tfoverlap.planning.tictac import plan_transfer_order
from tfoverlap.rewriters.control_edges import add_ordering_edges, strip_ordering_edges

__all__ = ["tictac_pass"]


def tictac_pass(graph_def, context: PassContext) -> PassResult:
    """Orders PS transfers (TIC or TAC) and enforces the order with control edges."""
    clean, stripped = strip_ordering_edges(graph_def, keep=context.preserved_nodes)
    model, transfers, orders, edges, arrivals, notes = plan_transfer_order(clean,
                                                                          context.options)
    if not transfers:
        logger.info("tfoverlap: graph %s has no transfer from a parameter-server device (%s) "
                    "outside control flow; nothing to order", context.item_id or "",
                    context.options.ps_devices)
        modified = stripped > 0
        return PassResult(clean if modified else graph_def, modified=modified,
                          summary={"transfers": 0, **_counted(notes)})
    used = {gate for gate, _ in edges}
    rewritten, added = add_ordering_edges(clean, edges, [a for a in arrivals if a.name in used])
    summary = {
        "schedule": context.options.schedule,
        "window": context.options.window,
        "gate": context.options.gate,
        "transfers": len(transfers),
        "order": {destination: [model.names[transfers[t].source] for t in order]
                  for destination, order in orders.items()},
        "ordering_edges": added,
        **_counted(notes),
    }
    # Without earlier edges, any addition is a change; with them, unchanged means the same
    # edges and gates were added back (the costly comparison only happens then).
    modified = (added > 0 if not stripped else
                rewritten.SerializeToString(deterministic=True)
                != graph_def.SerializeToString(deterministic=True))
    return PassResult(rewritten if modified else graph_def, modified=modified, summary=summary)


def _counted(notes: dict) -> dict:
    """The plan's notes for the report, with a count per reason a transfer was left out."""
    left_out = notes.get("transfers_left_out")
    if not left_out:
        return notes
    return {**notes, "transfers_left_out": {reason: len(names)
                                            for reason, names in left_out.items()},
            "transfers_left_out_names": left_out}
