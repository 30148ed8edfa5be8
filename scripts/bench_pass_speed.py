"""How long the TicTac pass and one simulated iteration take on a large real graph.

Goals: the pass in TIC < 1 s and TAC < 2 s; one simulated iteration < 1 s.

Builds Keras ResNet-152 (no weights) as a TF1 training graph with its variables spread over
PS tasks by replica_device_setter, then times ``tfoverlap.optimize`` (plan + rewrite +
verification, the same code the plugin runs) for TIC and TAC, interleaved, and prints
medians and spreads.

    .venv/bin/python scripts/bench_pass_speed.py [--model ResNet152] [--ps 2] [--repeats 5]
        [--learning-phase]
"""
from __future__ import annotations

import argparse
import statistics
import time


def build_training_graph(model_name: str, num_ps: int, batch: int = 8,
                         learning_phase: bool = False):
    """The model's TF1 training graph; with ``learning_phase``, batch norm's training flag
    is a placeholder and control flow is TF1's (Switch/Merge in every batch norm), as
    Grappler sees such graphs once TensorFlow has lowered their conds."""
    import tensorflow as tf
    from tensorflow.python.ops import control_flow_util
    control_flow_util.ENABLE_CONTROL_FLOW_V2 = not learning_phase
    graph = tf.Graph()
    with graph.as_default():
        setter = tf.compat.v1.train.replica_device_setter(
            ps_tasks=num_ps, worker_device="/job:worker/task:0")
        with tf.compat.v1.device(setter):
            application = getattr(tf.keras.applications, model_name)
            model = application(weights=None, input_shape=(224, 224, 3), classes=1000)
            images = tf.random.uniform([batch, 224, 224, 3])
            labels = tf.random.uniform([batch], maxval=1000, dtype=tf.int32)
            training = (tf.compat.v1.placeholder_with_default(True, [], "learning_phase")
                        if learning_phase else True)
            logits = model(images, training=training)
            loss = tf.reduce_mean(tf.keras.losses.sparse_categorical_crossentropy(
                labels, logits))
            tf.compat.v1.train.GradientDescentOptimizer(0.01).minimize(
                loss, var_list=model.trainable_variables)
    return graph.as_graph_def(), len(model.trainable_variables)


def main(argv=None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--model", default="ResNet152")
    parser.add_argument("--ps", type=int, default=2)
    parser.add_argument("--repeats", type=int, default=5)
    parser.add_argument("--learning-phase", action="store_true",
                        help="batch norm's training flag as a placeholder (TF1 conds)")
    args = parser.parse_args(argv)

    import tfoverlap
    started = time.perf_counter()
    graph_def, num_trainable = build_training_graph(args.model, args.ps,
                                                    learning_phase=args.learning_phase)
    print(f"{args.model}: {len(graph_def.node)} nodes, {num_trainable} trainable variables "
          f"on {args.ps} PS tasks (built in {time.perf_counter() - started:.1f} s)")
    timings: dict[str, list[float]] = {"tic": [], "tac": []}
    summaries = {}
    for _ in range(args.repeats):
        for schedule in timings:  # interleaved
            start = time.perf_counter()
            _, report = tfoverlap.optimize(graph_def, schedule=schedule)
            timings[schedule].append(time.perf_counter() - start)
            summaries[schedule] = report.passes[0].summary
    print(f"{'schedule':<9}{'transfers':>10}{'left out':>9}{'edges':>7}{'median s':>10}"
          f"{'min s':>8}{'max s':>8}")
    for schedule, values in timings.items():
        summary = summaries[schedule]
        left_out = sum(summary.get("transfers_left_out", {}).values())
        print(f"{schedule:<9}{summary['transfers']:>10}{left_out:>9}"
              f"{summary['ordering_edges']:>7}{statistics.median(values):>10.3f}"
              f"{min(values):>8.3f}{max(values):>8.3f}")

    # One simulated iteration: a TIC prediction with one seed is three simulations (the
    # iteration, comm-only, comp-only) plus building the tasks; a third of it, conservatively.
    from tfoverlap.sim.whatif import Scenario, predict
    per_iteration = []
    for _ in range(args.repeats):
        start = time.perf_counter()
        predict(graph_def, Scenario(workers=8, seeds=1), ["tic"])
        per_iteration.append((time.perf_counter() - start) / 3)
    print(f"one simulated iteration (tasks built included): "
          f"{statistics.median(per_iteration):.3f} s median of {args.repeats}")
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
