"""Loads the emulated-accelerator kernel (native/emulated_compute.cc) into TensorFlow.

Every process that runs an emulated graph's worker ops needs it; :func:`tfoverlap.load`
loads it together with the Grappler plugin, and the emulate pass loads it before it puts
the op into a graph.
"""
from __future__ import annotations

import os
import sysconfig
import threading

__all__ = ["load_emulated_ops", "emulated_library_path"]

_lock = threading.Lock()
_module = None


def emulated_library_path() -> str:
    """Where setup.py builds the kernel library (inside the tfoverlap package)."""
    directory = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
    return os.path.join(directory,
                        "_tfoverlap_emulated" + sysconfig.get_config_var("EXT_SUFFIX"))


def load_emulated_ops():
    """Registers ``TfOverlapEmulatedCompute`` (once per process); returns the op module
    (``tf_overlap_emulated_compute`` builds the op by hand, as the tests do)."""
    global _module
    with _lock:
        if _module is None:
            path = emulated_library_path()
            if not os.path.exists(path):
                raise ImportError(f"the emulated-accelerator kernel is not built ({path} is "
                                  "missing); reinstall tfoverlap with `make setup`")
            import tensorflow as tf
            _module = tf.load_op_library(path)
        return _module
