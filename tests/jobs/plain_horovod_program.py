"""A plain Horovod program that never imports tfoverlap (tests/test_cross_step.py and
tests/test_decoupled.py run it with and without ``tfoverlap run --allreduce caramel``).

argv[1]: the modes to train, one after the other (comma-separated; "graph" alone, as it
turns eager execution off): "graph" (TF1, ``hvd.DistributedOptimizer`` around Momentum, 4
session runs), "keras" (``horovod.tensorflow.keras.DistributedOptimizer`` in model.fit
with steps_per_execution=2), "horovod_keras" (the same with ``horovod.keras``, the
standalone-Keras module of Horovod's examples) or "tape" (``hvd.DistributedGradientTape``
in a loop of 2
steps inside a ``tf.function``, called twice). Prints one JSON line per rank and mode:
the losses, the final weights, and the module the program's ``DistributedOptimizer``
came from.
"""
import json
import sys

import numpy as np
import tensorflow as tf

MODES = sys.argv[1].split(",")
if MODES == ["graph"]:
    tf.compat.v1.disable_eager_execution()
import horovod.tensorflow as hvd  # noqa: E402
import horovod.tensorflow.keras as hvd_keras  # noqa: E402

hvd.init()
STEPS, BATCH = 4, 32
initial = [np.random.default_rng(7).normal(0, 0.1, shape).astype(np.float32)
           for shape in [(64, 64)] * 5 + [(64, 10)]]
data = np.random.default_rng(100 + hvd.rank())
inputs = data.normal(size=(STEPS * BATCH, 64)).astype(np.float32)
labels = data.integers(0, 10, size=(STEPS * BATCH,))


def train_graph():
    x = tf.compat.v1.placeholder(tf.float32, [BATCH, 64])
    y = tf.compat.v1.placeholder(tf.int64, [BATCH])
    weights = [tf.compat.v1.get_variable(f"w{i}", initializer=w, use_resource=True)
               for i, w in enumerate(initial)]
    hidden = x
    for weight in weights[:-1]:
        hidden = tf.nn.relu(tf.matmul(hidden, weight))
    loss = tf.reduce_mean(tf.nn.sparse_softmax_cross_entropy_with_logits(
        labels=y, logits=tf.matmul(hidden, weights[-1])))
    optimizer = hvd.DistributedOptimizer(tf.compat.v1.train.MomentumOptimizer(0.05, 0.9))
    train = optimizer.minimize(loss)
    losses = []
    with tf.compat.v1.Session() as session:
        session.run(tf.compat.v1.global_variables_initializer())
        session.run(hvd.broadcast_global_variables(0))
        for step in range(STEPS):
            feed = {x: inputs[step * BATCH:(step + 1) * BATCH],
                    y: labels[step * BATCH:(step + 1) * BATCH]}
            losses.append(float(session.run([loss, train], feed)[0]))
        final = session.run(weights)
    return losses, final, hvd.DistributedOptimizer.__module__


def keras_model():
    """The chain of dense layers, with the initial weights of every mode."""
    tf.keras.utils.set_random_seed(7)
    model = tf.keras.Sequential([tf.keras.Input((64,))] + [
        tf.keras.layers.Dense(w.shape[1], use_bias=False,
                              activation="relu" if i < len(initial) - 1 else None)
        for i, w in enumerate(initial)])
    model.set_weights(initial)
    return model


def train_keras(horovod_keras=hvd_keras):
    model = keras_model()
    model.compile(optimizer=horovod_keras.DistributedOptimizer(
        tf.keras.optimizers.SGD(0.05, momentum=0.9)),
        loss=tf.keras.losses.SparseCategoricalCrossentropy(from_logits=True),
        steps_per_execution=2)
    history = model.fit(inputs, labels, batch_size=BATCH, epochs=2, shuffle=False, verbose=0)
    return (history.history["loss"], model.get_weights(),
            horovod_keras.DistributedOptimizer.__module__)


def train_horovod_keras():
    import horovod.keras
    return train_keras(horovod.keras)


def train_tape():
    model = keras_model()
    optimizer = tf.keras.optimizers.SGD(0.05, momentum=0.9)
    loss_function = tf.keras.losses.SparseCategoricalCrossentropy(from_logits=True)
    batches = tf.constant(inputs.reshape(STEPS, BATCH, 64))
    targets = tf.constant(labels.reshape(STEPS, BATCH))

    @tf.function
    def train(first):
        losses = tf.TensorArray(tf.float32, size=2)
        for i in tf.range(2):
            with tf.GradientTape() as tape:
                loss = loss_function(targets[first + i], model(batches[first + i]))
            tape = hvd.DistributedGradientTape(tape)
            gradients = tape.gradient(loss, model.trainable_variables)
            optimizer.apply_gradients(zip(gradients, model.trainable_variables))
            losses = losses.write(i, loss)
        return losses.stack()

    losses = [float(loss) for first in (0, 2) for loss in train(tf.constant(first)).numpy()]
    return losses, model.get_weights(), hvd.DistributedGradientTape.__module__


for mode in MODES:
    losses, final, wrapper = {"graph": train_graph, "keras": train_keras,
                              "horovod_keras": train_horovod_keras,
                              "tape": train_tape}[mode]()
    print(json.dumps({"rank": hvd.rank(), "mode": mode, "losses": losses,
                      "weights": [w.ravel().tolist() for w in final], "wrapper": wrapper}),
          flush=True)
