"""A Horovod training job for the Caramel tests: prints each step's loss as JSON.

argv: MODE (graph | tf2) VARIANT (horovod | flag | dropin) STEPS [TIMELINE_STEP]
Every rank trains the same small conv + dense model from the same initial weights on
its own data (seeded by rank), so the losses depend on the reduction being right.
"""
import json
import sys

import numpy as np
import tensorflow as tf

mode, variant, steps = sys.argv[1], sys.argv[2], int(sys.argv[3])
if mode == "graph":
    tf.compat.v1.disable_eager_execution()
import horovod.tensorflow as hvd  # noqa: E402

import tfoverlap  # noqa: E402
import tfoverlap.horovod as tfo_hvd  # noqa: E402

hvd.init()
OPTIONS = dict(bandwidth="1Gbit", latency=50e-6, split_bytes=150_000, flops=2e8)
if variant == "dropin":
    tfo_hvd.configure(**OPTIONS)
distributed = tfo_hvd if variant == "dropin" else hvd
rng = np.random.default_rng(7)
shapes = [(3, 3, 3, 16), (3, 3, 16, 32), (8 * 8 * 32, 256), (256, 10)]
initial = [rng.normal(0, 0.1, s).astype(np.float32) for s in shapes]
data_rng = np.random.default_rng(100 + hvd.rank())
images = data_rng.normal(size=(steps, 16, 16, 16, 3)).astype(np.float32)
labels = data_rng.integers(0, 10, size=(steps, 16))


def forward(weights, x, y):
    h = tf.nn.relu(tf.nn.conv2d(x, weights[0], 1, "SAME"))
    h = tf.nn.max_pool2d(tf.nn.relu(tf.nn.conv2d(h, weights[1], 1, "SAME")), 2, 2, "SAME")
    h = tf.nn.relu(tf.matmul(tf.reshape(h, [-1, 8 * 8 * 32]), weights[2]))
    logits = tf.matmul(h, weights[3])
    return tf.reduce_mean(tf.nn.sparse_softmax_cross_entropy_with_logits(y, logits))


losses = []
if mode == "graph":
    weights = [tf.compat.v1.get_variable(f"w{i}", initializer=w, use_resource=True)
               for i, w in enumerate(initial)]
    x = tf.compat.v1.placeholder(tf.float32, [16, 16, 16, 3])
    y = tf.compat.v1.placeholder(tf.int64, [16])
    loss = forward(weights, x, y)
    optimizer = distributed.DistributedOptimizer(
        tf.compat.v1.train.MomentumOptimizer(0.05, 0.9))
    train = optimizer.minimize(loss)
    config = (tfoverlap.session_config(allreduce="caramel", schedule="none", **OPTIONS)
              if variant == "flag" else None)
    with tf.compat.v1.Session(config=config) as session:
        session.run(tf.compat.v1.global_variables_initializer())
        for step in range(steps):
            value, _ = session.run([loss, train], {x: images[step], y: labels[step]})
            losses.append(float(value))
else:
    if variant == "flag":
        tfoverlap.enable_for_tf_function(allreduce="caramel", schedule="none", **OPTIONS)
    weights = [tf.Variable(w) for w in initial]
    optimizer = tf.keras.optimizers.SGD(0.05, momentum=0.9)

    @tf.function
    def train_step(x, y):
        with tf.GradientTape() as tape:
            loss = forward(weights, x, y)
        tape = distributed.DistributedGradientTape(tape)
        gradients = tape.gradient(loss, weights)
        optimizer.apply_gradients(zip(gradients, weights))
        return loss

    for step in range(steps):
        losses.append(float(train_step(images[step], labels[step])))
# Where the rewrite happened: Grappler's reports, or the graph itself (graph-mode drop-in).
reports = [r.to_dict() for r in tfoverlap.plugin.recent_reports() if r.modified]
caramel = [p["summary"] for r in reports for p in r["passes"] if p["name"] == "caramel"]
grouped = (sum(op.type == "HorovodGroupedAllreduce" for op in tf.compat.v1.get_default_graph()
               .get_operations()) if mode == "graph" else 0)
print(json.dumps({"rank": hvd.rank(), "losses": losses, "grappler_rewrites": caramel,
                  "grouped_in_graph": grouped}), flush=True)
