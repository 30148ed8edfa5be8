"""``tfoverlap run``: TfOverlap for a program that was not written for it.

The launcher puts the options into ``TFOVERLAP_*`` environment variables
(``TFOVERLAP_SCHEDULE=tic``, ``TFOVERLAP_REPORT_DIR=...``, one per option) and the
directory of :mod:`tfoverlap.boot` first on ``PYTHONPATH``; then it replaces itself with
the program. Every Python process of the job that inherits that environment (the program,
the processes it starts, each rank that ``horovodrun`` or ``mpirun`` starts) then runs
:func:`activate_from_environment` at start-up (Python's ``sitecustomize`` hook), which
waits for TensorFlow to be imported and only then:

- loads the Grappler plugin;
- makes every TF1 ``Session`` use a config with TfOverlap switched on: a config the
  program passes is copied and ours is added to it; where it names TfOverlap already, its
  parameters win and ours fill in the rest;
- switches TfOverlap on for the ``tf.function`` graphs of the importing thread;
- prints one line when the process exits: what was ordered or planned, or why nothing.

A process that never imports TensorFlow (``horovodrun`` itself) is not touched.
"""
from __future__ import annotations

import atexit
import importlib.abc
import importlib.util
import os
import sys
import threading

from tfoverlap.costs.accelerators import DEVICE_MODELS
from tfoverlap.options import OPTION_NAMES, parse_options

__all__ = ["ENV_PREFIX", "ENV_ACTIVE", "options_from_environment", "environment_for",
           "absolute_paths", "boot_directory", "activate_from_environment",
           "activate_from_install", "summary_line", "run_program"]

ENV_PREFIX = "TFOVERLAP_"
#: set by the launcher: switch TfOverlap on even where no option is given (its defaults).
ENV_ACTIVE = ENV_PREFIX + "RUN"
_armed = threading.Event()
_activated = threading.Event()


def environment_for(options: dict, base: dict | None = None) -> dict:
    """``base`` (the current environment by default) with ``options`` as TFOVERLAP_*
    variables and the boot directory first on PYTHONPATH. The options are validated here,
    and the paths among them made absolute: children may start in other directories."""
    parse_options(options)
    environment = dict(os.environ if base is None else base)
    for name, value in absolute_paths(options).items():
        environment[ENV_PREFIX + name.upper()] = str(value)
    environment[ENV_ACTIVE] = "1"
    path = environment.get("PYTHONPATH", "")
    # An empty entry is the current directory to Python: it stays, as every other does.
    parts = [boot_directory()] + ([p for p in path.split(os.pathsep) if p != boot_directory()]
                                  if path else [])
    environment["PYTHONPATH"] = os.pathsep.join(parts)
    return environment


def absolute_paths(options: dict) -> dict:
    """``options`` with its file and directory values (profile, report_dir, an emulate
    device file) absolute, as seen from the current directory."""
    resolved = dict(options)
    for name in ("profile", "report_dir", "emulate"):
        value = str(resolved.get(name) or "")
        if not value or (name == "emulate" and value.lower() in DEVICE_MODELS):
            continue
        resolved[name] = os.path.abspath(os.path.expanduser(value))
    return resolved


def boot_directory() -> str:
    """The directory whose ``sitecustomize.py`` activates TfOverlap at start-up."""
    return os.path.join(os.path.dirname(os.path.abspath(__file__)), "boot")


def options_from_environment(environment: dict | None = None) -> dict:
    """The options the TFOVERLAP_* variables give (raw strings); ValueError names an
    unknown variable."""
    environment = os.environ if environment is None else environment
    options = {}
    for key, value in environment.items():
        if not key.startswith(ENV_PREFIX) or key == ENV_ACTIVE:
            continue
        name = key[len(ENV_PREFIX):].lower()
        if name not in OPTION_NAMES:
            raise ValueError(f"unknown tfoverlap option in {key}; known: "
                             + ", ".join(ENV_PREFIX + n.upper() for n in OPTION_NAMES))
        options[name] = value
    return options


