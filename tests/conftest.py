import json
import os
import sys

import pytest

from jobs.collector import collect_less_often

os.environ.setdefault("TF_CPP_MIN_LOG_LEVEL", "2")
collect_less_often()

#: Where the Horovod jobs of this session write how long each script took (JSON lines).
_JOB_TIMES: list = []


def pytest_terminal_summary(terminalreporter):
    """How long each script of the session's Horovod jobs took, and the CPU rank 0 spent on
    it (their tests' durations hide both: the jobs run while other tests do)."""
    lines = [json.loads(line) for path in _JOB_TIMES if path.exists()
             for line in path.read_text().splitlines()]
    if lines:
        terminalreporter.write_sep(
            "=", "Horovod job scripts (rank 0's seconds and CPU-seconds, while other tests ran)")
        for line in sorted(lines, key=lambda line: -line["seconds"]):
            settings = " ".join(f"{name}={value}" for name, value in line["settings"].items()
                                if not name.endswith("RECORDS") and "CHECKPOINTS" not in name)
            arguments = " ".join(line.get("arguments", []))
            arguments = arguments if len(arguments) <= 40 else arguments[:37] + "..."
            terminalreporter.write_line(
                f"{line['seconds']:8.1f}s {line['cpu_seconds']:7.1f} CPU-s "
                f"{line['script']} {arguments} {settings}".rstrip())


def pytest_collection_modifyitems(config, items):
    """The modules that declare Horovod jobs (``HOROVOD_JOBS``) are in the slow tier, all
    their tests, and run last: the other tests run while those jobs train (they start
    with the session: ``_start_horovod_jobs``)."""
    for item in items:
        if _declares_jobs(item):
            item.add_marker(pytest.mark.slow)
    items.sort(key=_declares_jobs)


def _declares_jobs(item) -> bool:
    return bool(getattr(getattr(item, "module", None), "HOROVOD_JOBS", None))


@pytest.fixture(scope="session")
def horovod_graphs(request, tmp_path_factory):
    """Every Horovod graph that the selected tests' modules declare (a module-level
    ``HOROVOD_GRAPHS = {name: script}``, each script writing a GraphDef to argv[1]), built
    in one one-rank Gloo process: name -> tf.compat.v1.GraphDef (``.paths``: name -> the
    file it was written to). Names are global."""
    import tensorflow as tf

    from helpers import build_horovod_graphs
    paths = build_horovod_graphs(_declared(request, "HOROVOD_GRAPHS"), tmp_path_factory.mktemp("horovod_graphs"))
    graphs = _Graphs()
    graphs.paths = paths
    for name, path in paths.items():
        graphs[name] = tf.compat.v1.GraphDef()
        graphs[name].ParseFromString(path.read_bytes())
    return graphs


def _declared(request, attribute: str) -> dict:
    """The ``attribute`` dicts of the selected tests' modules, merged (names are global)."""
    declared = {}
    modules = {getattr(item, "module", None) for item in request.session.items}
    for module in sorted(modules - {None}, key=lambda module: module.__name__):
        for name, value in getattr(module, attribute, {}).items():
            assert declared.setdefault(name, value) == value, f"two {attribute} named {name}"
    return declared


class _Graphs(dict):
    paths: dict


@pytest.fixture(scope="session")
def horovod_jobs(request, tmp_path_factory):
    """Runs the Horovod job scripts that the selected tests' modules declare (a
    module-level ``HOROVOD_JOBS = {name: helpers.HorovodJob}``; names are global): every
    job of the same ranks and controller in one Horovod job. The jobs start with the
    session's first test and train while the other tests run (their modules' tests run
    last). ``horovod_jobs(name)`` waits for its job and is the directory its records
    were written to; ``horovod_jobs.records(name)`` each rank's JSON record in it."""
    return _HorovodJobs(_declared(request, "HOROVOD_JOBS"), tmp_path_factory)


@pytest.fixture(scope="session", autouse=True)
def _start_horovod_jobs(request):
    """Starts the selected modules' Horovod jobs with the session (none: nothing), and
    kills those still running when it ends (stopped early: -x, Ctrl-C, a deselected
    module), instead of leaving their ranks to train on, orphaned."""
    if not _declared(request, "HOROVOD_JOBS"):
        yield
        return
    jobs = request.getfixturevalue("horovod_jobs")
    jobs.start()
    yield
    jobs.stop()


class _HorovodJobs:
    def __init__(self, declared: dict, tmp_path_factory):
        self.declared, self.tmp_path_factory = declared, tmp_path_factory
        self.directories, self.failures, self.finished = {}, {}, {}
        self.networks: list = []      # the running jobs' networks

    def groups(self) -> dict:
        """(ranks, controller, process) -> its job names; those that turn eager execution
        off after those that need it (they share a process)."""
        groups = {}
        for name, job in sorted(self.declared.items(), key=lambda item: item[1].disables_eager):
            groups.setdefault((job.ranks, job.controller, job.process), []).append(name)
        return groups

    def start(self) -> None:
        """Starts every group's job at once, each waited for by a thread of its own: the
        jobs start before any test can change the environment they inherit. Their
        directories are made here: pytest does not make its temporary directories safely
        from two threads at once."""
        import threading
        times = self.tmp_path_factory.getbasetemp() / "horovod_job_times.jsonl"
        if times not in _JOB_TIMES:
            _JOB_TIMES.append(times)
        for group, members in self.groups().items():
            if group in self.finished:
                continue
            self.finished[group] = threading.Event()
            for member in members:
                self.directories[member] = self.tmp_path_factory.mktemp(member)
            threading.Thread(target=self._run, args=(group, members, times), daemon=True,
                             name=f"horovod_jobs {group}").start()

    def _run(self, group: tuple, members: list, times) -> None:
        from helpers import run_jobs_in_sequence
        ranks, controller, _ = group
        try:
            run_jobs_in_sequence(
                ranks, [(self.declared[member].script,
                         {**self.declared[member].env(self.directories[member]),
                          "IN_SEQUENCE_TIMEOUT": str(self.declared[member].timeout)},
                         self.declared[member].argv)
                        for member in members],
                timeout=sum(self.declared[member].timeout for member in members),
                controller=controller, times=times, networks=self.networks)
        except BaseException as error:  # noqa: BLE001 - raised in the tests that need it
            self.failures[group] = error
        self.finished[group].set()

    def stop(self) -> None:
        """Kills the jobs that still run (their networks' processes)."""
        for group, finished in self.finished.items():
            if not finished.is_set():
                print(f"\nhorovod_jobs: stopping the unfinished job of {group}",
                      file=sys.stderr)
        for network in list(self.networks):
            network.close()

    def __call__(self, name: str):
        job = self.declared[name]
        group = (job.ranks, job.controller, job.process)
        self.start()
        self.finished[group].wait()
        if group in self.failures:
            raise self.failures[group]
        return self.directories[name]

    def records(self, name: str, file: str = "rank-{rank}.json") -> list:
        """Each rank's JSON record of the job ``name`` (``file`` in its directory)."""
        directory = self(name)
        return [json.loads((directory / file.format(rank=rank)).read_text())
                for rank in range(self.declared[name].ranks)]
