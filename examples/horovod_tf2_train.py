"""A Horovod TF2 training step with Caramel: the one line that changes is the tape.

    horovodrun -np 2 --gloo python examples/horovod_tf2_train.py
    (plain Horovod: replace tfo_hvd.DistributedGradientTape with hvd.DistributedGradientTape)

Without changing even that line, a plain Horovod program gets Caramel from the launcher:

    horovodrun -np 2 --gloo tfoverlap run --allreduce caramel --schedule none -- python ...
"""
import argparse
import json

import horovod.tensorflow as hvd
import numpy as np
import tensorflow as tf

import tfoverlap.horovod as tfo_hvd


def main():
    parser = argparse.ArgumentParser()
    parser.add_argument("--steps", type=int, default=5)
    parser.add_argument("--plain", action="store_true",
                        help="plain hvd.DistributedGradientTape (for tfoverlap run)")
    args = parser.parse_args()
    hvd.init()
    tf.keras.utils.set_random_seed(0)      # the same model in every run
    model = tf.keras.Sequential([tf.keras.layers.Dense(256, activation="relu"),
                                 tf.keras.layers.Dense(256, activation="relu"),
                                 tf.keras.layers.Dense(10)])
    model.build((None, 64))
    optimizer = tf.keras.optimizers.SGD(0.05)
    hvd.broadcast_variables(model.variables, root_rank=0)
    rng = np.random.default_rng(hvd.rank())
    data = rng.standard_normal((args.steps, 32, 64)).astype(np.float32)
    labels = rng.integers(0, 10, (args.steps, 32))

    @tf.function
    def train_step(x, y):
        with tf.GradientTape() as tape:
            logits = model(x, training=True)
            loss = tf.reduce_mean(
                tf.nn.sparse_softmax_cross_entropy_with_logits(y, logits))
        distributed = hvd if args.plain else tfo_hvd
        tape = distributed.DistributedGradientTape(tape)      # the one changed line
        gradients = tape.gradient(loss, model.trainable_variables)
        optimizer.apply_gradients(zip(gradients, model.trainable_variables))
        return loss

    losses = [float(train_step(data[s], labels[s])) for s in range(args.steps)]
    if hvd.rank() == 0:
        print(json.dumps({"losses": losses}), flush=True)


if __name__ == "__main__":
    main()
