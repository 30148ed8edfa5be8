"""What every pass shares: its context, its result, the report of a pipeline run, and the
bounded log of recent reports that ``tfoverlap.recent_reports()`` shows."""
from __future__ import annotations

import collections
import dataclasses
import threading
from typing import Any

from tfoverlap.graph.model import parse_input
from tfoverlap.options import Options

__all__ = ["PassContext", "PassResult", "PassReport", "Report", "PassFailure", "ReportLog",
           "recent_reports", "report_count", "REPORTS"]


@dataclasses.dataclass(frozen=True)
class PassContext:
    """What a pass may know besides the graph.

    fetch/feed/keep are node or tensor names that Grappler says must survive; ``source``
    says who called ("grappler" or "offline"); passes named in ``skip`` do not run (a
    caller that applies one pass's rewrite itself and leaves another to the session).
    """

    options: Options = Options()
    fetch: tuple[str, ...] = ()
    feed: tuple[str, ...] = ()
    keep: tuple[str, ...] = ()
    item_id: str = ""
    source: str = "offline"
    skip: tuple[str, ...] = ()

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


class ReportLog:
    """The latest reports of this process, oldest first; bounded and thread-safe (Grappler
    calls the plugin from TensorFlow's threads, a long job produces reports forever)."""

    def __init__(self, capacity: int = 256):
        self._reports: collections.deque = collections.deque(maxlen=capacity)
        self._lock = threading.Lock()
        self.count = 0          # reports ever appended

    def append(self, report: Report) -> None:
        with self._lock:
            self._reports.append(report)
            self.count += 1

    def snapshot(self, since: int = 0) -> list[Report]:
        """The reports held, or those appended after the first ``since`` (a ``count``)."""
        with self._lock:
            held = list(self._reports)
            return held[max(0, len(held) - (self.count - since)):]


REPORTS = ReportLog()


def recent_reports(since: int | None = None) -> list[Report]:
    """Reports of the latest pipeline runs in this process (the Grappler plugin's and the
    Horovod wrappers'), oldest first; with ``since`` (a :func:`report_count`), only those
    logged after it (an index into this list is not a mark: old reports are dropped)."""
    return REPORTS.snapshot(since or 0)


def report_count() -> int:
    """How many reports this process has logged: a mark for :func:`recent_reports`."""
    return REPORTS.count
