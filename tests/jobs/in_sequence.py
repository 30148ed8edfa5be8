"""Runs several Horovod job scripts of this directory one after another in one process
(one Horovod start-up and one TensorFlow warm-up for all of them).

argv: groups separated by ";", each ``[NAME=VALUE ...] script.py [argument ...]``: the
environment variables the script reads (set for that script alone), then the script and
its argv. Each runs as ``__main__``; the first to fail (an error, or a non-zero exit) ends
the job with its error. Each starts as it would in a process of its own where tfoverlap
is concerned: default options, no log handlers of the scripts before it, and no message
remembered as said (each script counts the warnings it gets).

A script's own setting IN_SEQUENCE_TIMEOUT=SECONDS is its watchdog: where the script is
still running after that long, the rank prints every thread's stack to stdout and exits
with 1, and the launcher stops the other ranks. A script that leaves its ranks in
different collectives (an error caught on one rank alone) would otherwise hold the whole
job until the timeout of the job, the sum of its scripts'.

Where $IN_SEQUENCE_TIMES names a file, rank 0 appends a JSON line per script to it: the
script, its arguments and settings, the seconds it took and the CPU-seconds rank 0 spent
on it (all threads: TensorFlow's, Horovod's background loop).

Once every script has run (their records written), the process shuts Horovod down and
exits at once, without the interpreter's teardown: in a 2-rank job that had trained some
70 models that teardown took 15 s, against 2-3 s for either half of them alone.
"""
import faulthandler
import json
import logging
import os
import runpy
import sys
import time


def fresh_tfoverlap_state(handlers: list) -> None:
    """Undoes what a script before may have left in tfoverlap: its options, its log
    handlers (``handlers``: the logger's own), the messages said once."""
    if "tfoverlap.log" in sys.modules:
        log = sys.modules["tfoverlap.log"]
        log.logger.handlers[:] = handlers
        log.forget_said()
    if "tfoverlap.horovod" in sys.modules:
        sys.modules["tfoverlap.horovod"].configure()


def groups(argv: list[str]) -> list[tuple[dict, list[str]]]:
    result, current = [], []
    for token in argv + [";"]:
        if token != ";":
            current.append(token)
            continue
        settings = {}
        while current and "=" in current[0] and not current[0].endswith(".py"):
            name, _, value = current.pop(0).partition("=")
            settings[name] = value
        if current:
            result.append((settings, current))
        current = []
    return result


if __name__ == "__main__":
    sys.path.insert(0, os.path.dirname(os.path.abspath(__file__)))
    from collector import collect_less_often
    collect_less_often()
    environment = dict(os.environ)
    handlers = list(logging.getLogger("tfoverlap").handlers)
    for settings, script_argv in groups(sys.argv[1:]):
        fresh_tfoverlap_state(handlers)
        watchdog_s = float(settings.pop("IN_SEQUENCE_TIMEOUT", 0))
        os.environ.clear()
        os.environ.update(environment, **settings)
        sys.argv = list(script_argv)
        if watchdog_s:
            faulthandler.dump_traceback_later(watchdog_s, exit=True, file=sys.stdout)
        began, began_cpu = time.monotonic(), time.process_time()
        try:
            runpy.run_path(script_argv[0], run_name="__main__")
        except SystemExit as done:      # a script's sys.exit(0) ends that script alone
            if done.code not in (None, 0):
                raise
        faulthandler.cancel_dump_traceback_later()
        if environment.get("IN_SEQUENCE_TIMES") and "0" == environment.get(
                "HOROVOD_RANK", environment.get("OMPI_COMM_WORLD_RANK")):
            with open(environment["IN_SEQUENCE_TIMES"], "a") as times:
                times.write(json.dumps({"script": os.path.basename(script_argv[0]),
                                        "arguments": script_argv[1:], "settings": settings,
                                        "seconds": round(time.monotonic() - began, 1),
                                        "cpu_seconds": round(time.process_time() - began_cpu, 1)})
                            + "\n")
    if "horovod.tensorflow" in sys.modules:     # under MPI: finalize it as a rank must
        sys.modules["horovod.tensorflow"].shutdown()
    sys.stdout.flush()
    sys.stderr.flush()
    os._exit(0)
