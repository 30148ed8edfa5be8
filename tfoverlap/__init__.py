"""tfoverlap: overlap communication with computation in data-parallel TensorFlow training.

Importing the package loads the TfOverlap Grappler optimizer into TensorFlow; switch it on
with :func:`session_config` (TF1 sessions, distributed servers), :func:`tf_function_options`
(TF2 tf.function), or run the same passes offline with :func:`optimize`.
"""
import os as _os
import sys as _sys

if _sys.argv and _os.path.basename(_sys.argv[0]) == "tfoverlap":
    # The tfoverlap command: keep TensorFlow's start-up INFO lines off the terminal, so that
    # what the command says (or its one-line error) is all the user sees.
    _os.environ.setdefault("TF_CPP_MIN_LOG_LEVEL", "1")

from tfoverlap.api import optimize  # noqa: E402
from tfoverlap.config import (enable_for_tf_function, rewriter_config_text, session_config,
                              tf_function_options)
from tfoverlap.options import Options
from tfoverlap.passes import PassFailure, Report
from tfoverlap.plugin import load, recent_reports
from tfoverlap.profiling import profile

__version__ = "0.1.0"
__all__ = ["optimize", "session_config", "rewriter_config_text", "tf_function_options",
           "enable_for_tf_function", "Options", "Report", "PassFailure", "load",
           "recent_reports", "profile"]

load()
