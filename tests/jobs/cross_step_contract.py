"""A Horovod job for tests/test_cross_step.py: the patterns of real TF1 training programs,
each trained with plain Horovod and with tfoverlap.horovod's cross_step from the same
initial weights, on a chain of dense layers whose first layers' reductions are deferred.

argv: the patterns to run (default: all of :data:`PATTERNS`). Prints one JSON line per
rank: per pattern and variant, every value a run returned, the checkpoint written (every
tensor), the final weights, what was deferred, tfoverlap's warnings and any error.
"""
import json
import logging
import os
import sys
import tempfile

import numpy as np
import tensorflow as tf

tf.compat.v1.disable_eager_execution()
import horovod.tensorflow as hvd  # noqa: E402

import tfoverlap  # noqa: E402
import tfoverlap.horovod as tfo_hvd  # noqa: E402
from job_logging import Warnings  # noqa: E402 - this directory
from tfoverlap.horovod.session.deferral import deferral_summary  # noqa: E402

PATTERNS = ("plain_loop", "validation", "rank0_validation", "batch_norm", "checkpoint",
            "restore_plain_checkpoint", "flush_midway", "two_optimizers", "schedule",
            "adam", "nesterov", "clip", "gradient_after", "accumulation", "make_callable",
            "monitored_session", "auto_declined", "end_of_input", "built_in_session",
            "ref_variables")
# A slow link and slow compute: the plan's ring has a tail to defer.
OPTIONS = dict(bandwidth="4Mbit", latency=50e-6, flops=2.5e7, force=True,
               cycle_ms=1)  # planned for 1 ms: the job cycles at 10 (tests/helpers.py)
STEPS = 4
SHAPES = [(64, 64)] * 5 + [(64, 10)]
CHECKPOINTS = os.environ.get("CROSS_STEP_CHECKPOINTS") or tempfile.mkdtemp()

hvd.init()
RANK = hvd.rank()
weights_rng = np.random.default_rng(7)
INITIAL = [weights_rng.normal(0, 0.1, shape).astype(np.float32) for shape in SHAPES]
data = np.random.default_rng(100 + RANK)
INPUTS = data.normal(size=(STEPS, 32, 64)).astype(np.float32)
LABELS = data.integers(0, 10, size=(STEPS, 32))
VALIDATION = np.random.default_rng(999).normal(size=(32, 64)).astype(np.float32)


def chain(x, weights, batch_norm=False):
    hidden = x
    for index, weight in enumerate(weights[:-1]):
        hidden = tf.matmul(hidden, weight)
        if batch_norm and index < 2:
            hidden = tf.compat.v1.layers.batch_normalization(hidden, training=True,
                                                             name=f"bn{index}")
        hidden = tf.nn.relu(hidden)
    return tf.matmul(hidden, weights[-1])


