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


@pytest.mark.slow
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


@pytest.mark.slow
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


@pytest.mark.slow
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
    # No session starts on a TF2 worker: the coordinator measured the link and gave it.
    links = {entry["summary"]["link"] for path in glob.glob(str(reports / "*.json"))
             for entry in json.load(open(path))["passes"] if entry["name"] == "tictac"}
    assert len(links) == 1 and next(iter(links)).endswith("(given)"), links


def _run_under_launcher(code_or_script, options=None, pythonpath=None, cwd=None,
                        extra_env=None):
    """Runs Python as `tfoverlap run` would start it: the launcher's environment (from
    ``pythonpath`` as the program's own PYTHONPATH; None: unset)."""
    base = {key: value for key, value in os.environ.items()
            if key != "PYTHONPATH" and not key.startswith(launcher.ENV_PREFIX)}
    if pythonpath is not None:
        base["PYTHONPATH"] = pythonpath
    environment = {**launcher.environment_for(options or {}, base=base), **(extra_env or {})}
    argv = ([sys.executable, code_or_script] if code_or_script.endswith(".py")
            else [sys.executable, "-c", code_or_script])
    return subprocess.run(argv, capture_output=True, text=True, env=environment, cwd=cwd,
                          timeout=120)


def test_empty_pythonpath_entries_still_mean_the_current_directory(tmp_path):
    """PYTHONPATH=":/lib" puts the current directory on sys.path; under the launcher too."""
    work, program = tmp_path / "work", tmp_path / "program"
    work.mkdir(), program.mkdir()
    (work / "local_module.py").write_text("WHERE = 'work'\n")
    (program / "main.py").write_text("import local_module\nprint(local_module.WHERE)\n")
    pythonpath = os.pathsep + str(tmp_path / "lib")
    assert launcher.environment_for({}, base={"PYTHONPATH": pythonpath})[
        "PYTHONPATH"].split(os.pathsep) == [launcher.boot_directory(), "", str(tmp_path / "lib")]
    result = _run_under_launcher(str(program / "main.py"), pythonpath=pythonpath, cwd=work)
    assert result.returncode == 0 and result.stdout.strip() == "work", result.stderr


_USER_SITECUSTOMIZE = ("import os, sys\n"
                       "print('user sitecustomize ran as', __name__, file=sys.stderr)\n"
                       "MARK = 'user'\n")
_SHOWS_SITECUSTOMIZE = "import sitecustomize; print(getattr(sitecustomize, 'MARK', None))"


def _package_sitecustomize(directory):
    (directory / "sitecustomize").mkdir()
    (directory / "sitecustomize" / "__init__.py").write_text(_USER_SITECUSTOMIZE)
    return str(directory)


def _compiled_sitecustomize(directory):
    import py_compile
    source = directory / "source.py"
    source.write_text(_USER_SITECUSTOMIZE)
    py_compile.compile(str(source), cfile=str(directory / "sitecustomize.pyc"))
    source.unlink()
    return str(directory)


def _zipped_sitecustomize(directory):
    import zipfile
    archive = directory / "site.zip"
    with zipfile.ZipFile(archive, "w") as out:
        out.writestr("sitecustomize.py", _USER_SITECUSTOMIZE)
    return str(archive)


@pytest.mark.parametrize("make", [_package_sitecustomize, _compiled_sitecustomize,
                                  _zipped_sitecustomize], ids=["package", "pyc", "zip"])
def test_the_users_own_sitecustomize_runs_once_under_its_own_name(tmp_path, make):
    """Whatever form the program's sitecustomize has, it runs exactly once, as
    `sitecustomize`, as it would without the launcher."""
    pythonpath = make(tmp_path)
    plain = subprocess.run([sys.executable, "-c", _SHOWS_SITECUSTOMIZE], capture_output=True,
                           text=True, env={**os.environ, "PYTHONPATH": pythonpath}, timeout=60)
    launched = _run_under_launcher(_SHOWS_SITECUSTOMIZE, pythonpath=pythonpath)
    for result in (plain, launched):
        assert result.returncode == 0, result.stderr
        assert result.stderr.count("user sitecustomize ran as sitecustomize") == 1, result.stderr
        assert result.stdout.strip() == "user", result.stdout


def test_the_users_sitecustomize_runs_when_tfoverlap_cannot_start(tmp_path):
    """A malformed profile: one line from tfoverlap, and the program's sitecustomize runs."""
    (tmp_path / "sitecustomize.py").write_text(_USER_SITECUSTOMIZE)
    profile = tmp_path / "profile.json"
    profile.write_text('{"format": "tfoverlap-profile", "version": 1, "op_seconds": {}, '
                       '"transfer_seconds": {}, "transfer_bytes": {}, "steps": [5]}')
    result = _run_under_launcher(_SHOWS_SITECUSTOMIZE, pythonpath=str(tmp_path),
                                 extra_env={"TFOVERLAP_PROFILE": str(profile)})
    assert result.stdout.strip() == "user", result.stderr
    assert result.stderr.count("user sitecustomize ran as sitecustomize") == 1
    lines = [line for line in result.stderr.splitlines() if line.startswith("tfoverlap")]
    assert len(lines) == 1 and "steps" in lines[0], result.stderr


