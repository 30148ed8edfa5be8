"""A Horovod job for tests/test_tape_decoupled.py: TF2 custom training loops (a
``DistributedGradientTape`` step in a loop inside one ``tf.function``) trained with
horovod.tensorflow's tape and with tfoverlap.horovod's under ``configure(decouple=True)``
(reduce-scatter, sharded update, all-gather under the next forward pass), from the same
initial weights, on two models and Keras' decouplable optimizers.

Each run is CALLS calls of STEPS steps ($TAPE_DECOUPLED_STEPS, default 100 in all).
Between calls the program reads the weights, and rank 0 alone evaluates a loss (no
collective may start). Also: patterns outside the contract (refused, trained as Horovod),
an iterator that runs out, a read after the update (a clear error), "auto", and a
checkpoint of the optimizer. Writes one JSON record per rank ($TAPE_DECOUPLED_RECORDS/
rank-N.json): per run and variant, the losses, the weights seen between calls, rank 0's
evaluations, the final weights and whole optimizer slots, the step counter, the bytes of
optimizer state on this rank, the decisions, tfoverlap's warnings and any error.
"""
import json
import logging
import os
import sys

import numpy as np
import tensorflow as tf
import horovod.tensorflow as hvd  # noqa: E402

import tfoverlap.horovod as tfo_hvd  # noqa: E402
from tfoverlap.horovod.pipeline import recent_decisions  # noqa: E402
from tfoverlap.horovod.tape_decoupled import shard_state_bytes, whole_slots  # noqa: E402
from job_logging import Warnings  # noqa: E402 - this directory

# A slow link and slow compute: the plan has a backward pass to overlap.
OPTIONS = dict(bandwidth="100Mbit", latency=50e-6, flops=2.5e8, force=True)
TOTAL = int(os.environ.get("TAPE_DECOUPLED_STEPS", "100"))
CALLS = 4
STEPS = TOTAL // CALLS
BATCH = 16
RUNS = ("chain/sgd", "chain/momentum", "chain/adam", "chain/adamw", "chain/legacy_momentum",
        "chain/legacy_adam", "chain/schedule", "convnet/momentum", "convnet/adam")
#: (name, model/optimizer, what is different)
PATTERNS = ("input_runs_out", "built_first", "clipped", "late_read", "checkpoint", "auto")

hvd.init()
RANK = hvd.rank()
data = np.random.default_rng(100 + RANK)
INPUTS = tf.constant(data.normal(size=(TOTAL, BATCH, 64)).astype(np.float32))
LABELS = tf.constant(data.integers(0, 10, size=(TOTAL, BATCH)))
VALIDATION = np.random.default_rng(999).normal(size=(BATCH, 64)).astype(np.float32)
LOSS = tf.keras.losses.SparseCategoricalCrossentropy(from_logits=True)


def model_for(name):
    """chain: dense layers whose sizes do not divide by the ranks; convnet: two
    convolutions and a dense layer."""
    tf.keras.utils.set_random_seed(7)
    if name == "chain":
        layers = [tf.keras.layers.Dense(width, activation="relu", name=f"dense{index}")
                  for index, width in enumerate((61, 64, 33))]
    else:
        layers = [tf.keras.layers.Reshape((8, 8, 1)),
                  tf.keras.layers.Conv2D(8, 3, padding="same", activation="relu",
                                         name="conv0"),
                  tf.keras.layers.Conv2D(16, 3, padding="same", activation="relu",
                                         name="conv1"),
                  tf.keras.layers.Flatten()]
    return tf.keras.Sequential([tf.keras.Input((64,))] + layers
                               + [tf.keras.layers.Dense(10, name="logits")])


def optimizer_for(name):
    keras = tf.keras.optimizers
    return {"sgd": lambda: keras.SGD(0.05),
            "momentum": lambda: keras.SGD(0.05, momentum=0.9),
            "adam": lambda: keras.Adam(0.003),
            "adamw": lambda: keras.AdamW(0.003, weight_decay=0.05),
            "legacy_momentum": lambda: keras.legacy.SGD(0.05, momentum=0.9),
            "legacy_adam": lambda: keras.legacy.Adam(0.003),
            "schedule": lambda: keras.SGD(keras.schedules.ExponentialDecay(0.1, 10, 0.7),
                                          momentum=0.9),
            "clipped": lambda: keras.SGD(0.05, momentum=0.9, global_clipnorm=1.0)}[name]()


