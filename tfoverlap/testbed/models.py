"""Models for tests and benchmarks, built as TF1 graphs with parameters on PS tasks."""
from __future__ import annotations

import dataclasses
from typing import Sequence

__all__ = ["PsModel", "chain_model"]


@dataclasses.dataclass
class PsModel:
    """A built model: what to run, and which variables live where."""

    graph: object
    init: object
    loss: object
    train_op: object | None
    variables: list


def chain_model(num_layers: int = 16, width: int = 256, batch: int = 64,
                num_ps: int = 1, worker_device: str = "/job:worker/task:0",
                ps_devices: Sequence[str] | None = None, use_resource: bool = True,
                training: bool = False,
                learning_rate: float = 0.01, seed: int = 0) -> PsModel:
    """TicTac's seq model: ``num_layers`` dense layers in a chain.

    Layer i's kernel lives on ``ps_devices[i % len(ps_devices)]`` (default: PS tasks
    0..num_ps-1 of job "ps"); the compute on ``worker_device``. The input is a fixed synthetic batch, so losses are reproducible given ``seed``.
    """
    import tensorflow as tf
    if ps_devices is None:
        ps_devices = [f"/job:ps/task:{task}" for task in range(num_ps)]
    graph = tf.Graph()
    with graph.as_default():
        tf.compat.v1.set_random_seed(seed)
        weights = []
        for layer in range(num_layers):
            with tf.device(ps_devices[layer % len(ps_devices)]):
                weights.append(tf.compat.v1.get_variable(
                    f"layer{layer}/kernel", shape=[width, width], use_resource=use_resource,
                    initializer=tf.compat.v1.random_normal_initializer(
                        stddev=1.0 / width ** 0.5, seed=seed + layer)))
        with tf.device(worker_device):
            inputs = tf.random.stateless_normal([batch, width], seed=[seed, 7])
            hidden = inputs
            for weight in weights:
                hidden = tf.nn.relu(tf.matmul(hidden, weight))
            loss = tf.reduce_mean(tf.square(hidden))
            train_op = None
            if training:
                optimizer = tf.compat.v1.train.GradientDescentOptimizer(learning_rate)
                train_op = optimizer.minimize(loss)
        init = tf.compat.v1.global_variables_initializer()
    return PsModel(graph=graph, init=init, loss=loss, train_op=train_op, variables=weights)