def activate_from_environment() -> None:
    """Run at interpreter start (by tfoverlap/boot/sitecustomize.py): arms the hooks if
    TFOVERLAP_* variables are set. A bad variable is one line on stderr, and the program
    runs without TfOverlap. Only the first call of a process does anything."""
    if _armed.is_set():
        return
    _armed.set()
    try:
        options = options_from_environment()
        if not options and not os.environ.get(ENV_ACTIVE):
            return
        parse_options(options)
    except ValueError as error:
        print(f"tfoverlap: {error}; running without tfoverlap", file=sys.stderr)
        return
    if "tensorflow" in sys.modules:
        _on_tensorflow(options)
    else:
        sys.meta_path.insert(0, _AfterImport("tensorflow", lambda: _on_tensorflow(options)))
    if str(options.get("allreduce", "")).lower() == "caramel":
        for module in ("horovod.tensorflow", "horovod.tensorflow.keras", "horovod.keras"):
            if module in sys.modules:
                _substitute_wrappers(module, options)
            else:
                sys.meta_path.insert(0, _AfterImport(
                    module, lambda module=module: _substitute_wrappers(module, options)))


def activate_from_install() -> None:
    """Run at interpreter start by the ``tfoverlap-run.pth`` file that installing tfoverlap
    puts into site-packages. Where ``tfoverlap run`` started this process's job but no
    boot directory on its PYTHONPATH exists here (a rank on another host, where tfoverlap
    is installed in another place), TfOverlap is switched on from this install."""
    if not os.environ.get(ENV_ACTIVE):
        return
    boot = os.path.join("tfoverlap", "boot")
    for entry in os.environ.get("PYTHONPATH", "").split(os.pathsep):
        if (os.path.normpath(entry).endswith(boot)
                and os.path.isfile(os.path.join(entry, "sitecustomize.py"))):
            return      # that directory's sitecustomize switches it on
    activate_from_environment()


class _AfterImport(importlib.abc.MetaPathFinder):
    """Calls ``callback`` once module ``name`` has been imported (and executed)."""

    def __init__(self, name: str, callback):
        self.name, self.callback, self._finding = name, callback, False

    def find_spec(self, fullname, path=None, target=None):
        if fullname != self.name or self._finding:
            return None
        self._finding = True
        try:
            spec = importlib.util.find_spec(fullname)
        finally:
            self._finding = False
        if spec is None or spec.loader is None or not hasattr(spec.loader, "exec_module"):
            return spec
        loader, finder = spec.loader, self
        original = loader.exec_module

        def exec_module(module):
            original(module)
            if finder in sys.meta_path:
                sys.meta_path.remove(finder)
            finder.callback()

        loader.exec_module = exec_module
        return spec


def _on_tensorflow(options: dict) -> None:
    if _activated.is_set():
        return
    _activated.set()
    try:
        from tfoverlap.api import enable_for_sessions, enable_for_tf_function
        enable_for_sessions(**options)
        enable_for_tf_function(**options)
    except Exception as error:  # noqa: BLE001 - the program must run anyway
        print(f"tfoverlap: could not switch TfOverlap on ({type(error).__name__}: {error}); "
              "running without it", file=sys.stderr)
        return
    atexit.register(lambda: print(summary_line(), file=sys.stderr, flush=True))


def _substitute_wrappers(module_name: str, options: dict) -> None:
    """``--allreduce caramel``: tfoverlap's DistributedOptimizer (and DistributedGradientTape)
    in place of Horovod's in ``module_name`` (graph-mode and Keras optimizers, and tape
    steps, then get Caramel's plan in the graph being built, cross-step overlap included),
    planned with the run's options."""
    try:
        import tfoverlap.horovod as tfo_hvd
        from tfoverlap.horovod.adapters.horovods import substitute_in_horovod
        module = sys.modules[module_name]
        if module_name.endswith(".keras"):
            import tfoverlap.horovod.keras as tfo_keras
            substitute_in_horovod(module, {"DistributedOptimizer":
                                           tfo_keras.DistributedOptimizer})
        else:
            substitute_in_horovod(module, {"DistributedOptimizer":
                                           tfo_hvd.DistributedOptimizer,
                                           "DistributedGradientTape":
                                           tfo_hvd.DistributedGradientTape})
        modes = {name: getattr(parse_options(options), name)
                 for name in ("cross_step", "decouple") if name in options}
        tfo_hvd.configure(**modes, **{name: value for name, value in options.items()
                                      if name not in ("allreduce", *modes)})
    except Exception as error:  # noqa: BLE001 - the program must run anyway
        print(f"tfoverlap: Horovod's DistributedOptimizer is left in place "
              f"({type(error).__name__}: {error})", file=sys.stderr)


