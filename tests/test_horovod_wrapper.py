"""tfoverlap.horovod's cross_step on programs at the edge of its contract: fp16
compression, a NumPy learning rate, a variable without gradient, a sparse gradient, and
the deferred AllReduces kept out of the step's plan (tests/jobs/horovod_wrapper.py, in
the suite's one job of 2 Gloo ranks: conftest's ``horovod_jobs``; plus checks of the
refusals that need no job)."""
import os
import sys

import numpy as np
import pytest

from tests.helpers import HorovodJob

JOB = os.path.join(os.path.dirname(__file__), "jobs", "horovod_wrapper.py")


HOROVOD_JOBS = {"horovod_wrapper": HorovodJob(
    JOB, lambda directory: {"WRAPPER_RECORDS": str(directory)}, disables_eager=True)}


@pytest.fixture(scope="module")
def variants(horovod_jobs):
    """Each rank's record of each variant of the job."""
    return [record["variants"] for record in horovod_jobs.records("horovod_wrapper")]


def test_cross_step_with_fp16_compression_defers_and_trains_like_horovod(variants):
    """The AllReduce sits between fp16 compression's Casts: the stored gradient enters at
    the first Cast, and losses and flushed weights are Horovod's with fp16 compression."""
    for rank in variants:
        record = rank["fp16"]
        assert record["deferred"].get("deferred", 0) >= 1, record
        assert record["same_losses"] and record["same_final_weights"], record
        assert record["warnings"] == [], record


def test_the_deferred_allreduces_are_not_planned_as_a_bucket_of_the_step(variants):
    """The step's plan holds the gradients reduced in the step, not the deferred ones
    (reduced in the background run)."""
    for rank in variants:
        for name in ("momentum", "fp16"):
            record = rank[name]
            deferred = record["deferred"]
            assert deferred.get("deferred", 0) >= 1, record
            assert (record["caramel"]["allreduces"]
                    == deferred["gradients"] - deferred["deferred"]), record


def test_a_numpy_learning_rate_is_a_constant_and_is_deferred(variants):
    for rank in variants:
        record = rank["numpy_rate"]
        assert record["deferred"].get("deferred", 0) >= 1, record
        assert record["same_losses"] and record["same_final_weights"], record


def test_a_variable_without_gradient_is_named_as_such_not_as_sparse(variants):
    """One warning says which variable the loss does not reach, or which gradient is
    sparse, and what to do; the step is then planned on its own and trains like Horovod."""
    for rank in variants:
        unreached, sparse = rank["unreached"]["warnings"], rank["sparse"]["warnings"]
        assert len(unreached) == 1 and "unreached has no gradient" in unreached[0]
        assert "var_list" in unreached[0] and "sparse" not in unreached[0]
        assert len(sparse) == 1 and "gradient of sparse is sparse" in sparse[0]
        assert "sparse_as_dense=True" in sparse[0]
        for name in ("unreached", "sparse"):
            record = rank[name]
            assert record["deferred"] == {}, record
            assert record["same_losses"] and record["same_final_weights"], record


def _refused(rate, compression, optimizer="GradientDescentOptimizer") -> str:
    """Why an ``optimizer`` with learning rate ``rate`` ("tensor": a constant tensor) and
    one dense gradient reduced with ``compression`` would not be deferred."""
    import tensorflow as tf
    from tfoverlap.horovod.core.contract import reduction_of
    from tfoverlap.horovod.session.deferral import deferral_refused
    with tf.Graph().as_default():
        weight = tf.compat.v1.get_variable("w", [2], use_resource=True)
        optimizer = getattr(tf.compat.v1.train, optimizer)(
            tf.constant(0.1) if isinstance(rate, str) else rate)
        return deferral_refused(optimizer, [weight], [tf.ones([2])],
                                reduction_of(compression=compression))


@pytest.mark.parametrize("rate", [0.1, np.float32(0.1), np.array(0.1), lambda: 0.1,
                                  "tensor"], ids=["float", "float32", "0-d array",
                                                  "callable", "tensor"])
