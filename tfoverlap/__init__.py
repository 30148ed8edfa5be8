"""tfoverlap: overlap communication with computation in data-parallel TensorFlow training.

Switch the TfOverlap Grappler optimizer on with :func:`session_config` (TF1 sessions,
distributed servers), :func:`tf_function_options` (TF2 tf.function), or run the same passes
offline with :func:`optimize`. Importing the package imports neither TensorFlow nor the
compiled plugin: the names below load on first use, and the optimizer is registered with
TensorFlow when a config is built or :func:`load` is called. A process that only serves
graphs (a ``tf.distribute.Server`` that is another session's master) calls
``tfoverlap.load()``; if TensorFlow is already imported, ``import tfoverlap`` does it.
"""
import importlib as _importlib
import sys as _sys

__version__ = "0.1.0"

_EXPORTS = {
    "optimize": "tfoverlap.api",
    "session_config": "tfoverlap.api",
    "rewriter_config_text": "tfoverlap.api",
    "tf_function_options": "tfoverlap.api",
    "enable_for_tf_function": "tfoverlap.api",
    "Options": "tfoverlap.options",
    "parse_options": "tfoverlap.options",
    "Report": "tfoverlap.passes.base",
    "PassFailure": "tfoverlap.passes.base",
    "recent_reports": "tfoverlap.passes.base",
    "report_count": "tfoverlap.passes.base",
    "load": "tfoverlap.integrations.grappler",
    "profile": "tfoverlap.costs.profile",
}
__all__ = sorted(_EXPORTS)


def __getattr__(name):
    module = _EXPORTS.get(name)
    if module is None:
        raise AttributeError(f"module 'tfoverlap' has no attribute {name!r}")
    value = getattr(_importlib.import_module(module), name)
    globals()[name] = value
    return value


def __dir__():
    return sorted(set(globals()) | set(_EXPORTS))


if "tensorflow" in _sys.modules:
    # A server process that imported TensorFlow and then tfoverlap expects the optimizer to
    # be there when a remote session's graph arrives; a missing plugin is reported by the
    # first config built instead.
    try:
        _importlib.import_module("tfoverlap.integrations.grappler").load()
    except ImportError:
        pass
