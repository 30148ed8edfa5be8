"""The pass pipeline: which passes run, in what order, checked after each, fail-open.

A pass is a plain function ``(graph_def, context) -> PassResult``. It never mutates its
input, and running it on its own output changes nothing (``modified=False``). The plugin
and :func:`tfoverlap.optimize` both end in :func:`run_pipeline`.
"""
from __future__ import annotations

import dataclasses
import logging
from typing import Any, Callable

from tfoverlap.graph_model import GraphError, parse_input, verify_graph_def
from tfoverlap.options import Options

__all__ = ["PassContext", "PassResult", "PassReport", "Report", "PassFailure",
           "select_passes", "run_pipeline"]

logger = logging.getLogger("tfoverlap")


@dataclasses.dataclass(frozen=True)
class PassContext:
    """What a pass may know besides the graph.

    fetch/feed/keep are node or tensor names that Grappler says must survive; ``source``
    says who called ("grappler" or "offline").
    """

    options: Options = Options()
    fetch: tuple[str, ...] = ()
    feed: tuple[str, ...] = ()
    keep: tuple[str, ...] = ()
    item_id: str = ""
    source: str = "offline"

    @property
    def preserved_nodes(self) -> tuple[str, ...]:
        return tuple(dict.fromkeys(parse_input(name)[0]
                                   for name in self.fetch + self.feed + self.keep))


@dataclasses.dataclass
class PassResult:
    graph_def: Any
    modified: bool
    summary: dict = dataclasses.field(default_factory=dict)


@dataclasses.dataclass
class PassReport:
    name: str
    modified: bool
    summary: dict
    error: str = ""


@dataclasses.dataclass
class Report:
    """What one pipeline run did, pass by pass; JSON-friendly through :meth:`to_dict`."""

    item_id: str
    source: str
    num_nodes: int
    passes: list[PassReport] = dataclasses.field(default_factory=list)
    reverted: bool = False

    @property
    def modified(self) -> bool:
        return not self.reverted and any(p.modified for p in self.passes)

    def to_dict(self) -> dict:
        return {"item_id": self.item_id, "source": self.source, "num_nodes": self.num_nodes,
                "modified": self.modified, "reverted": self.reverted,
                "passes": [dataclasses.asdict(p) for p in self.passes]}

    def __str__(self) -> str:
        lines = [f"tfoverlap on {self.item_id or 'graph'} ({self.num_nodes} nodes, "
                 f"{self.source}): {'rewritten' if self.modified else 'unchanged'}"
                 + (" (reverted after a failure)" if self.reverted else "")]
        for report in self.passes:
            state = "failed: " + report.error if report.error else (
                "modified" if report.modified else "no change")
            lines.append(f"  pass {report.name}: {state}")
            for key, value in report.summary.items():
                lines.append(f"    {key}: {_shorten(value)}")
        return "\n".join(lines)


def _shorten(value, limit: int = 6):
    """Long lists in a human-readable report: the first few and a count."""
    if isinstance(value, dict):
        return "{" + ", ".join(f"{k}: {_shorten(v, limit)}" for k, v in value.items()) + "}"
    if isinstance(value, list) and len(value) > limit:
        return "[" + ", ".join(map(str, value[:limit])) + f", ... ({len(value)} in all)]"
    return value


class PassFailure(RuntimeError):
    """A pass raised or produced an invalid graph, and strict mode was on."""


Pass = Callable[[Any, PassContext], PassResult]


def select_passes(options: Options) -> list[tuple[str, Pass]]:
    """The passes that ``options`` switch on, in the order they run."""
    passes: list[tuple[str, Pass]] = []
    if options.schedule != "none":
        from tfoverlap.tictac_pass import tictac_pass
        passes.append(("tictac", tictac_pass))
    if options.allreduce == "caramel":
        from tfoverlap.caramel_pass import caramel_pass
        passes.append(("caramel", caramel_pass))
    return passes


def run_pipeline(graph_def, context: PassContext):
    """Runs the selected passes; returns (graph_def, Report).

    Every pass output is verified (acyclic, inputs resolve, preserved nodes kept). If a
    pass raises or fails verification, one warning names the pass and the reason and the
    *input* graph is returned unchanged — unless ``options.strict``, which raises
    :class:`PassFailure`.
    """
    report = Report(item_id=context.item_id, source=context.source,
                    num_nodes=len(graph_def.node))
    current = graph_def
    for name, graph_pass in select_passes(context.options):
        try:
            result = graph_pass(current, context)
            if result.modified:
                verify_graph_def(result.graph_def, context.preserved_nodes)
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
