"""A Horovod job for tests/test_cross_step.py: TF2 custom training loops, a
``DistributedGradientTape`` step in a loop inside one ``tf.function``, each trained with
horovod.tensorflow's tape and with tfoverlap.horovod's (cross-step overlap) from the same
initial weights, on a chain of dense layers whose first layers' reductions are deferred.

argv: the patterns to run (default: all of :data:`PATTERNS`). Writes one JSON record per
rank: per pattern and variant, the losses of each call, what the program read between
calls (the weights, a loss evaluated on rank 0 alone, a checkpoint), the final weights
and optimizer variables, the decisions, tfoverlap's warnings and any error.
"""
import json
import logging
import os
import sys
import tempfile

import numpy as np
import tensorflow as tf
import horovod.tensorflow as hvd  # noqa: E402

import tfoverlap.horovod as tfo_hvd  # noqa: E402
from tfoverlap.horovod.core.decisions import recent_decisions  # noqa: E402
from job_logging import Warnings  # noqa: E402 - this directory
from keras_optimizers import optimizer_for  # noqa: E402 - this directory

#: "what the program does/its optimizer" (the optimizer alone where the name is one): each
#: optimizer is tried once, beside one of the program's features. Not AdamW where the input
#: runs out: its decay does not wait for the gradient, and plain TensorFlow applies it to
#: some variables in the step that found no input, before the error ends the step.
PATTERNS = ("between_calls/sgd", "schedule", "iterator/legacy_adam", "input_runs_out/adam",
            "checkpoint/adamw", "one_step_per_call", "clip_global_norm", "late_read",
            "auto")
# A slow link and slow compute: the plan's ring has a tail to defer.
OPTIONS = dict(bandwidth="4Mbit", latency=50e-6, flops=1e7, force=True,
               cycle_ms=1)  # planned for 1 ms: the job cycles at 10 (tests/helpers.py)
WIDTHS = [64, 64, 64, 10]
BATCH, STEPS, CALLS = 32, 4, 2
CHECKPOINTS = os.environ.get("CROSS_STEP_CHECKPOINTS") or tempfile.mkdtemp()

hvd.init()
RANK = hvd.rank()
data = np.random.default_rng(100 + RANK)
INPUTS = tf.constant(data.normal(size=(STEPS * CALLS, BATCH, 64)).astype(np.float32))
LABELS = tf.constant(data.integers(0, 10, size=(STEPS * CALLS, BATCH)))
VALIDATION = np.random.default_rng(999).normal(size=(BATCH, 64)).astype(np.float32)
LOSS = tf.keras.losses.SparseCategoricalCrossentropy(from_logits=True)


def model_for():
    tf.keras.utils.set_random_seed(7)
    return tf.keras.Sequential([tf.keras.Input((64,))] + [
        tf.keras.layers.Dense(width, activation="relu" if i < len(WIDTHS) - 1 else None,
                              name=f"dense{i}") for i, width in enumerate(WIDTHS)])


def train_function(pattern, model, optimizer, tape_wrapper):
    """The program's step, in a loop of STEPS steps per call (one step per call for
    one_step_per_call); returns the losses of the call."""
    def step(inputs, labels):
        with tf.GradientTape() as tape:
            loss = LOSS(labels, model(inputs, training=True))
        tape = tape_wrapper(tape)
        gradients = tape.gradient(loss, model.trainable_variables)
        if pattern == "clip_global_norm":
            gradients, _ = tf.clip_by_global_norm(gradients, 0.5)
        optimizer.apply_gradients(zip(gradients, model.trainable_variables))
        if pattern == "late_read":
            loss += 0.0 * tf.reduce_sum(model.trainable_variables[0])
        return loss

    if pattern == "one_step_per_call":
        @tf.function
        def one_step(first):
            return tf.reshape(step(INPUTS[first], LABELS[first]), [1])
        return lambda first: tf.concat([one_step(first + i) for i in range(STEPS)], 0)

    if pattern in ("iterator", "input_runs_out"):
        dataset = tf.data.Dataset.from_tensor_slices((INPUTS, LABELS))
        # input_runs_out: 2 batches short; next() raises inside the last call, after 2
        # of its steps.
        batches = iter(dataset.repeat() if pattern == "iterator" else dataset.take(
            STEPS * CALLS - 2))

        @tf.function
        def loop_over_iterator(first):
            losses = tf.TensorArray(tf.float32, size=STEPS)
            for i in tf.range(STEPS):
                inputs, labels = next(batches)
                losses = losses.write(i, step(inputs, labels))
            return losses.stack()
        return loop_over_iterator

    @tf.function
    def loop(first):
        losses = tf.TensorArray(tf.float32, size=STEPS)
        for i in tf.range(STEPS):
            losses = losses.write(i, step(INPUTS[first + i], LABELS[first + i]))
        return losses.stack()
    return loop


