"""The examples under examples/ run, a few steps each, as their docstrings say.

(examples/tf1_ps_train.py and examples/tf2_ps_strategy_train.py run in
tests/test_launcher.py, with and without tfoverlap run.)
"""
import json
import os
import sys

import numpy as np
import pytest

from tfoverlap.testbed.horovod_launch import run_horovod
from tfoverlap.testbed.network import EmulatedNetwork

ROOT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
TF2 = os.path.join(ROOT, "examples", "horovod_tf2_train.py")
KERAS = os.path.join(ROOT, "examples", "horovod_keras_train.py")
LAUNCH = [sys.executable, "-m", "tfoverlap", "run"]


pytestmark = pytest.mark.slow     # every test here is a Horovod job


@pytest.fixture(scope="module")
def network():
    with EmulatedNetwork(2, bandwidth=1.25e9) as emulated:
        yield emulated


def _losses(result):
    assert result.returncode == 0, [o[-3000:] for o in result.outputs]
    lines = [line for line in result.outputs[0].splitlines() if line.startswith("{")]
    losses = json.loads(lines[-1])["losses"]
    assert len(losses) > 0 and np.isfinite(losses).all()
    return losses


def test_horovod_tf2_example_and_a_plain_horovod_program_under_tfoverlap_run(network):
    dropin = _losses(run_horovod(network, 2, [sys.executable, TF2, "--steps", "4"]))
    plain = _losses(run_horovod(network, 2, [sys.executable, TF2, "--steps", "4", "--plain"]))
    np.testing.assert_allclose(dropin, plain, rtol=1e-5)
    launched = run_horovod(network, 2, LAUNCH + [
        "--allreduce", "caramel", "--schedule", "none", "--force", "true", "--",
        sys.executable, TF2, "--steps", "4", "--plain"])
    np.testing.assert_allclose(_losses(launched), plain, rtol=1e-5)
    for output in launched.outputs:    # one summary line per rank: the pass planned
        lines = [line for line in output.splitlines() if line.startswith("tfoverlap [")]
        assert len(lines) == 1 and "AllReduce buckets" in lines[0], output[-2000:]


def test_horovod_keras_example(network):
    """With Gloo, as its docstring runs it (tfoverlap.horovod.keras under MPI:
    tests/test_caramel_training.py)."""
    _losses(run_horovod(network, 2, [sys.executable, KERAS, "--steps", "4"],
                        controller="gloo"))
