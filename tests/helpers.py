"""Shared pieces of the test suite."""
import dataclasses
import json
import os
import pathlib
import subprocess
import sys
import typing

import tensorflow as tf

import tfoverlap
from tfoverlap.costs.trace import op_start_order

LOCAL_PS = "/device:CPU:1"

#: One transfer per release group, one group in flight, no gain estimate: the strictest
#: enforcement (every transfer gets its gate), which tests of the observed order use.
SERIAL = dict(credit=0, window=1, force=True)


def local_config(**options):
    """A single-process session with two CPU devices; CPU:1 plays the parameter server."""
    base = tf.compat.v1.ConfigProto(device_count={"CPU": 2})
    if not options:
        return base
    return tfoverlap.session_config(base, ps_devices=LOCAL_PS, **options)


def traced_run(session, fetches):
    metadata = tf.compat.v1.RunMetadata()
    options = tf.compat.v1.RunOptions(trace_level=tf.compat.v1.RunOptions.FULL_TRACE)
    value = session.run(fetches, options=options, run_metadata=metadata)
    return value, metadata


def latest_report_with_transfers():
    for report in reversed(tfoverlap.recent_reports()):
        for entry in report.passes:
            if entry.summary.get("transfers"):
                return report, entry
    raise AssertionError("no TfOverlap report with transfers was recorded")


def observed_local_order(metadata, read_names):
    return op_start_order(metadata, LOCAL_PS, read_names)


def run_python(code: str, timeout: float = 240):
    """Runs ``code`` in a fresh interpreter (for process-global TensorFlow state)."""
    return subprocess.run([sys.executable, "-c", code], capture_output=True, text=True,
                          timeout=timeout)


def build_horovod_graph(script: str, path) -> None:
    """Runs ``script`` (which writes a Horovod graph to argv[1]) as a one-rank Gloo job."""
    import os
    env = {**os.environ, "HOROVOD_CONTROLLER": "gloo", "HOROVOD_CPU_OPERATIONS": "gloo"}
    result = subprocess.run([sys.executable, "-c", script, str(path)], env=env,
                            capture_output=True, text=True, timeout=240)
    assert result.returncode == 0, result.stderr[-2000:]


def horovod_timeline_text(tensors: dict, origin: int, closed: bool = False) -> str:
    """A timeline as Horovod writes it: tensor -> [(phase, begin, end)] in µs since
    ``origin`` (µs since the epoch); an ALLREDUCE holds a nested activity, as Horovod's do."""
    import json
    events = [{"name": "process_name", "ph": "M", "pid": 0,
               "args": {"start_time_since_epoch_in_micros": origin}}]
    for pid, (name, phases) in enumerate(tensors.items(), start=1):
        events.append({"name": "process_name", "ph": "M", "pid": pid, "args": {"name": name}})
        for phase, begin, end in phases:
            events.append({"ph": "B", "name": phase, "ts": begin, "pid": pid})
            if phase == "ALLREDUCE":
                events.append({"ph": "B", "name": "GLOO_ALLREDUCE", "ts": begin + 1,
                               "pid": pid})
                events.append({"ph": "E", "ts": end - 1, "pid": pid})
                events.append({"ph": "E", "ts": end, "pid": pid,
                               "args": {"dtype": "float32", "shape": "[10, 10]"}})
            else:
                events.append({"ph": "E", "ts": end, "pid": pid})
    text = "[\n" + ",\n".join(json.dumps(e) for e in events) + ","
    return text[:-1] + "]" if closed else text


PLAIN_PROGRAM = os.path.join(os.path.dirname(__file__), "jobs", "plain_horovod_program.py")


#: modes -> the plain program's records: it never imports tfoverlap, so one run serves
#: every test that compares against it
_PLAIN_RECORDS: dict = {}


def run_plain_program_with_and_without(launch, modes: str):
    """tests/jobs/plain_horovod_program.py's ``modes`` (comma-separated) on 2 Gloo ranks
    in namespaces (each rank's stderr, with tfoverlap's line, comes back), plainly (once a
    session) and behind ``launch`` (``tfoverlap run ... --``): ({"plain": {mode: records},
    "run": {mode: records}}, the summary lines of the launched run), a record per rank."""
    from tfoverlap.testbed.horovod_launch import run_horovod
    from tfoverlap.testbed.network import EmulatedNetwork
    records, summaries = {}, []
    with EmulatedNetwork(2, bandwidth=1.25e9) as network:
        for variant, prefix in (("plain", []), ("run", list(launch))):
            if variant == "plain" and modes in _PLAIN_RECORDS:
                records[variant] = _PLAIN_RECORDS[modes]
                continue
            result = run_horovod(network, 2, prefix + [sys.executable, PLAIN_PROGRAM, modes],
                                 controller="gloo", timeout=400)
            assert result.returncode == 0, [output[-3000:] for output in result.outputs]
            lines = [[json.loads(line) for line in output.splitlines()
                      if line.startswith("{")] for output in result.outputs]
            records[variant] = {mode: [next(line for line in per_rank if line["mode"] == mode)
                                       for per_rank in lines]
                                for mode in modes.split(",")}
            if variant == "plain":
                _PLAIN_RECORDS[modes] = records[variant]
            else:
                summaries = [line for output in result.outputs
                             for line in output.splitlines() if "tfoverlap [" in line]
    return records, summaries