def build(pattern, distributed):
    """The graph of ``pattern`` trained with ``distributed``'s DistributedOptimizer."""
    graph = tf.Graph()
    with graph.as_default():
        weights = [tf.compat.v1.get_variable(f"w{i}", initializer=value,
                                             use_resource=pattern != "ref_variables")
                   for i, value in enumerate(INITIAL)]
        x = tf.compat.v1.placeholder(tf.float32, [32, 64], name="x")
        y = tf.compat.v1.placeholder(tf.int64, [32], name="y")
        step = tf.compat.v1.train.get_or_create_global_step()
        logits = chain(x, weights, batch_norm=pattern == "batch_norm")
        loss = tf.reduce_mean(tf.nn.sparse_softmax_cross_entropy_with_logits(y, logits))
        rate = (tf.compat.v1.train.exponential_decay(0.05, step, 1, 0.7)
                if pattern == "schedule" else 0.05)
        optimizer = (tf.compat.v1.train.AdamOptimizer(0.01) if pattern == "adam" else
                     tf.compat.v1.train.MomentumOptimizer(rate, 0.9,
                                                          use_nesterov=pattern == "nesterov"))
        kwargs = {"backward_passes_per_step": 2} if pattern == "accumulation" else {}
        distributed_optimizer = distributed.DistributedOptimizer(optimizer, **kwargs)
        extra = {}
        if pattern == "batch_norm":
            with tf.control_dependencies(tf.compat.v1.get_collection(
                    tf.compat.v1.GraphKeys.UPDATE_OPS)):
                train = distributed_optimizer.minimize(loss, global_step=step)
        elif pattern in ("clip", "gradient_after"):
            pairs = distributed_optimizer.compute_gradients(loss)
            grads = [g for g, _ in pairs]
            if pattern == "clip":
                grads, _ = tf.clip_by_global_norm(grads, 0.5)
            train = distributed_optimizer.apply_gradients(
                zip(grads, [v for _, v in pairs]), global_step=step)
            if pattern == "gradient_after":
                extra["gradient_norm"] = tf.linalg.global_norm(grads)
        elif pattern == "built_in_session":   # Horovod's tensorflow_synthetic_benchmark.py
            train = None
            extra["make_train"] = lambda: distributed_optimizer.minimize(
                loss, global_step=step, var_list=weights)
        else:
            train = distributed_optimizer.minimize(loss, global_step=step,
                                                   var_list=weights)
        if pattern == "two_optimizers":     # a second model trained by its own optimizer
            others = [tf.compat.v1.get_variable(f"g{i}", initializer=value * 0.5,
                                                use_resource=True)
                      for i, value in enumerate(INITIAL)]
            other_loss = tf.reduce_mean(tf.nn.sparse_softmax_cross_entropy_with_logits(
                y, chain(x, others) + 0.1 * logits))
            other = distributed.DistributedOptimizer(
                tf.compat.v1.train.MomentumOptimizer(0.03, 0.9))
            extra["other_train"] = other.minimize(other_loss, var_list=others)
            extra["other_loss"] = other_loss
            weights = weights + others
        if pattern == "end_of_input":     # a run that fails: its input is exhausted
            batch = tf.compat.v1.data.make_one_shot_iterator(tf.data.Dataset.from_tensor_slices(
                np.zeros((0, 64), np.float32)).batch(32)).get_next()
            extra["exhausted"] = tf.reduce_sum(chain(batch, weights))
        validation = tf.reduce_mean(tf.nn.sparse_softmax_cross_entropy_with_logits(
            y, chain(x, weights[:len(SHAPES)])))
        init = tf.group(tf.compat.v1.global_variables_initializer(),
                        tf.compat.v1.local_variables_initializer())
        saver = tf.compat.v1.train.Saver()
        broadcast = hvd.broadcast_global_variables(0)
        flush = tfo_hvd.flush_op()
    return dict(graph=graph, weights=weights, x=x, y=y, loss=loss, train=train, init=init,
                saver=saver, broadcast=broadcast, flush=flush, validation=validation,
                **extra)


def checkpoint_tensors(path):
    reader = tf.train.load_checkpoint(path)
    return {name: reader.get_tensor(name).tolist()
            for name in sorted(reader.get_variable_to_shape_map())}


