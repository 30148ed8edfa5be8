"""The Grappler plugin: the Python side of the TfOverlap custom graph optimizer.

``load()`` loads the C++ shim into TensorFlow (once per process) and registers
:func:`_grappler_entry_point` with it through ctypes. Grappler then calls that entry point
with the serialized graph; it runs the same pipeline as :func:`tfoverlap.optimize`.
Nothing raised here may reach TensorFlow: a failure becomes a warning and an unchanged
graph. In strict mode the failure is returned to Grappler as an error status: TensorFlow
logs it ("TfOverlap failed: ...") and runs the unoptimized graph, so training goes on
either way; :func:`tfoverlap.optimize` with ``strict=True`` raises instead.
"""
from __future__ import annotations

import collections
import ctypes
import json
import os
import sysconfig
import threading
import time

from tfoverlap.integrations.emulated_kernel import load_emulated_ops
from tfoverlap.log import warn_once
from tfoverlap.options import parse_options
from tfoverlap.passes.base import REPORTS, PassContext, PassFailure
from tfoverlap.passes.pipeline import run_pipeline

__all__ = ["load", "library_path", "options_from_parameters", "OPTIMIZER_NAME"]

OPTIMIZER_NAME = "TfOverlap"
_ABI_VERSION = 1
_UNCHANGED, _REWRITTEN, _FAILED = 0, 1, 2

_ENTRY_POINT_TYPE = ctypes.CFUNCTYPE(
    ctypes.c_int, ctypes.c_void_p, ctypes.c_size_t, ctypes.c_void_p, ctypes.c_size_t,
    ctypes.c_void_p, ctypes.c_size_t, ctypes.c_void_p)

_load_lock = threading.Lock()
_library = None
_entry_point = None  # keeps the ctypes callback alive for the life of the process


def library_path() -> str:
    """Where the compiled shim lives (built by setup.py into the tfoverlap package)."""
    directory = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
    name = "_tfoverlap_optimizer" + sysconfig.get_config_var("EXT_SUFFIX")
    return os.path.join(directory, name)


def load() -> None:
    """Loads the optimizer into TensorFlow; safe to call any number of times."""
    global _library, _entry_point
    with _load_lock:
        if _library is not None:
            return
        path = library_path()
        if not os.path.exists(path):
            raise ImportError(f"the TfOverlap Grappler plugin is not built ({path} is missing); "
                              "reinstall tfoverlap with `make setup` or "
                              "`pip install --no-build-isolation .`")
        import tensorflow as tf
        tf.load_library(path)  # registers "TfOverlap" with Grappler
        library = ctypes.CDLL(path)
        if library.tfoverlap_abi_version() != _ABI_VERSION:
            raise ImportError(f"{path} was built for another tfoverlap version; rebuild it")
        library.tfoverlap_set_result.argtypes = [ctypes.c_void_p, ctypes.c_char_p,
                                                 ctypes.c_size_t]
        library.tfoverlap_set_entry_point.argtypes = [_ENTRY_POINT_TYPE]
        _entry_point = _ENTRY_POINT_TYPE(_grappler_entry_point)
        library.tfoverlap_set_entry_point(_entry_point)
        _library = library
    load_emulated_ops()


def _parse_item(text: str) -> dict[str, list[str]]:
    item: dict[str, list[str]] = collections.defaultdict(list)
    for line in text.splitlines():
        key, _, value = line.partition(" ")
        item[key].append(value)
    return item


def _options_from_config(serialized: bytes) -> dict:
    from tensorflow.core.protobuf import rewriter_config_pb2
    config = rewriter_config_pb2.RewriterConfig.CustomGraphOptimizer()
    config.ParseFromString(serialized)
    return options_from_parameters(config.parameter_map)


def options_from_parameters(parameter_map) -> dict:
    """Raw option values from a custom optimizer's ``parameter_map`` (AttrValues)."""
    values = {}
    for key, attr in parameter_map.items():
        kind = attr.WhichOneof("value")
        if kind == "s":
            values[key] = attr.s.decode()
        elif kind in ("i", "f", "b"):
            values[key] = getattr(attr, kind)
        else:
            raise ValueError(f"option {key!r} has a value of unsupported kind {kind!r}")
    return values


def _grappler_entry_point(graph_ptr, graph_len, item_ptr, item_len,
                          config_ptr, config_len, result) -> int:
    """Called by the C++ shim with the GIL held (ctypes takes it); never raises."""
    strict = False
    try:
        from tensorflow.core.framework import graph_pb2
        values = _options_from_config(ctypes.string_at(config_ptr, config_len)
                                      if config_len else b"")
        strict = str(values.get("strict", "")).lower() in ("true", "1")
        options = parse_options(values, check_files=False)
        item = _parse_item(ctypes.string_at(item_ptr, item_len).decode())
        graph_def = graph_pb2.GraphDef()
        graph_def.ParseFromString(ctypes.string_at(graph_ptr, graph_len))
        context = PassContext(options=options, fetch=tuple(item["fetch"]),
                              feed=tuple(item["feed"]),
                              keep=tuple(item["keep"] + item["preserve"]),
                              item_id=(item["id"] or [""])[0], source="grappler")
        new_graph_def, report = run_pipeline(graph_def, context)
        _record(report, options.report_dir)
        if not report.modified:
            return _UNCHANGED
        _set_result(result, new_graph_def.SerializeToString())
        return _REWRITTEN
    except PassFailure as failure:
        _set_result(result, str(failure).encode())
        return _FAILED
    except Exception as error:  # noqa: BLE001 - TensorFlow must never see a Python error
        message = f"tfoverlap: {type(error).__name__}: {error}"
        if strict:
            _set_result(result, message.encode())
            return _FAILED
        warn_once(message + "; the graph is left unchanged")
        return _UNCHANGED


def _set_result(result, data: bytes) -> None:
    _library.tfoverlap_set_result(result, data, len(data))


def _record(report, report_dir: str) -> None:
    """Keeps the report; a report that cannot be written is a warning, never a reason to
    throw the rewrite away."""
    REPORTS.append(report)
    if not report_dir:
        return
    try:
        os.makedirs(report_dir, exist_ok=True)
        name = f"report-{os.getpid()}-{time.time_ns()}.json"
        with open(os.path.join(report_dir, name), "w") as out:
            json.dump(report.to_dict(), out, indent=1)
    except OSError as error:
        warn_once(f"tfoverlap: cannot write reports to report_dir {report_dir!r} "
                  f"({error.strerror or error}); the rewrite stands")
