"""A Horovod training job for the Caramel tests: prints each variant's losses as JSON.

argv: MODE (graph | tf2 | keras) STEPS VARIANT... with VARIANT one of horovod (plain
Horovod), flag (the session config / tf.function flag), dropin (tfoverlap.horovod's
wrappers; tfoverlap.horovod.keras's in keras mode, which trains with model.fit) and
deferred (graph mode: the drop-in with cross_step, final weights after its flush).
Or argv: --scenarios JSON, a list of {"name", "mode", "steps", "variants", "env"}: several
such runs one after another in this one process (one Horovod start-up for them all), each
with its CARAMEL_TEST_* settings in "env" (over this process's environment); its records
carry its name as "scenario". Graph mode turns eager execution off for the process, so
graph scenarios and tf2/keras ones take a job each. Where $CARAMEL_RECORDS names a
directory, each rank writes its records there as a list (rank-N.json) instead.
Every rank trains the same small conv + dense model from the same initial weights on its
own data (seeded by rank), so the losses depend on the reduction being right. Graph-mode
runs trace every step and report the order in which the gradient producers started.
CARAMEL_TEST_MODEL=parallel trains independent branches instead of a chain of layers;
CARAMEL_TEST_MODEL=control_flow a while loop that reads a weight in every iteration and a
cond whose branch alternates between steps.
"""
import json
import os
import sys

import numpy as np
import tensorflow as tf

if sys.argv[1] == "--scenarios":
    SCENARIOS = json.loads(sys.argv[2])
else:
    SCENARIOS = [{"name": "", "mode": sys.argv[1], "steps": int(sys.argv[2]),
                  "variants": sys.argv[3:], "env": {}}]
GRAPH = {scenario["mode"] == "graph" for scenario in SCENARIOS}
assert len(GRAPH) == 1, "graph mode and tf2/keras scenarios need a process each"
if GRAPH.pop():
    tf.compat.v1.disable_eager_execution()
import horovod.tensorflow as hvd  # noqa: E402

import tfoverlap  # noqa: E402
import tfoverlap.horovod as tfo_hvd  # noqa: E402
from tfoverlap.integrations.tf_function import (  # noqa: E402
    get_function_config, set_function_config)

hvd.init()
BRANCHES = 8


def set_up(scenario):
    """The scenario's options, model and data, as module globals."""
    global OPTIONS, PARALLEL, CONTROL_FLOW, initial, images, labels, steps
    setting = {**os.environ, **scenario.get("env", {})}
    steps = scenario["steps"]
    # CARAMEL_TEST_RANK1_BANDWIDTH gives rank 1 other options than the rest (a plan
    # mismatch).
    bandwidth = setting.get("CARAMEL_TEST_RANK1_BANDWIDTH") if hvd.rank() == 1 else None
    # By default a fast compute estimate: communication is the bottleneck, so the backward
    # pass is ordered; a slow one (CARAMEL_TEST_FLOPS=2e8) spreads the gradients over
    # several buckets. force: these jobs check the plan Caramel enforces, even where it
    # predicts no gain. CARAMEL_TEST_CHAIN: the bucket_chain option ("finished" makes the
    # order strict); CARAMEL_TEST_BUCKET_BYTES: the bucket_bytes option.
    # CARAMEL_TEST_BANDWIDTH: the link every rank plans with (1 Gbit/s by default).
    OPTIONS = dict(bandwidth=bandwidth or setting.get("CARAMEL_TEST_BANDWIDTH", "1Gbit"),
                   latency=50e-6, force=True,
                   flops=float(setting.get("CARAMEL_TEST_FLOPS", 1e11)),
                   bucket_chain=setting.get("CARAMEL_TEST_CHAIN", "issued"),
                   bucket_bytes=float(setting.get("CARAMEL_TEST_BUCKET_BYTES", 4 * 2 ** 20)))
    # CARAMEL_TEST_PROFILE_STEPS: the drop-ins plan from a profiled warm-up of that many
    # steps.
    tfo_hvd.configure(**OPTIONS,
                      profile_steps=int(setting.get("CARAMEL_TEST_PROFILE_STEPS", 0)))
    PARALLEL = setting.get("CARAMEL_TEST_MODEL") == "parallel"
    CONTROL_FLOW = setting.get("CARAMEL_TEST_MODEL") == "control_flow"
    rng = np.random.default_rng(7)
    shapes = ([(16 * 16 * 3, 128)] * BRANCHES + [(128 * BRANCHES, 10)] if PARALLEL else
              [(16 * 16 * 3, 64)] + [(64, 64)] * 3 + [(64, 10)] if CONTROL_FLOW else
              [(3, 3, 3, 16), (3, 3, 16, 32), (8 * 8 * 32, 256), (256, 10)])
    initial = [rng.normal(0, 0.1, s).astype(np.float32) for s in shapes]
    data_rng = np.random.default_rng(100 + hvd.rank())
    images = data_rng.normal(size=(steps, 16, 16, 16, 3)).astype(np.float32)
    labels = data_rng.integers(0, 10, size=(steps, 16))


