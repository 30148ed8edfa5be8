"""One rank of the Horovod benchmark's Keras job: ``model.fit`` of every variant, in turns
(or, with ``--loop tape``, a TF2 custom loop: ``DistributedGradientTape`` steps in a loop
inside one ``tf.function``).

Run by :mod:`tfoverlap.bench.allreduce` (``--api keras``) as a Horovod job, one rank per
emulated host. Every variant is the same model (a ``tf.keras.applications`` model, or the
transformer of :func:`tfoverlap.testbed.models.transformer_network`), batch and seed,
compiled with ``steps_per_execution`` (the same for all, what a Keras user sets for
cross-step overlap) and trained on one synthetic batch repeated. The transformer's
embedding gradient is reduced dense in every variant, as in graph mode.

  horovod        ``horovod.tensorflow.keras.DistributedOptimizer`` as is.
  horovod_again  the same again: the A/A row.
  autotune       the same; meant for a job with ``HOROVOD_AUTOTUNE=1`` (process-wide).
  ddp25          Horovod's optimizer with explicit groups as PyTorch DDP buckets them
                 (:func:`tfoverlap.bench.allreduce_worker.ddp_groups`).
  caramel        ``tfoverlap.horovod.keras.DistributedOptimizer``, default options
                 (cross-step overlap where "auto" predicts a gain).
  caramel_cross_step  the same with ``configure(cross_step=True)``: the gradients ready
                 last reduced under the next step's forward pass within each call.
  compute_only   the same model with a local optimizer: the step without communication.

A block of a variant is one ``fit`` of ``--calls + 1`` calls of the train function; the
time of each call but the first (from one ``on_train_batch_end`` to the next, so with the
drain of what its last step left pending) divided by ``steps_per_execution`` is one
step's time. With ``--loop tape`` the variants are horovod, horovod_again (Horovod's
tape), caramel (tfoverlap.horovod's, default options) and caramel_decoupled
(``configure(decouple=True)``), each a ``tf.function`` of
``steps_per_execution`` steps in a ``tf.range`` loop; a block is ``--calls + 1`` calls of
it, each call's time but the first's divided by its steps one step's time. Blocks rotate
every round. Rank 0 prints one JSON line shaped like
:mod:`tfoverlap.bench.allreduce_worker`'s.
"""
from __future__ import annotations

import argparse
import json
import sys
import time

__all__ = ["VARIANTS", "TAPE_VARIANTS", "main"]

VARIANTS = ("horovod", "horovod_again", "autotune", "ddp25", "caramel", "caramel_cross_step",
            "compute_only")
TAPE_VARIANTS = ("horovod", "horovod_again", "autotune", "caramel", "caramel_decoupled")


def _model(args):
    import tensorflow as tf

    from tfoverlap.testbed.models import (KERAS_APPLICATIONS, TRANSFORMER_SEQUENCE,
                                          transformer_network)
    tf.keras.utils.set_random_seed(args.seed)
    if args.model == "transformer":
        tokens = tf.keras.Input((TRANSFORMER_SEQUENCE,), dtype=tf.int32)
        return tf.keras.Model(tokens, transformer_network(tokens)[0])
    return getattr(tf.keras.applications, KERAS_APPLICATIONS[args.model])(
        weights=None, input_shape=(args.image_size, args.image_size, 3), classes=1000,
        classifier_activation=None)     # logits, as the loss is told


def _build(variant: str, args, emulation: dict):
    """The compiled model of ``variant`` after its first (untimed) call, which traces it
    and runs the Grappler passes under that variant's function config; and that config.
    TensorFlow instantiates a function anew for another config, so every later call of
    the variant's functions must be made under it too."""
    import horovod.tensorflow.keras as hvd_keras
    import tensorflow as tf

    import tfoverlap
    import tfoverlap.horovod as tfo_hvd
    import tfoverlap.horovod.keras as tfo_keras
    from tfoverlap.integrations.tf_function import get_function_config, set_function_config
    from tfoverlap.bench.allreduce_worker import ddp_groups
    previous = get_function_config()
    optimizer = tf.keras.optimizers.SGD(0.01, momentum=0.9)
    sparse_as_dense = args.model == "transformer"
    try:
        model = _model(args)
        if variant.startswith("caramel"):
            tfo_hvd.configure(**emulation, **({"cross_step": True}
                                              if variant == "caramel_cross_step" else {}))
            optimizer = tfo_keras.DistributedOptimizer(   # and its function config
                optimizer, sparse_as_dense=sparse_as_dense)
        else:
            if emulation:
                tfoverlap.enable_for_tf_function(schedule="none", **emulation)
            if variant == "ddp25":
                optimizer = hvd_keras.DistributedOptimizer(
                    optimizer, groups=ddp_groups(model.trainable_variables),
                    sparse_as_dense=sparse_as_dense)
            elif variant != "compute_only":
                optimizer = hvd_keras.DistributedOptimizer(optimizer,
                                                           sparse_as_dense=sparse_as_dense)
        model.compile(optimizer=optimizer,
                      loss=tf.keras.losses.SparseCategoricalCrossentropy(from_logits=True),
                      steps_per_execution=args.steps_per_execution)
        model.fit(_dataset(args), steps_per_epoch=args.steps_per_execution * args.warmup,
                  epochs=1, verbose=0)
        config = get_function_config()
    finally:
        set_function_config(previous)
        tfo_hvd.configure()
    return model, config


