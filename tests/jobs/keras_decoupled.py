"""A Horovod job for tests/test_tape_decoupled.py: Keras ``model.fit`` trained with
horovod.tensorflow.keras and with tfoverlap.horovod.keras under
``configure(decouple=True)``, from the same initial weights (the models and optimizers of
tape_decoupled.py), with 5 steps per call of the train function, 2 epochs of 50 steps.
In the run whose name ends in "/input_runs_out", a tf.data input of 50 batches meets 2
epochs of 28 steps: it runs out 2 steps into the last call (Keras stops training there).

Two ModelCheckpoints on rank 0 alone write the weights in TensorFlow's format, one after
each epoch, one every 15 batches (the sharded state is gathered on every rank where one
saves); after training rank 0 saves the model as .keras (and tries .h5). Then a new
model whose optimizer is built loads plain Horovod's .keras file and trains on (RESUMED).
Writes one JSON record per rank ($TAPE_DECOUPLED_RECORDS/keras-rank-N.json): per run and
variant, the losses after each call, the weights a callback read, the checkpoints and
the .keras file (every tensor), the final weights and whole optimizer slots, the step
counter, the bytes of optimizer state on this rank, the decision, tfoverlap's warnings,
what an .h5 save said, and any error.
"""
import io
import json
import logging
import os
import zipfile

import h5py

import numpy as np
import tensorflow as tf
import horovod.tensorflow.keras as hvd_keras  # noqa: E402

import tfoverlap.horovod as tfo_hvd  # noqa: E402
import tfoverlap.horovod.keras as tfo_keras  # noqa: E402
from job_logging import Warnings  # noqa: E402 - this directory
from tape_decoupled import (OPTIONS, SHARED, model_for, optimizer_for,  # noqa: E402
                            slots_of, state_bytes)

RUNS = ("chain/momentum", "convnet/adam", "chain/legacy_adam", "chain/adam/input_runs_out")
BATCH, STEPS_PER_EPOCH, EPOCHS, PER_CALL = 16, 50, 2, 5
RUNS_OUT_STEPS_PER_EPOCH = 28
#: runs whose .keras file (plain Horovod's) a new model loads into its built optimizer
RESUMED = ("convnet/adam",)

hvd_keras.init()
RANK = hvd_keras.rank()
data = np.random.default_rng(300 + RANK)
INPUTS = data.normal(size=(STEPS_PER_EPOCH * BATCH, 64)).astype(np.float32)
LABELS = data.integers(0, 10, size=(STEPS_PER_EPOCH * BATCH,))


def checkpoint_values(path) -> dict:
    reader = tf.train.load_checkpoint(path)
    return {name: reader.get_tensor(name).ravel().tolist()
            for name in sorted(reader.get_variable_to_shape_map())
            if not name.startswith("_CHECKPOINTABLE")}


def keras_file_values(path) -> dict:
    """Every array a .keras file holds (the model's and the optimizer's variables)."""
    values = {}
    with zipfile.ZipFile(path) as archive:
        with h5py.File(io.BytesIO(archive.read("model.weights.h5")), "r") as weights:
            weights.visititems(lambda name, item: values.__setitem__(
                name, np.asarray(item).ravel().tolist()) if isinstance(item, h5py.Dataset)
                else None)
    return values


def compiled(model_name, optimizer_name, variant):
    distributed = tfo_keras if variant == "tfoverlap" else hvd_keras
    model = model_for(model_name)
    model.compile(optimizer=distributed.DistributedOptimizer(optimizer_for(optimizer_name)),
                  loss=tf.keras.losses.SparseCategoricalCrossentropy(from_logits=True),
                  steps_per_execution=PER_CALL)
    return model


def trained_state(model, variant) -> dict:
    """The final weights, whole optimizer slots, step counter, this rank's bytes of
    optimizer state, and (tfoverlap) the decision."""
    return {"weights": [w.ravel().tolist() for w in model.get_weights()],
            "slots": slots_of(model, model.optimizer, variant),
            "iterations": int(model.optimizer.iterations),
            "state_bytes": state_bytes(model.optimizer, variant),
            "decision": (tfo_keras.cross_step_decision(model) if variant == "tfoverlap"
                         else None)}


