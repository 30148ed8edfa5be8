"""A Horovod job for tests/test_contract_matrix.py: the wrappers' contract over
API x mechanism x Horovod's reduction arguments, in one job.

For each case (graph, tape or keras; cross_step or decouple; a reduction variant) the
job trains a small model with plain Horovod and with tfoverlap.horovod from the same
initial weights on the same per-rank data, and keeps the losses, the final weights,
tfoverlap's warnings and what :func:`tfoverlap.horovod.core.decisions` said. Plain Horovod is
trained once per (API, variant). Graph-mode cases build tf.compat.v1 graphs beside the
eager TF2 ones in the same process.

$CONTRACT_CASES: comma-separated "api/variant" pairs (every pair but Adasum's by default:
Horovod runs Adasum under MPI only). Writes $CONTRACT_RECORDS/rank-N.json:
{"api/mechanism/variant": {"horovod": ..., "tfoverlap": ...}}.
"""
import json
import logging
import os

import numpy as np
import tensorflow as tf
import horovod.tensorflow as hvd
import horovod.tensorflow.keras as hvd_keras

import tfoverlap.horovod as tfo_hvd
import tfoverlap.horovod.keras as tfo_keras
from job_logging import Warnings  # noqa: E402 - this directory

# A slow link and slow compute: the plan has a backward pass to overlap.
OPTIONS = dict(bandwidth="4Mbit", latency=50e-6, flops=1e7, force=True,
               cycle_ms=1)  # planned for 1 ms: the job cycles at 10 (tests/helpers.py)
#: keras_tf: a Keras optimizer given to horovod.tensorflow's DistributedOptimizer (which
#: hands it to horovod.tensorflow.keras) and to tfoverlap.horovod's
APIS = ("graph", "tape", "keras", "keras_tf")
MECHANISMS = ("cross_step", "decouple")
#: "sum" also names the process set (the global one): one training forwards both
VARIANTS = ("average", "sum", "adasum", "fp16", "backward_passes_2", "sparse",
            "sparse_as_dense")
CALLS, STEPS, BATCH, FEATURES, VOCABULARY = 2, 3, 32, 64, 30
WIDTHS = (61, 64, 10)   # hidden layers and the logits; 61 does not divide by 2

hvd.init()
RANK = hvd.rank()
# Passed explicitly: at 2 ranks Horovod 0.28 refuses a second set of the same ranks.
PROCESS_SET = hvd.global_process_set
data = np.random.default_rng(100 + RANK)
INPUTS = data.normal(size=(CALLS * STEPS, BATCH, FEATURES)).astype(np.float32)
IDS = data.integers(0, VOCABULARY, size=(CALLS * STEPS, BATCH, 3)).astype(np.int32)
LABELS = data.integers(0, WIDTHS[-1], size=(CALLS * STEPS, BATCH)).astype(np.int32)
initial = np.random.default_rng(7)
WEIGHTS = {"embedding": initial.normal(size=(VOCABULARY, FEATURES)).astype(np.float32)}
for number, (fan_in, width) in enumerate(zip((FEATURES,) + WIDTHS, WIDTHS)):
    WEIGHTS[f"dense{number}"] = (initial.normal(size=(fan_in, width)) / 8).astype(np.float32)
    WEIGHTS[f"dense{number}_bias"] = np.zeros(width, np.float32)
LAYERS = len(WIDTHS)


def arguments(variant: str, api: str) -> dict:
    """Horovod's wrapper arguments for ``variant``."""
    return {"sum": dict(op=hvd.Sum, process_set=PROCESS_SET), "adasum": dict(op=hvd.Adasum),
            "fp16": dict(compression=hvd.Compression.fp16),
            "backward_passes_2": dict(backward_passes_per_step=2),
            "sparse_as_dense": dict(sparse_as_dense=True)}.get(variant, {})


def embedded(variant: str) -> bool:
    return variant in ("sparse", "sparse_as_dense")


def train_graph(variant: str, wrapper) -> dict:
    """tf.compat.v1: a Momentum optimizer's minimize, STEPS * CALLS session runs."""
    with tf.Graph().as_default():
        variables = {name: tf.compat.v1.get_variable(name, initializer=value,
                                                     use_resource=True)
                     for name, value in WEIGHTS.items()
                     if name != "embedding" or embedded(variant)}
        inputs = tf.compat.v1.placeholder(tf.float32, [BATCH, FEATURES])
        ids = tf.compat.v1.placeholder(tf.int32, [BATCH, 3])
        labels = tf.compat.v1.placeholder(tf.int32, [BATCH])
        features = (tf.reduce_mean(tf.gather(variables["embedding"], ids), 1) + inputs
                    if embedded(variant) else inputs)
        for number in range(LAYERS):
            features = features @ variables[f"dense{number}"] + variables[f"dense{number}_bias"]
            features = tf.nn.relu(features) if number < LAYERS - 1 else features
        loss = tf.reduce_mean(tf.nn.sparse_softmax_cross_entropy_with_logits(
            labels=labels, logits=features))
        optimizer = wrapper.DistributedOptimizer(
            tf.compat.v1.train.MomentumOptimizer(0.05, 0.9), **arguments(variant, "graph"))
        train = optimizer.minimize(loss, var_list=list(variables.values()))
        losses = []
        with tf.compat.v1.Session() as session:
            session.run([tf.compat.v1.global_variables_initializer(),
                         tf.compat.v1.local_variables_initializer()])
            for step in range(CALLS * STEPS):
                losses.append(float(session.run([loss, train], {
                    inputs: INPUTS[step], ids: IDS[step], labels: LABELS[step]})[0]))
            weights = session.run(list(variables.values()))
    return {"losses": losses, "weights": [w.ravel().tolist() for w in weights]}


