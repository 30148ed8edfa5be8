"""Started by Python at start-up when ``tfoverlap run`` put this directory on PYTHONPATH:
switches TfOverlap on for this process (:mod:`tfoverlap.launcher`), then runs the
``sitecustomize`` this one hides, if there is one, exactly as Python would have run it."""
import importlib.machinery
import importlib.util
import os
import sys


def _activate():
    try:
        from tfoverlap.launcher import activate_from_environment
        activate_from_environment()
    except Exception as error:  # noqa: BLE001 - the program must run, and the next hook too
        print(f"tfoverlap: not active in this process ({type(error).__name__}: {error})",
              file=sys.stderr)


def _run_hidden_sitecustomize():
    """The first ``sitecustomize`` on the rest of sys.path (a module, a package, a .pyc, in
    a zip: whatever Python's own import finds), run once under its own name. Its errors
    go to Python's site module, which reports them as it would have."""
    # Every tfoverlap boot directory is passed over, this one and another install's alike:
    # each would look for the next sitecustomize, and find the other one again.
    boot = os.path.join("tfoverlap", "boot")
    rest = [entry for entry in sys.path
            if isinstance(entry, str) and not os.path.abspath(entry or os.curdir).endswith(boot)]
    spec = importlib.machinery.PathFinder.find_spec("sitecustomize", rest)
    if spec is None or spec.loader is None:
        return
    module = importlib.util.module_from_spec(spec)
    sys.modules["sitecustomize"] = module    # what `import sitecustomize` gives from now on
    spec.loader.exec_module(module)


_activate()
_run_hidden_sitecustomize()
