"""Horovod Keras with Caramel: the one line that changes is the import.

    horovodrun -np 2 --gloo python examples/horovod_keras_train.py
    (plain Horovod Keras: import horovod.tensorflow.keras as hvd)
"""
import argparse
import json

import numpy as np
import tensorflow as tf

import tfoverlap.horovod.keras as hvd                         # the one changed line


def main():
    parser = argparse.ArgumentParser()
    parser.add_argument("--steps", type=int, default=5)
    args = parser.parse_args()
    hvd.init()
    tf.keras.utils.set_random_seed(0)      # the same model in every run
    model = tf.keras.Sequential([tf.keras.layers.Dense(256, activation="relu",
                                                       input_shape=(64,)),
                                 tf.keras.layers.Dense(256, activation="relu"),
                                 tf.keras.layers.Dense(10)])
    model.compile(optimizer=hvd.DistributedOptimizer(tf.keras.optimizers.legacy.SGD(0.05)),
                  loss=tf.keras.losses.SparseCategoricalCrossentropy(from_logits=True))
    rng = np.random.default_rng(hvd.rank())
    x = rng.standard_normal((args.steps * 32, 64)).astype(np.float32)
    y = rng.integers(0, 10, args.steps * 32)
    history = model.fit(x, y, batch_size=32, epochs=1, shuffle=False, verbose=0,
                        callbacks=[hvd.callbacks.BroadcastGlobalVariablesCallback(0)])
    if hvd.rank() == 0:
        print(json.dumps({"losses": history.history["loss"]}), flush=True)


if __name__ == "__main__":
    main()
