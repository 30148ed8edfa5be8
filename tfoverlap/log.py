"""tfoverlap's logger, and messages said once per process however often a graph is seen
(Grappler runs the passes several times per graph, and once per new graph)."""
from __future__ import annotations

import logging
import threading

__all__ = ["logger", "warn_once", "info_once", "forget_said"]

logger = logging.getLogger("tfoverlap")
_said: set[str] = set()
_said_lock = threading.Lock()
_MAX_REMEMBERED = 1024


def _first_time(message: str) -> bool:
    """Whether ``message`` is new to this process (it is remembered from now on)."""
    with _said_lock:
        if message in _said:
            return False
        if len(_said) >= _MAX_REMEMBERED:
            _said.clear()
        _said.add(message)
    return True


def warn_once(message: str) -> None:
    """Logs ``message`` as a warning the first time it is seen in this process."""
    if _first_time(message):
        logger.warning(message)


def info_once(message: str) -> None:
    """Logs ``message`` at INFO level the first time it is seen in this process."""
    if _first_time(message):
        logger.info(message)


def forget_said() -> None:
    """Forgets every message said so far, so that each is said again when next seen (a
    process that runs programs in turn, each expecting its own warnings)."""
    with _said_lock:
        _said.clear()