def test_a_learning_rate_of_any_kind_is_deferred(rate):
    """The rate is read in the step the gradient comes from and stored with it."""
    import horovod.tensorflow as hvd
    assert _refused(rate, hvd.Compression.none) == ""


def test_an_optimizer_whose_update_is_not_known_is_refused_by_name():
    import horovod.tensorflow as hvd
    refused = _refused(0.1, hvd.Compression.none, "RMSPropOptimizer")
    assert refused.startswith("RMSPropOptimizer: only GradientDescentOptimizer, "
                              "MomentumOptimizer, AdamOptimizer are deferred"), refused


def test_a_compression_other_than_horovods_is_refused_by_name():
    import horovod.tensorflow as hvd

    class Scaled(hvd.Compression.none):
        pass

    assert _refused(0.1, hvd.Compression.fp16) == ""
    refused = _refused(0.1, Scaled)
    assert refused.startswith("compression Scaled: only Horovod's none and fp16"), refused


@pytest.mark.parametrize("carried_out, options, named", [
    ((), {"cross_step": True}, "cross_step"),
    (("cross_step",), {"cross_step": True}, None),         # Keras' model.fit
    ((), {"cross_step": False}, None),
    (("cross_step",), {"cross_step": True, "profile_steps": 3}, "profile_steps"),
])
def test_a_tf_function_step_names_the_options_it_does_not_carry_out(caplog, carried_out,
                                                                    options, named):
    """A tape's tf.function step is planned within the step: cross_step or profile_steps
    asked for get one warning naming them; Keras' wrapper, which defers itself, none."""
    import logging
    import tfoverlap.horovod as tfo_hvd
    from tfoverlap.horovod.adapters.horovods import enable_for_functions
    from tfoverlap.integrations.tf_function import get_function_config, set_function_config
    previous = get_function_config()
    tfo_hvd.configure(bandwidth=1e9, latency=1e-5, flops=1e12, threads=2, cycle_ms=1.0,
                      **options)
    try:
        with caplog.at_level(logging.WARNING, logger="tfoverlap"):
            enable_for_functions(carried_out)
    finally:
        set_function_config(previous)
        tfo_hvd.configure()
    warnings = [r.getMessage() for r in caplog.records if r.levelno >= logging.WARNING]
    if named is None:
        assert warnings == []
    else:
        assert len(warnings) == 1 and warnings[0].startswith(f"tfoverlap: {named} asked for")



TAPE_IMPORTED_FIRST = """
import tfoverlap.horovod as tfo_hvd      # before TensorFlow, as a program may
import tensorflow as tf
import horovod.tensorflow as hvd
hvd.init()
weight = tf.Variable(tf.ones([4, 4]))
optimizer = tf.keras.optimizers.SGD(0.1)

@tf.function
def step(x):
    with tf.GradientTape() as tape:
        loss = tf.reduce_sum(tf.matmul(x, weight))
    tape = tfo_hvd.DistributedGradientTape(tape)
    optimizer.apply_gradients(zip(tape.gradient(loss, [weight]), [weight]))
    return loss

print("losses", float(step(tf.ones([2, 4]))), float(step(tf.ones([2, 4]))))
"""


def test_a_tape_made_inside_a_tf_function_step_runs_when_tfoverlap_came_before_tensorflow():
    """tfoverlap.horovod imported before TensorFlow loads the Grappler plugin on the first
    wrapper call, which a TF2 step makes inside its tf.function. AutoGraph converted that
    code once, and the plugin's callback did not outlive it: Grappler's first call crashed
    the process. The wrappers run as written, and the step trains (one rank)."""
    import subprocess
    result = subprocess.run([sys.executable, "-c", TAPE_IMPORTED_FIRST], capture_output=True,
                            text=True, timeout=300)
    assert result.returncode == 0, result.stderr[-3000:]
    assert "losses 32.0 25.6" in result.stdout, result.stdout