def _uses_horovod_without_wrappers() -> bool:
    """Whether the program imported Horovod's TensorFlow API but not tfoverlap's wrappers
    (neither itself nor through ``--allreduce caramel``): a TF2 step's AllReduces then sit
    in Horovod's tf.cond branches, which no pass plans, and graph mode gets Caramel only
    where the session's config asks for it."""
    return "horovod.tensorflow" in sys.modules and "tfoverlap.horovod" not in sys.modules


def summary_line() -> str:
    """One line: what the passes of this process did (from its recent reports)."""
    from tfoverlap.integrations.tf_function import coordinator_dispatches
    from tfoverlap.passes.base import recent_reports
    name = os.path.basename(sys.argv[0]) if sys.argv and sys.argv[0] else "python"
    ordered, planned, declined, failed = {}, {}, [], 0
    registry = sys.modules.get("tfoverlap.horovod.core.decisions")
    decisions = list(registry.recent_decisions()) if registry else []
    cross_step = [decision for decision in decisions if "decoupled" not in decision]
    decoupled = [decision for decision in decisions if "decoupled" in decision]
    for report in recent_reports():
        failed += report.reverted
        for entry in report.passes:
            summary = entry.summary
            if entry.name == "tictac" and summary.get("ordering_edges"):
                ordered[report.item_id] = summary["transfers"]
            elif entry.name == "caramel" and summary.get("buckets"):
                planned[report.item_id] = summary["buckets"]
            elif summary.get("declined"):
                declined.append(summary["declined"])
    parts = []
    if ordered:
        parts.append(f"ordered {sum(ordered.values())} PS transfers in {len(ordered)} graphs")
    if planned:
        parts.append(f"planned {sum(planned.values())} AllReduce buckets in "
                     f"{len(planned)} graphs")
    if declined:
        parts.append(f"left {len(declined)} graphs unchanged ({declined[-1]})")
    deferred = [decision["deferred"] for decision in cross_step if decision.get("deferred")]
    if deferred:
        parts.append(f"cross-step overlap: {sum(deferred)} gradients of {len(deferred)} "
                     "train graphs reduced under the next step's forward pass")
    elif cross_step:
        parts.append("cross-step overlap deferred nothing "
                     f"({cross_step[-1].get('reason', 'no reason given')})")
    if any(decision.get("decoupled") for decision in decoupled):
        parts.append(f"decoupled reduction: {sum(d.get('decoupled', 0) for d in decoupled)} "
                     "gradients reduce-scattered, their parameters all-gathered under the "
                     "next forward pass")
    elif decoupled:
        parts.append("decoupled reduction decoupled nothing "
                     f"({decoupled[-1].get('reason', 'no reason given')})")
    if coordinator_dispatches():
        parts.append(f"dispatched {coordinator_dispatches()} ClusterCoordinator closures to "
                     "workers, whose Grappler optimizes them (their reports are there)")
    if failed:
        parts.append(f"{failed} rewrites failed and were rolled back (see the warnings)")
    if not parts and _uses_horovod_without_wrappers():
        parts.append("the program uses Horovod, whose AllReduces tfoverlap plans through its "
                     "own DistributedOptimizer and DistributedGradientTape: run it with "
                     "`tfoverlap run --allreduce caramel` to put them in; no parameter "
                     "transfers reached it")
    elif not parts:
        parts.append("no graph with parameter transfers or Horovod AllReduces reached it")
    return f"tfoverlap [{name}, pid {os.getpid()}]: " + "; ".join(parts)


def run_program(command: list[str], options: dict) -> int:
    """Replaces this process with ``command`` under ``options`` (does not return unless
    the program cannot be started)."""
    environment = environment_for(options)
    try:
        os.execvpe(command[0], command, environment)
    except OSError as error:
        print(f"tfoverlap run: cannot start {command[0]!r}: {error.strerror}", file=sys.stderr)
        return 127
    return 0  # not reached