def test_errors_of_the_users_sitecustomize_are_reported_as_python_reports_them(tmp_path):
    (tmp_path / "sitecustomize.py").write_text("raise RuntimeError('user start-up broke')\n")
    plain = subprocess.run([sys.executable, "-c", "print('ran')"], capture_output=True,
                           text=True, env={**os.environ, "PYTHONPATH": str(tmp_path)},
                           timeout=60)
    launched = _run_under_launcher("print('ran')", pythonpath=str(tmp_path))
    for result in (plain, launched):
        assert result.stdout.strip() == "ran"
        assert "Error in sitecustomize" in result.stderr
        assert "RuntimeError: user start-up broke" in result.stderr


def test_run_help_says_what_each_option_does():
    result = _tfoverlap("run", "--help")
    assert result.returncode == 0, result.stderr
    text = " ".join(result.stdout.split())
    assert "usage: tfoverlap run [options] -- PROGRAM" in text
    assert "--window VALUE how many release groups may be in flight" in text
    assert "(default: 2)" in text and "(default: 'auto')" in text
    assert "the option 'window'" not in text


def test_relative_paths_are_made_absolute_at_launch(tmp_path, monkeypatch):
    monkeypatch.chdir(tmp_path)
    (tmp_path / "v100x.json").write_text(json.dumps({"name": "mine", "peak_flops": 1e13,
                                                     "memory_bandwidth": 5e11}))
    environment = launcher.environment_for({"report_dir": "reports", "emulate": "v100"},
                                           base={})
    assert environment["TFOVERLAP_REPORT_DIR"] == str(tmp_path / "reports")
    assert environment["TFOVERLAP_EMULATE"] == "v100"
    assert launcher.absolute_paths({"profile": "p.json", "emulate": "v100x.json"}) == {
        "profile": str(tmp_path / "p.json"), "emulate": str(tmp_path / "v100x.json")}


def test_a_host_without_the_boot_directory_switches_tfoverlap_on_from_its_install(tmp_path):
    """A rank on another host: the launcher's boot directory is not there, but tfoverlap is
    installed; the install's start-up file switches TfOverlap on (its exit line shows)."""
    missing = str(tmp_path / "elsewhere" / "tfoverlap" / "boot")
    environment = {**{k: v for k, v in os.environ.items() if not k.startswith("TFOVERLAP_")},
                   "PYTHONPATH": missing, launcher.ENV_ACTIVE: "1",
                   "TFOVERLAP_SCHEDULE": "tic"}
    result = subprocess.run([sys.executable, "-c", "import tensorflow"], capture_output=True,
                            text=True, env=environment, timeout=120)
    assert result.returncode == 0, result.stderr
    assert "tfoverlap [" in result.stderr and "no graph with parameter transfers" in \
        result.stderr, result.stderr[-2000:]


def test_two_installs_boot_directories_run_the_users_sitecustomize_once(tmp_path):
    """`tfoverlap run` of one install inside that of another: both boot directories are
    on PYTHONPATH; neither hands over to the other, and the program's own runs once."""
    import shutil
    other = tmp_path / "other" / "tfoverlap" / "boot"
    shutil.copytree(launcher.boot_directory(), other)
    user = tmp_path / "user"
    user.mkdir()
    (user / "sitecustomize.py").write_text(_USER_SITECUSTOMIZE)
    result = _run_under_launcher(_SHOWS_SITECUSTOMIZE,
                                 pythonpath=os.pathsep.join([str(other), str(user)]))
    assert result.returncode == 0, result.stderr[-2000:]
    assert result.stderr.count("user sitecustomize ran as sitecustomize") == 1, result.stderr
    assert result.stdout.strip() == "user"


def test_the_exit_line_of_a_horovod_program_without_the_wrappers_names_the_flag(monkeypatch):
    """A TF2 Horovod step's AllReduces sit in Horovod's tf.cond branches, which no pass
    plans: run without --allreduce caramel, the exit line says so instead of claiming that
    no AllReduce reached tfoverlap."""
    import types
    from tfoverlap.integrations import tf_function
    from tfoverlap.passes import base
    monkeypatch.setattr(base, "recent_reports", lambda: [])
    monkeypatch.setattr(tf_function, "coordinator_dispatches", lambda: 0)
    monkeypatch.delitem(sys.modules, "tfoverlap.horovod.core.decisions", raising=False)
    monkeypatch.delitem(sys.modules, "horovod.tensorflow", raising=False)
    monkeypatch.delitem(sys.modules, "tfoverlap.horovod", raising=False)
    assert "no graph with parameter transfers" in launcher.summary_line()
    monkeypatch.setitem(sys.modules, "horovod.tensorflow", types.ModuleType("horovod"))
    line = launcher.summary_line()
    assert "uses Horovod" in line and "tfoverlap run --allreduce caramel" in line
    # The wrappers are in (imported by the program, or swapped in by the flag).
    monkeypatch.setitem(sys.modules, "tfoverlap.horovod", types.ModuleType("tfoverlap"))
    assert "no graph with parameter transfers" in launcher.summary_line()