def train(run, variant) -> dict:
    model_name, optimizer_name, *input_kind = run.split("/")
    model = compiled(model_name, optimizer_name, variant)
    record = {"losses": [], "seen": []}

    class Look(tf.keras.callbacks.Callback):
        """What user code sees between calls: the loss and some weights."""

        def on_train_batch_end(self, batch, logs=None):
            record["losses"].append(float(logs["loss"]))
            record["seen"].append(self.model.get_weights()[0].ravel()[:8].tolist())

    prefix = os.path.join(SHARED, f"keras-{run.replace('/', '-')}-{variant}")
    callbacks = [hvd_keras.callbacks.BroadcastGlobalVariablesCallback(0), Look()]
    if RANK == 0:
        callbacks += [tf.keras.callbacks.ModelCheckpoint(prefix + "-{epoch}",
                                                         save_weights_only=True),
                      tf.keras.callbacks.ModelCheckpoint(prefix + "-b{epoch}-{batch}",
                                                         save_weights_only=True,
                                                         save_freq=15)]
    if input_kind == ["input_runs_out"]:
        dataset = tf.data.Dataset.from_tensor_slices((INPUTS, LABELS)).batch(BATCH)
        model.fit(dataset, epochs=EPOCHS, steps_per_epoch=RUNS_OUT_STEPS_PER_EPOCH,
                  verbose=0, callbacks=callbacks)
    else:
        model.fit(INPUTS, LABELS, batch_size=BATCH, epochs=EPOCHS, shuffle=False, verbose=0,
                  callbacks=callbacks)
    if RANK == 0:
        record["checkpoint"] = checkpoint_values(prefix + "-1")
        record["batch_checkpoint"] = checkpoint_values(prefix + "-b1-15")
        model.save(prefix + ".keras")
        record["keras_file"] = keras_file_values(prefix + ".keras")
        try:
            model.save(prefix + ".h5")
            record["h5"] = "written"
        except ValueError as error:
            record["h5"] = str(error)
    return {**record, **trained_state(model, variant)}


def resumed(run, variant) -> dict:
    """A new model compiled, its optimizer built, then plain Horovod's .keras file of
    ``run`` loaded on every rank (Keras' "build, load") and trained one more epoch."""
    model_name, optimizer_name = run.split("/")
    model = compiled(model_name, optimizer_name, variant)
    model.optimizer.build(model.trainable_variables)
    model.load_weights(os.path.join(SHARED, f"keras-{run.replace('/', '-')}-horovod.keras"))
    record = {"losses": []}

    class Losses(tf.keras.callbacks.Callback):
        def on_train_batch_end(self, batch, logs=None):
            record["losses"].append(float(logs["loss"]))

    model.fit(INPUTS, LABELS, batch_size=BATCH, epochs=1, shuffle=False, verbose=0,
              callbacks=[Losses()])
    return {**record, **trained_state(model, variant)}


def main():
    warnings = Warnings()
    logging.getLogger("tfoverlap").addHandler(warnings)
    tfo_hvd.configure(**OPTIONS, cross_step=False, decouple=True)
    records = {}
    runs = [(run, train) for run in RUNS] + [(f"{run}/resumed", resumed) for run in RESUMED]
    for name, how in runs:      # every rank has joined collectives since rank 0 saved
        records[name] = {}      # the .keras files that the resumed runs load
        for variant in ("horovod", "tfoverlap"):
            warnings.messages.clear()
            try:
                record = how(name.removesuffix("/resumed"), variant)
            except Exception as error:  # noqa: BLE001 - the test reads it
                record = {"error": f"{type(error).__name__}: {error}"}
            record["warnings"] = list(warnings.messages)
            records[name][variant] = record
    with open(os.path.join(SHARED, f"keras-rank-{RANK}.json"), "w") as f:
        json.dump(records, f)
    print(json.dumps({"rank": RANK, "runs": sorted(records)}))


if __name__ == "__main__":
    main()
