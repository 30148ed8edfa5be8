"""The offline entry: the same passes as the plugin, on a GraphDef outside any session."""
from __future__ import annotations

from typing import Iterable

from tfoverlap.options import parse_options
from tfoverlap.passes import PassContext, run_pipeline

__all__ = ["optimize"]


def optimize(graph_def, *, fetch: Iterable[str] = (), feed: Iterable[str] = (),
             keep: Iterable[str] = (), **options):
    """Runs the TfOverlap passes on ``graph_def``; returns ``(new_graph_def, report)``.

    The input is never modified. If nothing applies, the returned graph is the input
    object itself and ``report.modified`` is False; running ``optimize`` on its own output
    changes nothing.

    Raises:
      ValueError: an unknown option or a bad value.
      tfoverlap.passes.PassFailure: a pass failed and ``strict=True``.
    """
    context = PassContext(options=parse_options(options), fetch=tuple(fetch),
                          feed=tuple(feed), keep=tuple(keep), source="offline")
    return run_pipeline(graph_def, context)

