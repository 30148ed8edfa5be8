import json
import os

import pytest

os.environ.setdefault("TF_CPP_MIN_LOG_LEVEL", "2")

#: Files whose tests run multi-rank Horovod jobs: all their tests are in the slow tier.
SLOW_FILES = {"test_cross_step.py", "test_decoupled.py", "test_tape_decoupled.py",
              "test_horovod_wrapper.py", "test_contract_matrix.py"}


def pytest_collection_modifyitems(config, items):
    for item in items:
        if os.path.basename(str(item.fspath)) in SLOW_FILES:
            item.add_marker(pytest.mark.slow)


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
    job of the same ranks and controller in one Horovod job, the first time one of them is
    asked for. ``horovod_jobs(name)`` is the directory its records were written to;
    ``horovod_jobs.records(name)`` each rank's JSON record in it."""
    return _HorovodJobs(_declared(request, "HOROVOD_JOBS"), tmp_path_factory)


class _HorovodJobs:
    def __init__(self, declared: dict, tmp_path_factory):
        self.declared, self.tmp_path_factory = declared, tmp_path_factory
        self.directories, self.failures = {}, {}

    def __call__(self, name: str):
        from helpers import run_jobs_in_sequence
        job = self.declared[name]
        group = (job.ranks, job.controller)
        if group in self.failures:      # the group's job failed once: not run again
            raise self.failures[group]
        if name not in self.directories:
            # Scripts that turn eager execution off run after those that need it.
            members = sorted((member for member, other in self.declared.items()
                              if (other.ranks, other.controller) == group),
                             key=lambda member: self.declared[member].disables_eager)
            directories = {member: self.tmp_path_factory.mktemp(member) for member in members}
            try:
                run_jobs_in_sequence(
                    job.ranks, [(self.declared[member].script,
                                 self.declared[member].env(directories[member]))
                                for member in members],
                    timeout=sum(self.declared[member].timeout for member in members),
                    controller=job.controller)
            except BaseException as error:
                self.failures[group] = error
                raise
            self.directories.update(directories)
        return self.directories[name]

    def records(self, name: str, file: str = "rank-{rank}.json") -> list:
        """Each rank's JSON record of the job ``name`` (``file`` in its directory)."""
        directory = self(name)
        return [json.loads((directory / file.format(rank=rank)).read_text())
                for rank in range(self.declared[name].ranks)]