def forward(weights, x, y, even):
    if CONTROL_FLOW:
        h = tf.nn.relu(tf.matmul(tf.reshape(x, [16, -1]), weights[0]))
        read = weights[1].read_value if hasattr(weights[1], "read_value") else lambda: weights[1]
        _, h = tf.while_loop(lambda i, h: i < 3,
                             lambda i, h: (i + 1, tf.nn.tanh(tf.matmul(h, read()))), [0, h])
        h = tf.cond(even, lambda: tf.nn.relu(tf.matmul(h, weights[2])),
                    lambda: tf.nn.tanh(tf.matmul(h, weights[3])))
        logits = tf.matmul(h, weights[4])
        return tf.reduce_mean(tf.nn.sparse_softmax_cross_entropy_with_logits(y, logits))
    if PARALLEL:    # independent branches: their gradients have no order of their own
        flat = tf.reshape(x, [16, -1])
        h = tf.concat([tf.nn.relu(tf.matmul(flat, w)) for w in weights[:-1]], axis=1)
        logits = tf.matmul(h, weights[-1])
        return tf.reduce_mean(tf.nn.sparse_softmax_cross_entropy_with_logits(y, logits))
    h = tf.nn.relu(tf.nn.conv2d(x, weights[0], 1, "SAME"))
    h = tf.nn.max_pool2d(tf.nn.relu(tf.nn.conv2d(h, weights[1], 1, "SAME")), 2, 2, "SAME")
    h = tf.nn.relu(tf.matmul(tf.reshape(h, [-1, 8 * 8 * 32]), weights[2]))
    logits = tf.matmul(h, weights[3])
    return tf.reduce_mean(tf.nn.sparse_softmax_cross_entropy_with_logits(y, logits))


def caramel_summaries(after=()):
    """The Caramel summaries of the modified reports not in ``after`` (the process keeps
    its latest 256 reports: a count would not do in a long job)."""
    seen = {id(report) for report in after}
    reports = [r for r in tfoverlap.recent_reports() if r.modified and id(r) not in seen]
    return [p.summary for r in reports for p in r.passes if p.name == "caramel"]


def train_graph(variant):
    """Also reports the final weights (after the deferred updates' flush, for the
    "deferred" variant: the drop-in with cross_step)."""
    if variant == "deferred":
        tfo_hvd.configure(**OPTIONS, cross_step=True)
    graph = tf.Graph()
    with graph.as_default():
        weights = [tf.compat.v1.get_variable(f"w{i}", initializer=w, use_resource=True)
                   for i, w in enumerate(initial)]
        x = tf.compat.v1.placeholder(tf.float32, [16, 16, 16, 3])
        y = tf.compat.v1.placeholder(tf.int64, [16])
        even = tf.compat.v1.placeholder(tf.bool, [])
        loss = forward(weights, x, y, even)
        distributed = tfo_hvd if variant in ("dropin", "deferred") else hvd
        optimizer = distributed.DistributedOptimizer(
            tf.compat.v1.train.MomentumOptimizer(0.05, 0.9))
        train = optimizer.minimize(loss)
        init = tf.compat.v1.global_variables_initializer()
        flush = tfo_hvd.flush_op()
    if variant == "deferred":
        tfo_hvd.configure(**OPTIONS)
    config = (tfoverlap.session_config(allreduce="caramel", schedule="none", **OPTIONS)
              if variant == "flag" else None)
    losses, started = [], []
    with tf.compat.v1.Session(graph=graph, config=config) as session:
        session.run(init)
        for step in range(steps):
            metadata = tf.compat.v1.RunMetadata()
            options = tf.compat.v1.RunOptions(trace_level=tf.compat.v1.RunOptions.FULL_TRACE)
            value, _ = session.run([loss, train], {x: images[step], y: labels[step],
                                                   even: step % 2 == 0},
                                   options=options, run_metadata=metadata)
            losses.append(float(value))
            started.append({n.node_name: n.all_start_micros
                            for d in metadata.step_stats.dev_stats for n in d.node_stats})
        def digest():    # per weight: sum, sum of squares (float64), first values
            return [[float(np.sum(w, dtype=np.float64)),
                     float(np.sum(np.square(w, dtype=np.float64))), w.ravel()[:8].tolist()]
                    for w in session.run(weights)]
        if flush is not None:
            BEFORE_FLUSH[variant] = digest()
            session.run(flush)
        FINAL_WEIGHTS[variant] = digest()
    return losses, started