def keras_model(variant: str):
    """The same model as Keras layers (the embedding's gradient is IndexedSlices)."""
    features = tf.keras.Input((FEATURES,))
    ids = tf.keras.Input((3,), dtype=tf.int32)
    hidden = features
    if embedded(variant):
        embedding = tf.keras.layers.Embedding(VOCABULARY, FEATURES, name="embedding")
        hidden = tf.reduce_mean(embedding(ids), 1) + features
    for number, width in enumerate(WIDTHS):
        hidden = tf.keras.layers.Dense(width, activation="relu" if number < LAYERS - 1
                                       else None, name=f"dense{number}")(hidden)
    model = tf.keras.Model([features, ids], hidden)
    if embedded(variant):
        model.get_layer("embedding").set_weights([WEIGHTS["embedding"]])
    for number in range(LAYERS):
        model.get_layer(f"dense{number}").set_weights(
            [WEIGHTS[f"dense{number}"], WEIGHTS[f"dense{number}_bias"]])
    return model


LOSS = tf.keras.losses.SparseCategoricalCrossentropy(from_logits=True)


def train_tape(variant: str, wrapper) -> dict:
    """A DistributedGradientTape step in a loop of STEPS steps inside one tf.function,
    called CALLS times."""
    model = keras_model(variant)
    optimizer = tf.keras.optimizers.SGD(0.05, momentum=0.9)
    inputs, ids, labels = (tf.constant(a) for a in (INPUTS, IDS, LABELS))

    def step(i):
        with tf.GradientTape() as tape:
            loss = LOSS(labels[i], model([inputs[i], ids[i]], training=True))
        tape = wrapper.DistributedGradientTape(tape, **arguments(variant, "tape"))
        gradients = tape.gradient(loss, model.trainable_variables)
        optimizer.apply_gradients(zip(gradients, model.trainable_variables))
        return loss

    @tf.function
    def loop(first):
        losses = tf.TensorArray(tf.float32, size=STEPS)
        for i in tf.range(STEPS):
            losses = losses.write(i, step(first + i))
        return losses.stack()

    losses = []
    for call in range(CALLS):
        losses.extend(float(v) for v in loop(tf.constant(call * STEPS)).numpy())
    return {"losses": losses,
            "weights": [w.numpy().ravel().tolist() for w in model.trainable_variables]}


def train_keras(variant: str, wrapper) -> dict:
    """model.fit, STEPS steps per call (steps_per_execution), CALLS calls."""
    model = keras_model(variant)
    optimizer = wrapper.DistributedOptimizer(tf.keras.optimizers.SGD(0.05, momentum=0.9),
                                             **arguments(variant, "keras"))
    model.compile(optimizer=optimizer, loss=LOSS, steps_per_execution=STEPS)
    history = model.fit([INPUTS.reshape(-1, FEATURES), IDS.reshape(-1, 3)],
                        LABELS.reshape(-1), batch_size=BATCH, epochs=1, shuffle=False,
                        verbose=0)
    return {"losses": [float(v) for v in history.history["loss"]],
            "weights": [w.numpy().ravel().tolist() for w in model.trainable_variables]}


TRAIN = {"graph": train_graph, "tape": train_tape, "keras": train_keras,
         "keras_tf": train_keras}
PLAIN = {"graph": hvd, "tape": hvd, "keras": hvd_keras, "keras_tf": hvd}
OURS = {"graph": tfo_hvd, "tape": tfo_hvd, "keras": tfo_keras, "keras_tf": tfo_hvd}


def applies(api: str, variant: str) -> bool:
    """Whether Horovod's wrapper of ``api`` takes ``variant``'s arguments at all (its tape
    has no backward_passes_per_step; its Keras optimizer raises on Adasum); keras_tf, the
    same optimizer as keras by another door, for Average and Sum (which Horovod drops)."""
    if api == "keras_tf":
        return variant in ("average", "sum")
    return (api, variant) not in (("tape", "backward_passes_2"), ("keras", "adasum"))


def main():
    chosen = os.environ.get("CONTRACT_CASES")
    cases = ([case.split("/") for case in chosen.split(",")] if chosen else
             [(api, variant) for api in APIS for variant in VARIANTS
              if variant != "adasum" and applies(api, variant)])
    warnings = Warnings()
    logging.getLogger("tfoverlap").addHandler(warnings)
    records = {}
    for api, variant in cases:
        tf.keras.utils.set_random_seed(7)
        plain = TRAIN[api](variant, PLAIN[api])
        for mechanism in MECHANISMS:
            tfo_hvd.configure(**OPTIONS, cross_step=mechanism == "cross_step",
                              decouple=mechanism == "decouple")
            warnings.messages.clear()
            decided = len(tfo_hvd.decisions())
            tf.keras.utils.set_random_seed(7)
            try:
                ours = TRAIN[api](variant, OURS[api])
            except Exception as error:  # noqa: BLE001 - the test reads it
                ours = {"error": f"{type(error).__name__}: {error}"}
            ours["decisions"] = [
                {"api": d.api, "mechanism": d.mechanism, "deferred": d.deferred,
                 "declined": d.declined, "predicted_step_ms": d.predicted_step_ms,
                 "in_step_ms": d.in_step_ms}
                for d in tfo_hvd.decisions()[decided:]]
            ours["warnings"] = sorted(set(warnings.messages))
            records[f"{api}/{mechanism}/{variant}"] = {"horovod": plain,
                                                       "tfoverlap": ours}
    with open(os.path.join(os.environ["CONTRACT_RECORDS"], f"rank-{RANK}.json"), "w") as f:
        json.dump(records, f)


if __name__ == "__main__":
    main()