def weights_sum(model):
    return float(sum(np.sum(w, dtype=np.float64) for w in model.get_weights()))


def train(pattern, variant):
    pattern, _, optimizer_name = pattern.partition("/")
    optimizer_name = optimizer_name or pattern
    wrapper = (tfo_hvd.DistributedGradientTape if variant == "tfoverlap"
               else hvd.DistributedGradientTape)
    model, optimizer = model_for(), optimizer_for(optimizer_name)
    hvd.broadcast_variables(model.variables, root_rank=0)
    record = {"losses": [], "seen": []}
    function = train_function(pattern, model, optimizer, wrapper)
    for call in range(CALLS):
        try:
            record["losses"].append(function(tf.constant(call * STEPS)).numpy().tolist())
        except tf.errors.OutOfRangeError:       # input_runs_out: the program's end of data
            record["losses"].append("out of range")
            record["batches"] = STEPS * CALLS - 2
        record["seen"].append(weights_sum(model))    # what user code reads between calls
        if pattern == "between_calls" and RANK == 0:
            # Rank 0 alone evaluates between calls: no collective may start.
            record.setdefault("rank0_evaluate", []).append(
                float(tf.reduce_sum(model(VALIDATION, training=False))))
        if pattern == "checkpoint" and call == 0:
            # A checkpoint after the first call, a fresh model and optimizer restored from
            # it and broadcast, then the second call: what a restarted job does.
            path = os.path.join(CHECKPOINTS, f"tape-{variant}-{RANK}")
            written = tf.train.Checkpoint(model=model, optimizer=optimizer).write(path)
            reader = tf.train.load_checkpoint(written)
            record["checkpoint"] = {name: reader.get_tensor(name).ravel()[:6].tolist()
                                    for name in sorted(reader.get_variable_to_shape_map())
                                    if not name.startswith("_CHECKPOINTABLE")}
            model, optimizer = model_for(), optimizer_for(optimizer_name)
            optimizer.build(model.trainable_variables)
            tf.train.Checkpoint(model=model, optimizer=optimizer).read(written)
            hvd.broadcast_variables(model.variables + optimizer.variables, root_rank=0)
            function = train_function(pattern, model, optimizer, wrapper)
    record["weights"] = [w.ravel().tolist() for w in model.get_weights()]
    variables = optimizer.variables
    record["optimizer"] = [np.asarray(v).ravel().tolist()
                           for v in (variables() if callable(variables) else variables)]
    return record


def main(patterns):
    warnings = Warnings()
    logging.getLogger("tfoverlap").addHandler(warnings)
    records = {}
    for pattern in patterns:
        records[pattern] = {}
        # "auto" with a gain this chain cannot reach: the plan declines and says why.
        tfo_hvd.configure(**OPTIONS, **({"cross_step": "auto", "min_gain": 0.5}
                                        if pattern == "auto" else {"cross_step": True}))
        for variant in ("horovod", "tfoverlap"):
            warnings.messages.clear()
            decided = len(recent_decisions())
            try:
                record = train(pattern, variant)
            except Exception as error:  # noqa: BLE001 - the test reads it
                record = {"error": f"{type(error).__name__}: {error}"}
            record["decisions"] = recent_decisions()[decided:]
            record["warnings"] = list(warnings.messages)
            records[pattern][variant] = record
    out = os.environ.get("CROSS_STEP_RECORDS")
    if out:
        with open(os.path.join(out, f"rank-{RANK}.json"), "w") as f:
            json.dump(records, f)
    print(json.dumps({"rank": RANK, "patterns": sorted(records)}))


if __name__ == "__main__":
    main(sys.argv[1:] or PATTERNS)
