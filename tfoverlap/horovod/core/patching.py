"""The one way the Horovod wrappers replace a function of TensorFlow, Keras or Horovod:
:func:`patch`, idempotent (one marker), so an install that runs twice never wraps a wrapper."""
from __future__ import annotations

__all__ = ["patch", "unpatched", "MARKER"]

#: the attribute a replacement keeps the replaced function under
MARKER = "__tfoverlap_replaces__"


def patch(owner, name: str, make) -> None:
    """Puts ``make(current)`` in place of ``owner.name`` (a class, module or object), unless
    tfoverlap's replacement is there already."""
    current = getattr(owner, name)
    if hasattr(current, MARKER):
        return
    replacement = make(current)
    setattr(replacement, MARKER, current)
    setattr(owner, name, replacement)


def unpatched(function):
    """What ``function`` replaced, where it is one of tfoverlap's replacements."""
    while hasattr(function, MARKER):
        function = getattr(function, MARKER)
    return function
