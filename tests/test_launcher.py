"""``tfoverlap run``: options through the environment, and unmodified programs under it."""
import glob
import json
import os
import socket
import subprocess
import sys
import time

import pytest

from tfoverlap import launcher
from tfoverlap.costs.trace import recv_events

ROOT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
EXAMPLE = os.path.join(ROOT, "examples", "tf1_ps_train.py")


def test_options_travel_as_environment_variables():
    environment = launcher.environment_for({"schedule": "tac", "report_dir": "/tmp/r"},
                                           base={"PYTHONPATH": "/elsewhere"})
    assert environment["TFOVERLAP_SCHEDULE"] == "tac"
    assert environment[launcher.ENV_ACTIVE] == "1"
    assert environment["PYTHONPATH"].split(os.pathsep) == [launcher.boot_directory(),
                                                           "/elsewhere"]
    assert launcher.options_from_environment(environment) == {"schedule": "tac",
                                                              "report_dir": "/tmp/r"}
    with pytest.raises(ValueError, match="TFOVERLAP_SCHEDULE_TYPO"):
        launcher.options_from_environment({"TFOVERLAP_SCHEDULE_TYPO": "tic"})
    with pytest.raises(ValueError, match="option 'window'"):
        launcher.environment_for({"window": 0})


def _tfoverlap(*args, **kwargs):
    return subprocess.run([sys.executable, "-m", "tfoverlap", *map(str, args)],
                          capture_output=True, text=True, timeout=300, cwd=ROOT, **kwargs)


def test_bad_run_commands_are_one_line_errors():
    for args in (["run", "--schedule", "fast", "--", "python", "x.py"],
                 ["run", "--schedule", "tic", "python", "x.py"], ["run", "--"]):
        result = _tfoverlap(*args)
        assert result.returncode == 2, result
        assert len(result.stderr.strip().splitlines()) == 1, result.stderr
    result = _tfoverlap("run", "--", "no-such-program-here")
    assert result.returncode == 127 and "cannot start" in result.stderr


def test_a_bad_variable_is_one_line_and_the_program_runs():
    environment = {**os.environ, "TFOVERLAP_WINDOW": "0",
                   "PYTHONPATH": launcher.boot_directory()}
    result = subprocess.run([sys.executable, "-c", "print('ran')"], capture_output=True,
                            text=True, env=environment, timeout=60)
    assert result.stdout.strip() == "ran"
    assert "option 'window' must be at least 1" in result.stderr
    assert "running without tfoverlap" in result.stderr


def _free_ports(count):
    sockets = [socket.socket() for _ in range(count)]
    for s in sockets:
        s.bind(("localhost", 0))
    ports = [s.getsockname()[1] for s in sockets]
    for s in sockets:
        s.close()
    return ports


@pytest.fixture(scope="module")
def ps_task():
    ps_port, worker_port = _free_ports(2)
    hosts = ["--ps_hosts", f"localhost:{ps_port}", "--worker_hosts", f"localhost:{worker_port}"]
    environment = {**os.environ, "TF_CPP_MIN_LOG_LEVEL": "2"}
    process = subprocess.Popen([sys.executable, EXAMPLE, "--job", "ps", *hosts],
                               env=environment, stdout=subprocess.DEVNULL,
                               stderr=subprocess.DEVNULL)
    time.sleep(2)
    yield hosts
    process.kill()
    process.wait()


def _worker(hosts, tmp_path, prefix=(), extra=()):
    traces = tmp_path / "traces"
    traces.mkdir()
    command = [*prefix, sys.executable, EXAMPLE, "--job", "worker", *hosts,
               "--trace_dir", str(traces), *extra]
    result = subprocess.run(command, capture_output=True, text=True, timeout=300, cwd=ROOT,
                            env={**os.environ, "TF_CPP_MIN_LOG_LEVEL": "2"})
    assert result.returncode == 0, result.stderr[-3000:]
    losses = json.loads(result.stdout.strip().splitlines()[-1])["losses"]
    arrivals = []
    import tensorflow as tf
    for path in sorted(glob.glob(str(traces / "*.pb"))):
        metadata = tf.compat.v1.RunMetadata()
        metadata.ParseFromString(open(path, "rb").read())
        arrived = {e.source: e.start_micros + e.duration_micros for e in recv_events(metadata)
                   if e.bytes > 0 and "/job:worker/" in e.destination_device}
        arrivals.append(sorted(arrived, key=arrived.get))
    return losses, arrivals, result.stderr


def _planned_order(report_dir):
    for path in sorted(glob.glob(os.path.join(report_dir, "*.json"))):
        for entry in json.load(open(path))["passes"]:
            if entry["name"] == "tictac" and entry["summary"].get("ordering_edges"):
                (order,) = entry["summary"]["order"].values()
                return order
    raise AssertionError(f"no report with ordered transfers in {report_dir}")


def test_an_unmodified_ps_program_is_ordered_under_tfoverlap_run(ps_task, tmp_path):
    baseline, _, _ = _worker(ps_task, tmp_path)
    reports = tmp_path / "reports"
    run = [sys.executable, "-m", "tfoverlap", "run", "--schedule", "tic", "--credit", "0",
           "--window", "1", "--force", "true", "--report-dir", str(reports), "--"]
    (tmp_path / "ordered").mkdir()
    losses, arrivals, stderr = _worker(ps_task, tmp_path / "ordered", prefix=run)
    assert losses == baseline
    planned = _planned_order(reports)
    assert len(planned) == 8
    assert all(order == planned for order in arrivals), (planned, arrivals)
    summary = [line for line in stderr.splitlines() if line.startswith("tfoverlap [")]
    assert len(summary) == 1 and "ordered 8 PS transfers" in summary[0], stderr[-2000:]


