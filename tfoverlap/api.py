"""The public API: switch TfOverlap on for sessions and tf.functions, or run its passes
offline on a GraphDef.

``session_config`` for ``tf.compat.v1.Session`` / ``tf.distribute.Server`` programs,
``rewriter_config_text`` for programs that take a RewriterConfig on their command line,
``tf_function_options`` / ``enable_for_tf_function`` for TF2 ``tf.function`` graphs, and
``optimize`` for the same passes outside any session.
"""
from __future__ import annotations

import contextlib
import functools
import os
import threading
from typing import Iterable

from tfoverlap.integrations.emulated_kernel import load_emulated_ops
from tfoverlap.integrations.grappler import OPTIMIZER_NAME, load
from tfoverlap.integrations.link_probe import install_session_hook
from tfoverlap.integrations.tf_function import (carry_config_to_coordinator, get_function_config,
                                                set_function_config)
from tfoverlap.options import parse_options
from tfoverlap.passes.base import PassContext
from tfoverlap.passes.pipeline import run_pipeline

__all__ = ["merge_config", "optimize", "session_config", "rewriter_config_text",
           "tf_function_options", "enable_for_tf_function", "enable_for_sessions"]


def optimize(graph_def, *, fetch: Iterable[str] = (), feed: Iterable[str] = (),
             keep: Iterable[str] = (), **options):
    """Runs the TfOverlap passes on ``graph_def``; returns ``(new_graph_def, report)``.

    The input is never modified. If nothing applies, the returned graph is the input
    object itself and ``report.modified`` is False; running ``optimize`` on its own output
    changes nothing.

    Raises:
      ValueError: an unknown option or a bad value.
      tfoverlap.PassFailure: a pass failed and ``strict=True``.
    """
    context = PassContext(options=parse_options(options), fetch=tuple(fetch),
                          feed=tuple(feed), keep=tuple(keep), source="offline")
    if context.options.emulate:
        load_emulated_ops()   # its result holds emulated kernels: they must be registered
    return run_pipeline(graph_def, context)


def _set_parameter(attr, value) -> None:
    if isinstance(value, bool):
        attr.b = value
    elif isinstance(value, int):
        attr.i = value
    elif isinstance(value, float):
        attr.f = value
    else:
        attr.s = str(value).encode()


def _add_optimizer(config, options: dict):
    """Returns a copy of ``config`` with TfOverlap (and only one) in its custom optimizers."""
    from tensorflow.core.protobuf import config_pb2
    parsed = parse_options(options)
    new_config = config_pb2.ConfigProto()
    if config is not None:
        new_config.CopyFrom(config)
    rewrite_options = new_config.graph_options.rewrite_options
    kept = [c for c in rewrite_options.custom_optimizers if c.name != OPTIMIZER_NAME]
    del rewrite_options.custom_optimizers[:]
    rewrite_options.custom_optimizers.extend(kept)
    optimizer = rewrite_options.custom_optimizers.add(name=OPTIMIZER_NAME)
    for name, value in options.items():
        # The parsed value is what the plugin will see; profile paths are made absolute
        # so that a server started elsewhere finds them.
        value = getattr(parsed, name)
        if name == "profile" and value:
            value = os.path.abspath(value)
        _set_parameter(optimizer.parameter_map[name], value)
    if parsed.strict:
        rewrite_options.fail_on_optimizer_errors = True
    return new_config


def session_config(config=None, **options):
    """A ``tf.compat.v1.ConfigProto`` with the TfOverlap optimizer switched on.

    Args:
      config: a ConfigProto to start from; it is copied, never modified.
      **options: see :class:`tfoverlap.options.Options`.

    Raises:
      ValueError: an unknown option or a bad value, naming it.

    Example:
      >>> import tfoverlap, tensorflow as tf
      >>> config = tfoverlap.session_config(schedule="tic", window=2)
      >>> with tf.compat.v1.Session(config=config) as session: ...

    A distributed session with this config measures its links to the PS tasks once per
    process before it starts, unless ``bandwidth`` is given
    (:mod:`tfoverlap.integrations.link_probe`).
    """
    load()
    install_session_hook()
    return _add_optimizer(config, options)


def merge_config(config, options: dict):
    """``config`` (None: an empty one) with TfOverlap switched on under ``options``; where
    it names TfOverlap already, its parameters win and ``options`` fill in the rest. A
    copy: ``config`` is never modified."""
    if config is not None:
        for optimizer in config.graph_options.rewrite_options.custom_optimizers:
            if optimizer.name == OPTIMIZER_NAME:
                from tfoverlap.integrations.grappler import options_from_parameters
                given = options_from_parameters(optimizer.parameter_map)
                return _add_optimizer(config, {**options, **given})
    return _add_optimizer(config, options)


_sessions_lock = threading.Lock()
_session_options: dict = {}
_sessions_hooked = False


def enable_for_sessions(**options) -> None:
    """Every TF1 ``Session`` created afterwards in this process gets TfOverlap with
    ``options``, merged into the config the program passes (:func:`merge_config`: where
    that names TfOverlap, its parameters win). For programs that cannot be given a config:
    ``tfoverlap run``, and the Horovod wrappers' emulation in graph mode. A later call
    replaces the options."""
    global _sessions_hooked
    parse_options(options)
    load()
    install_session_hook()
    with _sessions_lock:
        _session_options.clear()
        _session_options.update(options)
        if _sessions_hooked:
            return
        from tensorflow.python.client import session as session_module
        original = session_module.Session.__init__

        @functools.wraps(original)
        def __init__(self, target="", graph=None, config=None):
            with _sessions_lock:
                options = dict(_session_options)
            original(self, target, graph, merge_config(config, options))

        session_module.Session.__init__ = __init__
        _sessions_hooked = True


def rewriter_config_text(**options) -> str:
    """The same as :func:`session_config`, as RewriterConfig text format."""
    from google.protobuf import text_format
    return text_format.MessageToString(
        _add_optimizer(None, options).graph_options.rewrite_options)


def enable_for_tf_function(**options):
    """Turns TfOverlap on for tf.function graphs first called from this thread afterwards,
    and for the functions this thread schedules on a ``ClusterCoordinator``.

    TensorFlow has no public API for a tf.function's Grappler config; this sets the eager
    context's function-call options (per thread). Returns the previous config, which
    :func:`tfoverlap.integrations.tf_function.set_function_config` restores.
    """
    load()
    carry_config_to_coordinator()
    previous = get_function_config()
    set_function_config(_add_optimizer(previous, options))
    return previous


@contextlib.contextmanager
def tf_function_options(**options):
    """Context manager form of :func:`enable_for_tf_function`.

    Example:
      >>> with tfoverlap.tf_function_options(schedule="tic"):
      ...     step(x)  # the first call of a concrete function is optimized by TfOverlap
    """
    previous = enable_for_tf_function(**options)
    try:
        yield
    finally:
        set_function_config(previous)