def _build_tape_loop(variant: str, args, emulation: dict):
    """``--loop tape``: ``variant``'s train function (``steps_per_execution`` steps of a
    ``DistributedGradientTape`` step in a ``tf.range`` loop) after its first (untimed)
    calls, and its function config."""
    import horovod.tensorflow as hvd
    import tensorflow as tf

    import tfoverlap
    import tfoverlap.horovod as tfo_hvd
    from tfoverlap.integrations.tf_function import get_function_config, set_function_config
    previous = get_function_config()
    try:
        model = _model(args)
        optimizer = tf.keras.optimizers.SGD(0.01, momentum=0.9)
        loss_function = tf.keras.losses.SparseCategoricalCrossentropy(from_logits=True)
        if variant.startswith("caramel"):
            tfo_hvd.configure(**emulation, **({"decouple": True, "cross_step": False}
                                              if variant == "caramel_decoupled" else {}))
            wrapper = tfo_hvd.DistributedGradientTape
        else:
            if emulation:
                tfoverlap.enable_for_tf_function(schedule="none", **emulation)
            wrapper = hvd.DistributedGradientTape
        # Batches from an iterator inside the loop, as programs take them (a batch carried
        # into the loop has no static shape in its lowered frame: nothing is emulated).
        batches = iter(_dataset(args))
        sparse_as_dense = args.model == "transformer"

        @tf.function
        def train(steps):
            loss = tf.constant(0.0)
            for _ in tf.range(steps):
                inputs, labels = next(batches)
                with tf.GradientTape() as tape:
                    loss = loss_function(labels, model(inputs, training=True))
                tape = wrapper(tape, sparse_as_dense=sparse_as_dense)
                gradients = tape.gradient(loss, model.trainable_variables)
                optimizer.apply_gradients(zip(gradients, model.trainable_variables))
            return loss

        steps = tf.constant(args.steps_per_execution)
        for _ in range(args.warmup):
            train(steps).numpy()
        config = get_function_config()
    finally:
        set_function_config(previous)
        tfo_hvd.configure()
    return (train, steps), config


def _dataset(args):
    import tensorflow as tf

    from tfoverlap.testbed.models import TRANSFORMER_SEQUENCE, TRANSFORMER_VOCABULARY
    if args.model == "transformer":
        inputs = tf.random.stateless_uniform([args.batch, TRANSFORMER_SEQUENCE],
                                             seed=[args.seed, 1], maxval=TRANSFORMER_VOCABULARY,
                                             dtype=tf.int32)
        classes = TRANSFORMER_VOCABULARY
    else:
        inputs = tf.random.stateless_uniform(
            [args.batch, args.image_size, args.image_size, 3], seed=[args.seed, 1])
        classes = 1000
    labels = tf.random.stateless_uniform([args.batch], seed=[args.seed, 2], maxval=classes,
                                         dtype=tf.int32)
    return tf.data.Dataset.from_tensors((inputs, labels)).repeat()


def _block(model, config, args) -> tuple[list[float], list[float]]:
    """One fit of ``--calls + 1`` calls under the variant's function ``config`` (with
    ``--loop tape``: as many calls of its loop): per-step wall and CPU seconds of the last
    ones."""
    import tensorflow as tf

    from tfoverlap.integrations.tf_function import get_function_config, set_function_config
    marks = []

    class Mark(tf.keras.callbacks.Callback):
        def on_train_batch_end(self, batch, logs=None):
            marks.append((time.perf_counter(), time.process_time()))

    previous = get_function_config()
    set_function_config(config)
    try:
        if args.loop == "tape":
            train, steps = model
            for _ in range(args.calls + 1):
                train(steps).numpy()
                marks.append((time.perf_counter(), time.process_time()))
        else:
            model.fit(_dataset(args),
                      steps_per_epoch=args.steps_per_execution * (args.calls + 1),
                      epochs=1, verbose=0, callbacks=[Mark()])
    finally:
        set_function_config(previous)
    per_step = float(args.steps_per_execution)
    wall = [(b[0] - a[0]) / per_step for a, b in zip(marks, marks[1:])]
    cpu = [(b[1] - a[1]) / per_step for a, b in zip(marks, marks[1:])]
    return wall, cpu


