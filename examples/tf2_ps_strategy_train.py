"""A plain TF2 ParameterServerStrategy training program, with no tfoverlap in it.

One process per task; the chief is the coordinator, which schedules the training step onto
the workers (ClusterCoordinator). On one machine:

    python examples/tf2_ps_strategy_train.py --job ps --task 0 $HOSTS &
    python examples/tf2_ps_strategy_train.py --job worker --task 0 $HOSTS &
    python examples/tf2_ps_strategy_train.py --job worker --task 1 $HOSTS &
    python examples/tf2_ps_strategy_train.py --job chief $HOSTS

with HOSTS="--chief_host localhost:2220 --ps_hosts localhost:2221
--worker_hosts localhost:2222,localhost:2223".

With TfOverlap and no change to the program, start the chief under the launcher (Grappler
runs for the scheduled functions in the coordinator, see README):

    tfoverlap run --schedule tic -- python examples/tf2_ps_strategy_train.py --job chief ...

or, in the program, the one line that changes is the loop's context:

    with tfoverlap.tf_function_options(schedule="tic"):
        for step in range(steps): coordinator.schedule(train_step)
"""
import argparse
import json

import numpy as np
import tensorflow as tf


def cluster_spec(args) -> tf.train.ClusterSpec:
    return tf.train.ClusterSpec({"chief": [args.chief_host],
                                 "ps": args.ps_hosts.split(","),
                                 "worker": args.worker_hosts.split(",")})


def main():
    parser = argparse.ArgumentParser()
    parser.add_argument("--job", choices=("chief", "ps", "worker"), required=True)
    parser.add_argument("--task", type=int, default=0)
    parser.add_argument("--chief_host", required=True)
    parser.add_argument("--ps_hosts", required=True)
    parser.add_argument("--worker_hosts", required=True)
    parser.add_argument("--steps", type=int, default=6)
    parser.add_argument("--layers", type=int, default=12)
    parser.add_argument("--width", type=int, default=256)
    parser.add_argument("--join_every_step", action="store_true",
                        help="one step in flight at a time (losses are then reproducible)")
    args = parser.parse_args()
    cluster = cluster_spec(args)
    if args.job != "chief":
        server = tf.distribute.Server(cluster, job_name=args.job, task_index=args.task,
                                      protocol="grpc")
        server.join()
        return

    resolver = tf.distribute.cluster_resolver.SimpleClusterResolver(
        cluster, task_type="chief", task_id=0, rpc_layer="grpc")
    strategy = tf.distribute.experimental.ParameterServerStrategy(resolver)
    coordinator = tf.distribute.experimental.coordinator.ClusterCoordinator(strategy)

    rng = np.random.default_rng(0)
    with strategy.scope():
        kernels = [tf.Variable(rng.standard_normal((args.width, args.width)).astype(np.float32)
                               * 0.05, name=f"layer{layer}/kernel")
                   for layer in range(args.layers)]
    inputs = rng.standard_normal((32, args.width)).astype(np.float32)

    @tf.function
    def train_step():
        def replica_step():
            with tf.GradientTape() as tape:
                hidden = tf.constant(inputs)
                for kernel in kernels:
                    hidden = tf.tanh(tf.matmul(hidden, kernel))
                loss = tf.reduce_mean(tf.square(hidden))
            for kernel, gradient in zip(kernels, tape.gradient(loss, kernels)):
                kernel.assign_sub(0.1 * gradient)
            return loss
        return strategy.run(replica_step)

    results = []
    for _ in range(args.steps):
        results.append(coordinator.schedule(train_step))
        if args.join_every_step:
            coordinator.join()
    coordinator.join()
    print(json.dumps({"losses": [float(result.fetch()) for result in results]}), flush=True)


if __name__ == "__main__":
    main()
