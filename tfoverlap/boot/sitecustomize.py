"""Started by Python at start-up when ``tfoverlap run`` put this directory on PYTHONPATH:
switches TfOverlap on for this process (:mod:`tfoverlap.launcher`), then runs the
``sitecustomize`` this one hides, if there is one."""
import importlib.util
import os
import sys


def _activate():
    try:
        from tfoverlap.launcher import activate_from_environment
    except ImportError as error:
        print(f"tfoverlap: cannot import tfoverlap ({error}); running without it",
              file=sys.stderr)
        return
    activate_from_environment()


def _chain():
    here = os.path.dirname(os.path.abspath(__file__))
    for directory in sys.path:
        if not directory or os.path.abspath(directory) == here:
            continue
        candidate = os.path.join(directory, "sitecustomize.py")
        if os.path.exists(candidate):
            spec = importlib.util.spec_from_file_location("_tfoverlap_next_sitecustomize",
                                                          candidate)
            module = importlib.util.module_from_spec(spec)
            spec.loader.exec_module(module)
            return


_activate()
_chain()
