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
    scripts = {}
    modules = {getattr(item, "module", None) for item in request.session.items}
    for module in sorted(modules - {None}, key=lambda module: module.__name__):
        for name, script in getattr(module, "HOROVOD_GRAPHS", {}).items():
            assert scripts.setdefault(name, script) == script, f"two graphs named {name}"
    paths = build_horovod_graphs(scripts, tmp_path_factory.mktemp("horovod_graphs"))
    graphs = _Graphs()
    graphs.paths = paths
    for name, path in paths.items():
        graphs[name] = tf.compat.v1.GraphDef()
        graphs[name].ParseFromString(path.read_bytes())
    return graphs


class _Graphs(dict):
    paths: dict
