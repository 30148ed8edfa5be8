"""tfoverlap's logger, and warnings said once per process however often a graph is seen
(Grappler runs the passes several times per graph, and once per new graph)."""
from __future__ import annotations

import logging
import threading

__all__ = ["logger", "warn_once"]

logger = logging.getLogger("tfoverlap")
_said: set[str] = set()
_said_lock = threading.Lock()
_MAX_REMEMBERED = 1024


def warn_once(message: str) -> None:
    """Logs ``message`` as a warning the first time it is seen in this process."""
    with _said_lock:
        if message in _said:
            return
        if len(_said) >= _MAX_REMEMBERED:
            _said.clear()
        _said.add(message)
    logger.warning(message)
