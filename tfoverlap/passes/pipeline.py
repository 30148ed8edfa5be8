"""The pass pipeline: which passes run, in what order, checked after each, fail-open.

A pass is a plain function ``(graph_def, context) -> PassResult``. It never mutates its
input, and running it on its own output changes nothing (``modified=False``). The plugin
and :func:`tfoverlap.optimize` both end in :func:`run_pipeline`.
"""
from __future__ import annotations

from typing import Any, Callable

from tfoverlap.graph.frames import remembering_analyses
from tfoverlap.graph.model import GraphError
from tfoverlap.graph.verify import verify_graph_def
from tfoverlap.log import logger
from tfoverlap.options import Options
from tfoverlap.passes.base import PassContext, PassFailure, PassReport, PassResult, Report
from tfoverlap.passes.caramel import caramel_pass
from tfoverlap.passes.emulate import emulate_pass
from tfoverlap.passes.tictac import tictac_pass

__all__ = ["select_passes", "run_pipeline"]


Pass = Callable[[Any, PassContext], PassResult]


def select_passes(options: Options) -> list[tuple[str, Pass]]:
    """The passes that ``options`` switch on, in the order they run."""
    passes: list[tuple[str, Pass]] = []
    if options.schedule != "none":
        passes.append(("tictac", tictac_pass))
    if options.allreduce == "caramel":
        passes.append(("caramel", caramel_pass))
    if options.emulate:
        passes.append(("emulate", emulate_pass))   # last: the others plan on real ops
    return passes


def run_pipeline(graph_def, context: PassContext):
    """Runs the selected passes; returns (graph_def, Report).

    Every pass output is verified (acyclic, inputs resolve, preserved nodes kept, no node
    moved to another while-loop frame or made to wait on a cond branch). If a
    pass raises or fails verification, one warning names the pass and the reason and the
    *input* graph is returned unchanged — unless ``options.strict``, which raises
    :class:`PassFailure`.
    """
    with remembering_analyses():
        return _run_passes(graph_def, context)


def _run_passes(graph_def, context: PassContext):
    report = Report(item_id=context.item_id, source=context.source,
                    num_nodes=len(graph_def.node))
    current = graph_def
    for name, graph_pass in select_passes(context.options):
        if name in context.skip:
            continue
        try:
            result = graph_pass(current, context)
            if result.modified:
                verify_graph_def(result.graph_def, context.preserved_nodes, before=current)
        except Exception as error:  # noqa: BLE001 - fail-open is the point
            reason = (f"its result is invalid: {error}" if isinstance(error, GraphError)
                      else f"{type(error).__name__}: {error}")
            report.passes.append(PassReport(name, False, {}, error=reason))
            report.reverted = True
            if context.options.strict:
                raise PassFailure(f"tfoverlap pass {name!r} failed: {reason}") from error
            logger.warning("tfoverlap: pass %r failed (%s); the graph %sis left unchanged "
                           "and training continues", name, reason,
                           f"{context.item_id!r} " if context.item_id else "")
            return graph_def, report
        report.passes.append(PassReport(name, result.modified, result.summary))
        current = result.graph_def
    return current, report