def train_function(pattern, model, optimizer, tape_wrapper):
    """The program's loop of STEPS steps per call; returns the call's losses."""
    def step(inputs, labels):
        with tf.GradientTape() as tape:
            loss = LOSS(labels, model(inputs, training=True))
        tape = tape_wrapper(tape)
        gradients = tape.gradient(loss, model.trainable_variables)
        optimizer.apply_gradients(zip(gradients, model.trainable_variables))
        if pattern == "late_read":
            loss += 0.0 * tf.reduce_sum(model.trainable_variables[0])
        return loss

    if pattern == "input_runs_out":
        # 2 batches short: next() raises inside the last call, after STEPS - 2 steps.
        batches = iter(tf.data.Dataset.from_tensor_slices((INPUTS, LABELS)).take(TOTAL - 2))

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


def slots_of(model, optimizer, variant) -> dict:
    """{variable name: {slot name: values}}: the whole optimizer state."""
    if variant == "tfoverlap":
        gathered = whole_slots(optimizer)
        if gathered:
            return {v.name: {name: np.asarray(value).ravel().tolist()
                             for name, value in gathered[v.ref()].items()}
                    for v in model.trainable_variables}
    state = {}
    for v in model.trainable_variables:
        if isinstance(optimizer, tf.keras.optimizers.Optimizer):
            suffix = f"/{v._shared_name}:0"
            slots = {s.name[:-len(suffix)].rsplit("/", 1)[-1]: s
                     for s in optimizer.variables[1:] if s.name.endswith(suffix)}
        else:
            slots = {name: optimizer.get_slot(v, name) for name in optimizer.get_slot_names()}
        state[v.name] = {name: np.asarray(s).ravel().tolist() for name, s in slots.items()}
    return state


def state_bytes(optimizer, variant) -> int:
    """The bytes of the optimizer's slots on this rank."""
    if variant == "tfoverlap" and shard_state_bytes(optimizer):
        return shard_state_bytes(optimizer)
    variables = optimizer.variables
    variables = variables() if callable(variables) else variables
    return sum(int(np.prod(v.shape)) * 4 for v in variables if v.shape.rank)


def train(run, pattern, variant):
    model_name, optimizer_name = run.split("/")
    wrapper = (tfo_hvd.DistributedGradientTape if variant == "tfoverlap"
               else hvd.DistributedGradientTape)
    model, optimizer = model_for(model_name), optimizer_for(optimizer_name)
    hvd.broadcast_variables(model.variables, root_rank=0)
    if pattern == "built_first":
        optimizer.build(model.trainable_variables)
    record = {"losses": [], "seen": [], "rank0_evaluate": []}
    function = train_function(pattern, model, optimizer, wrapper)
    for call in range(CALLS):
        try:
            record["losses"].append(function(tf.constant(call * STEPS)).numpy().tolist())
        except tf.errors.OutOfRangeError:       # input_runs_out: the program's end of data
            record["losses"].append("out of range")
        record["seen"].append([w.ravel()[:8].tolist() for w in model.get_weights()])
        if RANK == 0:   # rank 0 alone evaluates between calls: no collective may start
            record["rank0_evaluate"].append(
                float(tf.reduce_sum(model(VALIDATION, training=False))))
        if pattern == "checkpoint" and call == 0:
            checkpoint = tf.train.Checkpoint(model=model, optimizer=optimizer)
            try:
                checkpoint.write(os.path.join(os.environ.get("TAPE_DECOUPLED_RECORDS", "/tmp"),
                                              f"tape-{variant}-{RANK}"))
                record["saved"] = True
            except ValueError as error:
                record["save_refused"] = str(error)
    record["weights"] = [w.ravel().tolist() for w in model.get_weights()]
    record["slots"] = slots_of(model, optimizer, variant)
    record["iterations"] = int(optimizer.iterations)
    record["state_bytes"] = state_bytes(optimizer, variant)
    return record


def main():
    warnings = Warnings()
    logging.getLogger("tfoverlap").addHandler(warnings)
    runs = [(run, "exact") for run in RUNS] + [
        ("chain/momentum", pattern) for pattern in PATTERNS if pattern != "clipped"] + [
        ("chain/clipped", "clipped")]
    records = {}
    for run, pattern in runs:
        name = run if pattern == "exact" else f"{run}/{pattern}"
        records[name] = {}
        tfo_hvd.configure(**OPTIONS, cross_step=False,
                          decouple="auto" if pattern == "auto" else True)
        for variant in ("horovod", "tfoverlap"):
            warnings.messages.clear()
            decided = len(recent_decisions())
            try:
                record = train(run, pattern, variant)
            except Exception as error:  # noqa: BLE001 - the test reads it
                record = {"error": f"{type(error).__name__}: {error}"}
            record["decisions"] = recent_decisions()[decided:]
            record["warnings"] = list(warnings.messages)
            records[name][variant] = record
    out = os.environ.get("TAPE_DECOUPLED_RECORDS")
    if out:
        with open(os.path.join(out, f"rank-{RANK}.json"), "w") as f:
            json.dump(records, f)
    print(json.dumps({"rank": RANK, "runs": sorted(records)}))


if __name__ == "__main__":
    main()