_GRAPH_BUILDER = """
import sys
import tensorflow as tf
from tensorflow.python.ops import control_flow_util
for path, script in zip(sys.argv[1::2], sys.argv[2::2]):
    sys.argv = [script, path]
    exec(compile(open(script).read(), script, "exec"), {"__name__": "__main__"})
    control_flow_util.ENABLE_CONTROL_FLOW_V2 = True      # as the next script expects
    assert tf.executing_eagerly(), script + " turned eager execution off"
"""


def build_horovod_graphs(scripts: dict, directory) -> dict:
    """:func:`build_horovod_graph` for many scripts in one one-rank Gloo process (one
    TensorFlow and Horovod start-up, not one per graph): {name: script} -> {name: path of
    the GraphDef it wrote}. Each script runs in a fresh namespace, with control flow v2 on
    again after it; scripts must leave eager execution on (build in a tf.Graph())."""
    import pathlib
    directory = pathlib.Path(directory)
    paths, argv = {}, []
    for name, script in scripts.items():
        source = directory / f"{name}.py"
        source.write_text(script)
        paths[name] = directory / f"{name}.pb"
        argv += [str(paths[name]), str(source)]
    env = {**os.environ, "HOROVOD_CONTROLLER": "gloo", "HOROVOD_CPU_OPERATIONS": "gloo"}
    result = subprocess.run([sys.executable, "-c", _GRAPH_BUILDER, *argv], env=env,
                            capture_output=True, text=True, timeout=240)
    assert result.returncode == 0, result.stderr[-2000:]
    return paths


IN_SEQUENCE = os.path.join(os.path.dirname(__file__), "jobs", "in_sequence.py")


@dataclasses.dataclass(frozen=True)
class HorovodJob:
    """A job script of tests/jobs/ that a test module declares (``HOROVOD_JOBS = {name:
    HorovodJob(...)}``): the ``horovod_jobs`` fixture runs every declared job of the same
    ranks and controller in one Horovod job (tests/jobs/in_sequence.py). ``env``: the
    script's environment variables, given the directory it writes its records to.
    ``timeout``: the seconds the script may take; past them its ranks print their stacks
    and end the job (the watchdog of tests/jobs/in_sequence.py). ``disables_eager``: the
    script turns eager execution off for the process (a TF1 program), so it runs after the
    scripts that need it on. ``argv``: the script's arguments. ``process``: a name for a
    job that needs a fresh process (a Horovod job of its own, beside the shared one of its
    ranks and controller)."""
    script: str
    env: typing.Callable[[pathlib.Path], dict]
    ranks: int = 2
    controller: str = "gloo"
    timeout: float = 600
    disables_eager: bool = False
    argv: tuple = ()
    process: str = ""


#: Horovod's background loop negotiates once a cycle, over TCP under Gloo, busy or not: at
#: its default 1 ms, a quarter of a 2-rank test job's CPU time on 2 cores (the contract
#: matrix's job: 93 s and 174 CPU-seconds at 1 ms, 77 s and 134 at 10 ms, 91 s at 50 ms).
#: The jobs check values, not speed, and Horovod's results do not depend on the cycle.
HOROVOD_CYCLE_TIME_MS = "10"

#: Gloo's timeout for a collective or a rendezvous (Horovod's default: 30 s). On 2 cores
#: busy with a dozen TensorFlow processes, a rank of the 3-rank job waited more than 30 s
#: inside a 64 MB reduce-scatter (measure_halves, at the end of decoupled_training.py) and
#: failed the job with Gloo's "Read timeout"; the job alone never did. (A rank that is
#: merely late to a collective does not time out: 40 s late, the other waited.) A job that
#: truly hangs is ended by its script's watchdog (IN_SEQUENCE_TIMEOUT).
GLOO_TIMEOUT_ENV = {"HOROVOD_GLOO_TIMEOUT_SECONDS": "300"}


def run_jobs_in_sequence(ranks: int, jobs, timeout: float, controller: str = "gloo",
                         times=None, networks: list | None = None) -> None:
    """Runs the ``(script, env[, argv])`` job scripts one after another in one Horovod job of
    ``ranks`` ranks (loopback, ``controller`` "gloo" or "mpi"; tests/jobs/in_sequence.py);
    each script's records are where its ``env`` told it to write them, and how long each
    took is appended to ``times`` (a path, as JSON lines) where given. The job's network
    is appended to ``networks`` where given: closing it from another thread kills the
    job, which then fails."""
    from tfoverlap.testbed.horovod_launch import run_horovod
    from tfoverlap.testbed.network import EmulatedNetwork
    argv = []
    for script, env, *arguments in jobs:
        argv += ([f"{name}={value}" for name, value in env.items()] + [script]
                 + [str(argument) for values in arguments for argument in values] + [";"])
    with EmulatedNetwork(ranks, loopback=True) as network:
        if networks is not None:
            networks.append(network)
        result = run_horovod(network, ranks, [sys.executable, IN_SEQUENCE] + argv,
                             controller=controller, timeout=timeout,
                             env={"HOROVOD_CYCLE_TIME": HOROVOD_CYCLE_TIME_MS,
                                  **GLOO_TIMEOUT_ENV,
                                  **({"IN_SEQUENCE_TIMES": str(times)} if times else {})})
    assert result.returncode == 0, [output[-3000:] for output in result.outputs]