def main(argv=None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--model", required=True)
    parser.add_argument("--batch", type=int, required=True)
    parser.add_argument("--image-size", type=int, default=224)
    parser.add_argument("--variants", default="horovod,horovod_again,ddp25,caramel")
    parser.add_argument("--rounds", type=int, default=3)
    parser.add_argument("--calls", type=int, default=2,
                        help="timed calls of the train function per block")
    parser.add_argument("--steps-per-execution", type=int, default=4)
    parser.add_argument("--warmup", type=int, default=2, help="untimed calls per variant")
    parser.add_argument("--seed", type=int, default=0)
    parser.add_argument("--emulate", default="", help="a device model or file")
    parser.add_argument("--dilation", type=float, default=1.0)
    parser.add_argument("--loop", choices=("fit", "tape"), default="fit",
                        help="fit: model.fit; tape: DistributedGradientTape steps in a "
                             "tf.range loop inside one tf.function")
    args = parser.parse_args(argv)
    variants = args.variants.split(",")
    unknown = [v for v in variants if v not in (TAPE_VARIANTS if args.loop == "tape"
                                                else VARIANTS)]
    if unknown:
        print(f"unknown variant {unknown[0]!r}; choose from {', '.join(VARIANTS)}",
              file=sys.stderr)
        return 2
    import horovod.tensorflow.keras as hvd_keras
    hvd_keras.init()
    import tfoverlap
    import tfoverlap.horovod as tfo_hvd
    import tfoverlap.horovod.keras as tfo_keras
    from tfoverlap.bench.dilation import busy_fraction, cpu_sample
    emulation = {"emulate": args.emulate, "dilation": args.dilation} if args.emulate else {}
    began = time.perf_counter()
    built, caramel = {}, {}
    from tfoverlap.horovod.core.decisions import recent_decisions
    for variant in variants:
        mark = tfoverlap.report_count()
        decisions_before = len(recent_decisions())
        build = _build_tape_loop if args.loop == "tape" else _build
        built[variant] = build(variant, args, emulation)
        if variant.startswith("caramel"):
            summary = next((p.summary for r in tfoverlap.recent_reports(since=mark)
                            for p in r.passes if p.name == "caramel"), None) or {}
            decision = (tfo_keras.cross_step_decision(built[variant][0]) if args.loop == "fit"
                        else (recent_decisions()[decisions_before:] or [None])[-1]) or {}
            summary = {key: value for key, value in summary.items()
                       if key != "allreduces_left_out_names"}
            if "decoupled" in decision:
                caramel[variant] = {**summary, "decouple": decision}
            else:
                caramel[variant] = {**summary, "cross_step": {
                    **decision, "deferred_bytes": decision.get("deferred_mb", 0) * 1e6}}
    build_seconds = time.perf_counter() - began
    times = {variant: [] for variant in variants}
    cpu = {variant: [] for variant in variants}
    before = cpu_sample()
    for round_number in range(args.rounds):
        shift = round_number % len(variants)
        for variant in variants[shift:] + variants[:shift]:
            wall, used = _block(*built[variant], args)
            times[variant].extend(wall)
            cpu[variant].extend(used)
    host_busy = busy_fraction(before, cpu_sample())
    model = _model(args) if args.loop == "tape" else next(iter(built.values()))[0]
    if hvd_keras.rank() == 0:
        print(json.dumps({
            "model": args.model, "batch": args.batch, "ranks": hvd_keras.size(),
            "api": "tape" if args.loop == "tape" else "keras",
            "steps_per_execution": args.steps_per_execution,
            "parameter_bytes": sum(v.shape.num_elements() * v.dtype.size
                                   for v in model.trainable_variables),
            "tensors": len(model.trainable_variables), "times": times, "cpu": cpu,
            "host_busy": host_busy, "build_seconds": build_seconds, "traced": {},
            "calmed_threads": 0, "network_model": tfo_hvd.network_model(),
            "caramel": caramel}), flush=True)
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
