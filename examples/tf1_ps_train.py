"""A plain TF1 parameter-server training program, with no tfoverlap in it.

Run one process per task, e.g. on one machine:

    python examples/tf1_ps_train.py --job ps --ps_hosts localhost:2222 \
        --worker_hosts localhost:2223 &
    python examples/tf1_ps_train.py --job worker --ps_hosts localhost:2222 \
        --worker_hosts localhost:2223

With TfOverlap and no change to the program (every process of the job):

    tfoverlap run --schedule tic -- python examples/tf1_ps_train.py ...

or give the program a RewriterConfig that names the optimizer, as programs with a
``--rewriter_config`` flag allow; ``tfoverlap run`` (with no options) then registers it:

    tfoverlap run -- python examples/tf1_ps_train.py ... \
        --rewriter_config "custom_optimizers { name: 'TfOverlap' }"

``--trace_dir`` writes the RunMetadata of the last steps (the transfers' order shows there).
"""
import argparse
import json
import os

import numpy as np
import tensorflow as tf
from google.protobuf import text_format


def main():
    parser = argparse.ArgumentParser()
    parser.add_argument("--job", choices=("ps", "worker"), required=True)
    parser.add_argument("--task", type=int, default=0)
    parser.add_argument("--ps_hosts", required=True)
    parser.add_argument("--worker_hosts", required=True)
    parser.add_argument("--steps", type=int, default=6)
    parser.add_argument("--layers", type=int, default=8)
    parser.add_argument("--width", type=int, default=256)
    parser.add_argument("--rewriter_config", default="",
                        help="RewriterConfig text to merge into the session config")
    parser.add_argument("--trace_dir", default="")
    args = parser.parse_args()
    tf.compat.v1.disable_eager_execution()
    cluster = tf.train.ClusterSpec({"ps": args.ps_hosts.split(","),
                                    "worker": args.worker_hosts.split(",")})
    server = tf.distribute.Server(cluster, job_name=args.job, task_index=args.task)
    if args.job == "ps":
        server.join()
        return

    setter = tf.compat.v1.train.replica_device_setter(
        worker_device=f"/job:worker/task:{args.task}", cluster=cluster)
    with tf.compat.v1.device(setter):
        rng = np.random.default_rng(0)
        hidden = tf.constant(rng.standard_normal((32, args.width)), tf.float32)
        for layer in range(args.layers):
            kernel = tf.compat.v1.get_variable(
                f"layer{layer}/kernel", initializer=tf.constant(
                    rng.standard_normal((args.width, args.width)) * 0.05, tf.float32))
            hidden = tf.tanh(tf.matmul(hidden, kernel))
        loss = tf.reduce_mean(tf.square(hidden))
        train = tf.compat.v1.train.GradientDescentOptimizer(0.1).minimize(loss)
        init = tf.compat.v1.global_variables_initializer()

    config = tf.compat.v1.ConfigProto()
    if args.rewriter_config:
        text_format.Merge(args.rewriter_config, config.graph_options.rewrite_options)
    losses = []
    with tf.compat.v1.Session(server.target, config=config) as session:
        session.run(init)
        for step in range(args.steps):
            options, metadata = None, None
            if args.trace_dir and step >= args.steps - 3:
                options = tf.compat.v1.RunOptions(
                    trace_level=tf.compat.v1.RunOptions.FULL_TRACE)
                metadata = tf.compat.v1.RunMetadata()
            value, _ = session.run([loss, train], options=options, run_metadata=metadata)
            losses.append(float(value))
            if metadata is not None:
                with open(os.path.join(args.trace_dir, f"step{step}.pb"), "wb") as stream:
                    stream.write(metadata.SerializeToString())
    print(json.dumps({"losses": losses}), flush=True)


if __name__ == "__main__":
    main()