def test_a_programs_own_rewriter_config_takes_effect_under_tfoverlap_run(ps_task, tmp_path):
    reports = tmp_path / "reports"
    rewriter_config = (
        "custom_optimizers { name: 'TfOverlap' "
        "parameter_map { key: 'credit' value { s: '0' } } "
        "parameter_map { key: 'window' value { i: 1 } } "
        "parameter_map { key: 'force' value { b: true } } "
        f"parameter_map {{ key: 'report_dir' value {{ s: '{reports}' }} }} }}")
    losses, arrivals, stderr = _worker(
        ps_task, tmp_path, prefix=[sys.executable, "-m", "tfoverlap", "run", "--"],
        extra=["--rewriter_config", rewriter_config])
    planned = _planned_order(reports)
    assert all(order == planned for order in arrivals), (planned, arrivals)
    assert "ordered 8 PS transfers" in stderr


PS_STRATEGY_EXAMPLE = os.path.join(ROOT, "examples", "tf2_ps_strategy_train.py")
PROFILED_SERVER = os.path.join(ROOT, "tests", "jobs", "profiled_server.py")


def _ps_strategy_job(tmp_path, chief_prefix=()):
    """1 PS (profiled), 2 workers (under ``tfoverlap run``, which loads the plugin) and the
    example's coordinator; returns (losses, PS read events, coordinator's stderr)."""
    from tfoverlap.costs.trace import profiled_op_starts
    chief, ps, worker0, worker1 = (f"localhost:{p}" for p in _free_ports(4))
    hosts = ["--chief_host", chief, "--ps_hosts", ps, "--worker_hosts", f"{worker0},{worker1}"]
    cluster = json.dumps({"chief": [chief], "ps": [ps], "worker": [worker0, worker1]})
    capture = tmp_path / "capture"
    capture.mkdir(parents=True)
    environment = {**os.environ, "TF_CPP_MIN_LOG_LEVEL": "2"}
    quiet = dict(env=environment, stdout=subprocess.DEVNULL, stderr=subprocess.DEVNULL)
    tasks = [subprocess.Popen([sys.executable, PROFILED_SERVER, cluster, "ps", "0",
                               str(capture)], **quiet)]
    tasks += [subprocess.Popen([sys.executable, "-m", "tfoverlap", "run", "--", sys.executable,
                                PS_STRATEGY_EXAMPLE, "--job", "worker", "--task", str(t), *hosts],
                               **quiet) for t in (0, 1)]
    try:
        result = subprocess.run([*chief_prefix, sys.executable, PS_STRATEGY_EXAMPLE,
                                 "--job", "chief", "--join_every_step", "--steps", "6", *hosts],
                                capture_output=True, text=True, timeout=300, cwd=ROOT,
                                env=environment)
        (capture / "stop").touch()
        for _ in range(300):
            if (capture / "done").exists():
                break
            time.sleep(0.1)
    finally:
        for task in tasks:
            task.kill()
            task.wait()
    assert result.returncode == 0, result.stderr[-3000:]
    losses = json.loads(result.stdout.strip().splitlines()[-1])["losses"]
    (xspace,) = glob.glob(str(capture / "plugins" / "profile" / "*" / "*.xplane.pb"))
    reads = [f"MatMul{suffix}/ReadVariableOp" for suffix in [""] + [f"_{i}" for i in range(1, 12)]]
    return losses, profiled_op_starts(xspace, reads), result.stderr


def test_a_ps_strategy_job_has_its_transfers_ordered_by_the_workers(tmp_path):
    """ParameterServerStrategy: the coordinator's option reaches the workers, whose Grappler
    orders each scheduled step's PS reads; the PS runs them in the planned order, every
    step, and the losses are the default's."""
    baseline, default_reads, _ = _ps_strategy_job(tmp_path / "default")
    reports = tmp_path / "reports"
    run = [sys.executable, "-m", "tfoverlap", "run", "--schedule", "tic", "--credit", "0",
           "--window", "1", "--force", "true", "--report-dir", str(reports), "--"]
    losses, reads, stderr = _ps_strategy_job(tmp_path / "ordered", chief_prefix=run)
    assert len(baseline) == 6 and losses == baseline
    planned = _planned_order(reports)
    assert sorted(planned) == sorted({name for name, _ in default_reads}) and len(planned) == 12
    assert len(reads) == len(default_reads) == 6 * 12, (len(reads), len(default_reads))
    steps = [[name for name, _ in reads[k:k + 12]] for k in range(0, len(reads), 12)]
    assert all(step == planned for step in steps), (planned, steps)
    default_steps = [[name for name, _ in default_reads[k:k + 12]]
                     for k in range(0, len(default_reads), 12)]
    assert any(step != planned for step in default_steps), "the default already in order"
    assert stderr.count("optimized by the worker tasks") == 1, stderr[-2000:]
    summary = [line for line in stderr.splitlines() if line.startswith("tfoverlap [")]
    assert len(summary) == 1 and "dispatched 6 ClusterCoordinator closures" in summary[0]
