"""A Horovod job for tests/test_tape_decoupled.py: Keras ``model.fit`` trained with
horovod.tensorflow.keras and with tfoverlap.horovod.keras under
``configure(decouple=True)``, from the same initial weights (the models and optimizers of
tape_decoupled.py), with 5 steps per call of the train function, 2 epochs of 50 steps.

A ModelCheckpoint on rank 0 alone writes the weights in TensorFlow's format after each
epoch (the sharded state is gathered at the epoch's end on every rank). Writes one JSON
record per rank ($TAPE_DECOUPLED_RECORDS/keras-rank-N.json): per run and variant, the
losses after each call, the weights a callback read, the checkpoints (every tensor), the
final weights and whole optimizer slots, the step counter, the bytes of optimizer state
on this rank, the decision, tfoverlap's warnings, what an .h5 save said, and any error.
"""
import json
import logging
import os

import numpy as np
import tensorflow as tf
import horovod.tensorflow.keras as hvd_keras  # noqa: E402

import tfoverlap.horovod as tfo_hvd  # noqa: E402
import tfoverlap.horovod.keras as tfo_keras  # noqa: E402
from job_logging import Warnings  # noqa: E402 - this directory
from tape_decoupled import (OPTIONS, SHARED, model_for, optimizer_for,  # noqa: E402
                            slots_of, state_bytes)

RUNS = ("chain/momentum", "chain/adam", "convnet/adam", "chain/legacy_adam")
BATCH, STEPS_PER_EPOCH, EPOCHS, PER_CALL = 16, 50, 2, 5

hvd_keras.init()
RANK = hvd_keras.rank()
data = np.random.default_rng(300 + RANK)
INPUTS = data.normal(size=(STEPS_PER_EPOCH * BATCH, 64)).astype(np.float32)
LABELS = data.integers(0, 10, size=(STEPS_PER_EPOCH * BATCH,))


def train(run, variant) -> dict:
    model_name, optimizer_name = run.split("/")
    distributed = tfo_keras if variant == "tfoverlap" else hvd_keras
    model = model_for(model_name)
    model.compile(optimizer=distributed.DistributedOptimizer(optimizer_for(optimizer_name)),
                  loss=tf.keras.losses.SparseCategoricalCrossentropy(from_logits=True),
                  steps_per_execution=PER_CALL)
    record = {"losses": [], "seen": []}

    class Look(tf.keras.callbacks.Callback):
        """What user code sees between calls: the loss and some weights."""

        def on_train_batch_end(self, batch, logs=None):
            record["losses"].append(float(logs["loss"]))
            record["seen"].append(self.model.get_weights()[0].ravel()[:8].tolist())

    prefix = os.path.join(SHARED, f"keras-{run.replace('/', '-')}-{variant}")
    callbacks = [hvd_keras.callbacks.BroadcastGlobalVariablesCallback(0), Look()]
    if RANK == 0:
        callbacks.append(tf.keras.callbacks.ModelCheckpoint(prefix + "-{epoch}",
                                                            save_weights_only=True))
    model.fit(INPUTS, LABELS, batch_size=BATCH, epochs=EPOCHS, shuffle=False, verbose=0,
              callbacks=callbacks)
    if RANK == 0:
        reader = tf.train.load_checkpoint(prefix + "-1")
        record["checkpoint"] = {name: reader.get_tensor(name).ravel().tolist()
                                for name in sorted(reader.get_variable_to_shape_map())
                                if not name.startswith("_CHECKPOINTABLE")}
        try:
            model.save(prefix + ".h5")
            record["h5"] = "written"
        except ValueError as error:
            record["h5"] = str(error)
    record["weights"] = [w.ravel().tolist() for w in model.get_weights()]
    record["slots"] = slots_of(model, model.optimizer, variant)
    record["iterations"] = int(model.optimizer.iterations)
    record["state_bytes"] = state_bytes(model.optimizer, variant)
    record["decision"] = tfo_keras.cross_step_decision(model) if variant == "tfoverlap" else None
    return record


def main():
    warnings = Warnings()
    logging.getLogger("tfoverlap").addHandler(warnings)
    tfo_hvd.configure(**OPTIONS, cross_step=False, decouple=True)
    records = {}
    for run in RUNS:
        records[run] = {}
        for variant in ("horovod", "tfoverlap"):
            warnings.messages.clear()
            try:
                record = train(run, variant)
            except Exception as error:  # noqa: BLE001 - the test reads it
                record = {"error": f"{type(error).__name__}: {error}"}
            record["warnings"] = list(warnings.messages)
            records[run][variant] = record
    with open(os.path.join(SHARED, f"keras-rank-{RANK}.json"), "w") as f:
        json.dump(records, f)
    print(json.dumps({"rank": RANK, "runs": sorted(records)}))


if __name__ == "__main__":
    main()