def train_tf2(variant):
    if variant == "flag":
        tfoverlap.enable_for_tf_function(allreduce="caramel", schedule="none", **OPTIONS)
    weights = [tf.Variable(w) for w in initial]
    optimizer = tf.keras.optimizers.SGD(0.05, momentum=0.9)
    distributed = tfo_hvd if variant == "dropin" else hvd

    @tf.function
    def train_step(x, y, even):
        with tf.GradientTape() as tape:
            loss = forward(weights, x, y, even)
        tape = distributed.DistributedGradientTape(tape)
        gradients = tape.gradient(loss, weights)
        optimizer.apply_gradients(zip(gradients, weights))
        return loss

    return [float(train_step(images[s], labels[s], tf.constant(s % 2 == 0)))
            for s in range(steps)], []


def train_keras(variant):
    """model.fit with horovod.tensorflow.keras's optimizer, or tfoverlap.horovod.keras's."""
    import horovod.tensorflow.keras as hvd_keras

    import tfoverlap.horovod.keras as tfo_keras
    if variant == "flag":
        tfoverlap.enable_for_tf_function(allreduce="caramel", schedule="none", **OPTIONS)
    layers = tf.keras.layers
    model = tf.keras.Sequential([
        layers.Conv2D(16, 3, padding="same", activation="relu", use_bias=False,
                      input_shape=(16, 16, 3)),
        layers.Conv2D(32, 3, padding="same", activation="relu", use_bias=False),
        layers.MaxPooling2D(2, 2, padding="same"), layers.Flatten(),
        layers.Dense(256, activation="relu", use_bias=False),
        layers.Dense(10, use_bias=False)])
    model.set_weights(initial)
    distributed = tfo_keras if variant == "dropin" else hvd_keras
    model.compile(optimizer=distributed.DistributedOptimizer(
        tf.keras.optimizers.legacy.SGD(0.05, momentum=0.9)),
        loss=tf.keras.losses.SparseCategoricalCrossentropy(from_logits=True))
    losses = []
    record = tf.keras.callbacks.LambdaCallback(
        on_train_batch_end=lambda batch, logs: losses.append(float(logs["loss"])))
    model.fit(images.reshape(-1, 16, 16, 3), labels.reshape(-1), batch_size=16, epochs=1,
              shuffle=False, verbose=0, callbacks=[record])
    return losses, []


FINAL_WEIGHTS: dict = {}
BEFORE_FLUSH: dict = {}
TRAIN = {"graph": train_graph, "tf2": train_tf2, "keras": train_keras}
records = []
for scenario in SCENARIOS:
    set_up(scenario)
    for variant in scenario["variants"]:
        before = tfoverlap.recent_reports()      # kept: their ids stay theirs
        function_config = get_function_config()
        losses, started = TRAIN[scenario["mode"]](variant)
        set_function_config(function_config)     # the flag is the flag variant's alone
        new = caramel_summaries(after=before)
        plan = new[-1] if new else None
        # The order the planned gradient producers (or, for plain Horovod, the same ops as
        # Caramel would order) started in, every step.
        order = (plan or {}).get("gradient_order") or [
            name for name in (started[0] if started else {})
            if "_grad/MatMul_1" in name or "Conv2DBackpropFilter" in name]
        observed = [sorted((n for n in order if n in times), key=lambda n: times[n])
                    for times in started]
        records.append({"rank": hvd.rank(), "scenario": scenario["name"],
                        "variant": variant, "losses": losses, "plan": plan,
                        "observed_orders": observed, "weights": FINAL_WEIGHTS.get(variant),
                        "before_flush": BEFORE_FLUSH.get(variant)})
        if not os.environ.get("CARAMEL_RECORDS"):
            print(json.dumps(records[-1]), flush=True)
if os.environ.get("CARAMEL_RECORDS"):
    with open(os.path.join(os.environ["CARAMEL_RECORDS"], f"rank-{hvd.rank()}.json"),
              "w") as stream:
        json.dump(records, stream)