def train(pattern, variant):
    """Every value the runs of ``pattern`` returned, the checkpoint, the final weights."""
    model = build(pattern, tfo_hvd if variant == "cross_step" else hvd)
    graph, x, y = model["graph"], model["x"], model["y"]
    values, record = [], {}
    if pattern == "monitored_session":     # Horovod's examples: hooks, a finalized graph
        with graph.as_default():
            with tf.compat.v1.train.MonitoredTrainingSession(
                    hooks=[hvd.BroadcastGlobalVariablesHook(0)]) as session:
                for index in range(STEPS):
                    values.append(float(session.run(
                        [model["loss"], model["train"]],
                        {x: INPUTS[index], y: LABELS[index]})[0]))
                final = session.run(model["weights"])
        return {"values": values, "final": [w.tolist() for w in final],
                "deferred": deferral_summary(graph)}
    session = tf.compat.v1.Session(graph=graph)
    session.run(model["init"])
    if pattern == "built_in_session":     # the train op built after init and broadcast ran
        session.run(model["broadcast"])
        with graph.as_default():
            known = set(tf.compat.v1.global_variables())
            model["train"] = model["make_train"]()
            session.run(tf.compat.v1.variables_initializer(
                [v for v in tf.compat.v1.global_variables() if v not in known]))
    if pattern == "restore_plain_checkpoint":
        model["saver"].restore(session, os.path.join(CHECKPOINTS, f"checkpoint-horovod-{RANK}"))
        values.append(session.run(model["weights"][0]).tolist())
    if pattern == "make_callable":
        step_fn = session.make_callable([model["loss"], model["train"]], [x, y])
    for index in range(STEPS):
        feed = {x: INPUTS[index], y: LABELS[index]}
        if pattern == "make_callable":
            values.append(float(step_fn(INPUTS[index], LABELS[index])[0]))
        else:
            values.append(float(session.run([model["loss"], model["train"]], feed)[0]))
        if pattern == "two_optimizers":
            values.append(float(session.run([model["other_loss"], model["other_train"]],
                                            feed)[0]))
        if pattern == "validation" or (pattern == "rank0_validation" and RANK == 0):
            values.append(float(session.run(model["validation"],
                                            {x: VALIDATION, y: LABELS[0]})))
        if pattern == "gradient_after":
            values.append(float(session.run(model["gradient_norm"], feed)))
        if pattern == "end_of_input":
            try:
                session.run(model["exhausted"])
            except tf.errors.OutOfRangeError:
                values.append("out of range")
        if pattern == "flush_midway" and index == 1 and model["flush"] is not None:
            session.run(model["flush"])
        if pattern == "checkpoint" and index == 1:
            path = os.path.join(CHECKPOINTS, f"checkpoint-{variant}-{RANK}")
            model["saver"].save(session, path)
            record["checkpoint"] = checkpoint_tensors(path)
            session.close()         # a restart: rank 0 restores, Horovod broadcasts
            session = tf.compat.v1.Session(graph=graph)
            session.run(model["init"])
            if RANK == 0:
                model["saver"].restore(session, path)
            session.run(model["broadcast"])
    record.update(values=values, final=[w.tolist() for w in session.run(model["weights"])],
                  deferred=deferral_summary(graph))
    session.close()
    return record


caught = Warnings()
logging.getLogger("tfoverlap").addHandler(caught)
results = {}
for pattern in sys.argv[1:] or PATTERNS:
    results[pattern] = {}
    for variant in ("horovod", "cross_step"):
        # auto_declined: on by default, where deferring cannot gain min_gain (99%).
        mode = variant == "cross_step" and ("auto" if pattern == "auto_declined" else True)
        tfo_hvd.configure(**OPTIONS, cross_step=mode,
                          **({"min_gain": 0.99} if pattern == "auto_declined" else {}))
        caught.messages.clear()
        mark = tfoverlap.report_count()
        try:
            record = train(pattern, variant)
        except Exception as error:  # noqa: BLE001 - reported to the test
            record = {"error": f"{type(error).__name__}: {error}"}
        record["warnings"] = list(caught.messages)
        record["decisions"] = [p.summary["cross_step"] for r in
                               tfoverlap.recent_reports(since=mark)
                               for p in r.passes if "cross_step" in p.summary]
        results[pattern][variant] = record
    tfo_hvd.configure()
RECORD = json.dumps({"rank": RANK, "patterns": results})
if os.environ.get("CROSS_STEP_RECORDS"):   # a file: the launcher's forwarding of a long
    with open(os.path.join(os.environ["CROSS_STEP_RECORDS"], f"rank-{RANK}.json"),
              "w") as stream:              # last line is not relied on
        stream.write(RECORD)
print(RECORD, flush=True)
