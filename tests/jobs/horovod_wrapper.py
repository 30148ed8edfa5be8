"""A Horovod job for tests/test_horovod_wrapper.py: tfoverlap.horovod's cross_step on a
chain of dense layers, in each variant of :data:`VARIANTS`, trained 3 steps next to plain
Horovod with the same optimizer and compression from the same initial weights. Writes one
JSON record per rank ($WRAPPER_RECORDS/rank-N.json): per variant, whether losses and final weights (after the flush) are
Horovod's, what was deferred, the Caramel pass's summary of the step and tfoverlap's
warnings."""
import json
import logging
import os

import numpy as np
import tensorflow as tf

tf.compat.v1.disable_eager_execution()
import horovod.tensorflow as hvd  # noqa: E402

import tfoverlap  # noqa: E402
import tfoverlap.horovod as tfo_hvd  # noqa: E402
from job_logging import Warnings  # noqa: E402 - this directory
from tfoverlap.horovod.session.deferral import deferral_summary  # noqa: E402

#: variant -> (optimizer, compression, an extra variable: "" none, "unreached" one the
#: loss does not reach, "sparse" one read by a gather, whose gradient is IndexedSlices)
VARIANTS = {
    "momentum": (lambda: tf.compat.v1.train.MomentumOptimizer(0.05, 0.9), "none", ""),
    "fp16": (lambda: tf.compat.v1.train.MomentumOptimizer(0.05, 0.9), "fp16", ""),
    "numpy_rate": (lambda: tf.compat.v1.train.GradientDescentOptimizer(np.float32(0.05)),
                   "none", ""),
    "unreached": (lambda: tf.compat.v1.train.GradientDescentOptimizer(0.05), "none",
                  "unreached"),
    "sparse": (lambda: tf.compat.v1.train.GradientDescentOptimizer(0.05), "none", "sparse"),
}
# A slow link and slow compute: the plan's ring has a tail to defer.
OPTIONS = dict(bandwidth="4Mbit", latency=50e-6, flops=2.5e7, force=True,
               cycle_ms=1)  # planned for 1 ms: the job cycles at 10 (tests/helpers.py)
STEPS = 3
SHAPES = [(128, 128)] * 5 + [(128, 10)]

hvd.init()
weights_rng = np.random.default_rng(7)
initial = [weights_rng.normal(0, 0.1, shape).astype(np.float32)
           for shape in SHAPES]
data = np.random.default_rng(100 + hvd.rank())
inputs = data.normal(size=(STEPS, 32, 128)).astype(np.float32)
labels = data.integers(0, 10, size=(STEPS, 32))


def train(variant: str, distributed) -> dict:
    """Losses and final weights of ``variant`` trained with ``distributed``'s optimizer."""
    make_optimizer, compression, extra = VARIANTS[variant]
    graph = tf.Graph()
    with graph.as_default():
        weights = [tf.compat.v1.get_variable(f"w{i}", initializer=value, use_resource=True)
                   for i, value in enumerate(initial)]
        if extra:
            weights.append(tf.compat.v1.get_variable(extra, [4, 128], use_resource=True,
                                                     initializer=tf.zeros_initializer()))
        x = tf.compat.v1.placeholder(tf.float32, [32, 128])
        y = tf.compat.v1.placeholder(tf.int64, [32])
        hidden = x + tf.gather(weights[-1], [0]) if extra == "sparse" else x
        for weight in weights[:len(SHAPES) - 1]:
            hidden = tf.nn.relu(tf.matmul(hidden, weight))
        logits = tf.matmul(hidden, weights[len(SHAPES) - 1])
        loss = tf.reduce_mean(tf.nn.sparse_softmax_cross_entropy_with_logits(y, logits))
        optimizer = distributed.DistributedOptimizer(
            make_optimizer(), compression=getattr(hvd.Compression, compression))
        step = optimizer.minimize(loss, var_list=weights)
        init = tf.compat.v1.global_variables_initializer()
        flush = tfo_hvd.flush_op()
    with tf.compat.v1.Session(graph=graph) as session:
        session.run(init)
        losses = [float(session.run([loss, step], {x: inputs[i], y: labels[i]})[0])
                  for i in range(STEPS)]
        if flush is not None:
            session.run(flush)
        return {"losses": losses, "weights": session.run(weights[:len(SHAPES)]),
                "deferred": deferral_summary(graph)}


caught = Warnings()
logging.getLogger("tfoverlap").addHandler(caught)
results = {}
for variant in VARIANTS:
    plain = train(variant, hvd)
    tfo_hvd.configure(**OPTIONS, cross_step=True)
    caught.messages.clear()
    deferred = train(variant, tfo_hvd)
    tfo_hvd.configure()
    caramel = [p.summary for p in tfoverlap.recent_reports()[-1].passes if p.name == "caramel"]
    results[variant] = {
        "same_losses": deferred["losses"] == plain["losses"],
        "same_final_weights": all(np.array_equal(a, b) for a, b in zip(plain["weights"],
                                                                       deferred["weights"])),
        "deferred": deferred["deferred"], "caramel": caramel[0] if caramel else {},
        "warnings": list(caught.messages)}
with open(os.path.join(os.environ["WRAPPER_RECORDS"], f"rank-{hvd.rank()}.json"), "w") as f:
    json.dump({"rank": hvd.rank(), "variants": results}, f, default=str)
