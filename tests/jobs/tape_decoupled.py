"""A Horovod job for tests/test_tape_decoupled.py: TF2 custom training loops (a
``DistributedGradientTape`` step in a loop inside one ``tf.function``) trained with
horovod.tensorflow's tape and with tfoverlap.horovod's under ``configure(decouple=True)``
(reduce-scatter, sharded update, all-gather under the next forward pass), from the same
initial weights, on two models and Keras' decouplable optimizers.

Each run is CALLS calls of STEPS steps ($TAPE_DECOUPLED_STEPS, default 100 in all);
$TAPE_DECOUPLED_RUNS (comma-separated; empty: none) trains those runs alone, without the
patterns.
Between calls the program reads the weights, and rank 0 alone evaluates a loss (no
collective may start). Also: patterns outside the contract (refused, trained as Horovod),
an iterator that runs out, a read after the update (a clear error), "auto", and
checkpoints written and read with and without decoupling (:func:`checkpointed`). Writes
one JSON record per rank ($TAPE_DECOUPLED_RECORDS/rank-N.json): per run and variant, the
losses, the weights seen between calls, rank 0's evaluations, the final weights and whole optimizer slots, the step counter, the bytes of
optimizer state on this rank, the decisions, tfoverlap's warnings and any error.
"""
import json
import logging
import os
import tempfile

import numpy as np
import tensorflow as tf
import horovod.tensorflow as hvd  # noqa: E402

import tfoverlap.horovod as tfo_hvd  # noqa: E402
from tfoverlap.horovod.adapters import tape as tape_adapter  # noqa: E402
from tfoverlap.horovod.core.decisions import recent_decisions  # noqa: E402
from tfoverlap.horovod.in_call.checkpoints import shard_state_bytes, whole_slots  # noqa: E402
from job_logging import Warnings  # noqa: E402 - this directory

# A slow link and slow compute: the plan has a backward pass to overlap.
OPTIONS = dict(bandwidth="100Mbit", latency=50e-6, flops=2.5e8, force=True,
               cycle_ms=1)  # planned for 1 ms: the job cycles at 10 (tests/helpers.py)
TOTAL = int(os.environ.get("TAPE_DECOUPLED_STEPS", "100"))
CALLS = 4
STEPS = TOTAL // CALLS
BATCH = 16
#: each optimizer once, on the chain (SGD with momentum: the patterns; Adam on the convnet
#: and the legacy Adam: CHECKPOINTED, trained through a checkpoint)
RUNS = ("chain/sgd", "chain/adamw", "chain/legacy_momentum", "chain/schedule")
#: patterns of chain/momentum that differ from the plain loop
PATTERNS = ("input_runs_out", "built_first", "clipped", "late_read", "auto",
            "second_optimizer")
#: runs saved after their first call, and restored (tests/test_tape_decoupled.py);
#: $TAPE_DECOUPLED_CHECKPOINTED (comma-separated) chooses among them
CHECKPOINTED = ("convnet/adam", "chain/legacy_adam")
SHARED = os.environ.get("TAPE_DECOUPLED_RECORDS") or tempfile.mkdtemp()

hvd.init()
RANK = hvd.rank()
data = np.random.default_rng(100 + RANK)
INPUTS = tf.constant(data.normal(size=(TOTAL, BATCH, 64)).astype(np.float32))
LABELS = tf.constant(data.integers(0, 10, size=(TOTAL, BATCH)))
VALIDATION = np.random.default_rng(999).normal(size=(BATCH, 64)).astype(np.float32)
LOSS = tf.keras.losses.SparseCategoricalCrossentropy(from_logits=True)


def model_for(name):
    """chain: dense layers whose sizes do not divide by the ranks; convnet: two
    convolutions and a dense layer."""
    tf.keras.utils.set_random_seed(7)
    if name == "chain":
        layers = [tf.keras.layers.Dense(width, activation="relu", name=f"dense{index}")
                  for index, width in enumerate((61, 64, 33))]
    else:
        layers = [tf.keras.layers.Reshape((8, 8, 1)),
                  tf.keras.layers.Conv2D(8, 3, padding="same", activation="relu",
                                         name="conv0"),
                  tf.keras.layers.Conv2D(16, 3, padding="same", activation="relu",
                                         name="conv1"),
                  tf.keras.layers.Flatten()]
    return tf.keras.Sequential([tf.keras.Input((64,))] + layers
                               + [tf.keras.layers.Dense(10, name="logits")])


def optimizer_for(name):
    keras = tf.keras.optimizers
    return {"sgd": lambda: keras.SGD(0.05),
            "momentum": lambda: keras.SGD(0.05, momentum=0.9),
            "adam": lambda: keras.Adam(0.003),
            "adamw": lambda: keras.AdamW(0.003, weight_decay=0.05),
            "legacy_momentum": lambda: keras.legacy.SGD(0.05, momentum=0.9),
            "legacy_adam": lambda: keras.legacy.Adam(0.003),
            "schedule": lambda: keras.SGD(keras.schedules.ExponentialDecay(0.1, 10, 0.7),
                                          momentum=0.9),
            "clipped": lambda: keras.SGD(0.05, momentum=0.9, global_clipnorm=1.0)}[name]()


def train_function(pattern, model, optimizer, tape_wrapper):
    """The program's loop of STEPS steps per call; returns the call's losses."""
    def step(inputs, labels):
        with tf.GradientTape() as tape:
            loss = LOSS(labels, model(inputs, training=True))
        tape = tape_wrapper(tape)
        gradients = tape.gradient(loss, model.trainable_variables)
        optimizer.apply_gradients(zip(gradients, model.trainable_variables))
        if pattern == "late_read":
            loss += 0.0 * tf.reduce_sum(model.trainable_variables[0])
        return loss

    if pattern == "input_runs_out":
        # 2 batches short: next() raises inside the last call, after STEPS - 2 steps.
        batches = iter(tf.data.Dataset.from_tensor_slices((INPUTS, LABELS)).take(TOTAL - 2))

        @tf.function
        def loop_over_iterator(first):
            losses = tf.TensorArray(tf.float32, size=STEPS)
            for i in tf.range(STEPS):
                inputs, labels = next(batches)
                losses = losses.write(i, step(inputs, labels))
            return losses.stack()
        return loop_over_iterator

    @tf.function
    def loop(first):
        losses = tf.TensorArray(tf.float32, size=STEPS)
        for i in tf.range(STEPS):
            losses = losses.write(i, step(INPUTS[first + i], LABELS[first + i]))
        return losses.stack()
    return loop


def slots_of(model, optimizer, variant) -> dict:
    """{variable name: {slot name: values}}: the whole optimizer state."""
    if variant == "tfoverlap":
        gathered = whole_slots(optimizer)
        if gathered:
            return {v.name: {name: np.asarray(value).ravel().tolist()
                             for name, value in gathered[v.ref()].items()}
                    for v in model.trainable_variables}
    state = {}
    for v in model.trainable_variables:
        if isinstance(optimizer, tf.keras.optimizers.Optimizer):
            suffix = f"/{v._shared_name}:0"
            slots = {s.name[:-len(suffix)].rsplit("/", 1)[-1]: s
                     for s in optimizer.variables[1:] if s.name.endswith(suffix)}
        else:
            slots = {name: optimizer.get_slot(v, name) for name in optimizer.get_slot_names()}
        state[v.name] = {name: np.asarray(s).ravel().tolist() for name, s in slots.items()}
    return state


def state_bytes(optimizer, variant) -> int:
    """The bytes of the optimizer's slots on this rank."""
    if variant == "tfoverlap" and shard_state_bytes(optimizer):
        return shard_state_bytes(optimizer)
    variables = optimizer.variables
    variables = variables() if callable(variables) else variables
    return sum(int(np.prod(v.shape)) * 4 for v in variables if v.shape.rank)


def train(run, pattern, variant):
    model_name, optimizer_name = run.split("/")
    wrapper = (tfo_hvd.DistributedGradientTape if variant == "tfoverlap"
               else hvd.DistributedGradientTape)
    model, optimizer = model_for(model_name), optimizer_for(optimizer_name)
    hvd.broadcast_variables(model.variables, root_rank=0)
    if pattern == "built_first":
        # Built, restored on rank 0 alone (its slots set there), broadcast.
        optimizer.build(model.trainable_variables)
        if RANK == 0:
            for slot in optimizer.variables[1:]:
                slot.assign(tf.fill(slot.shape, 0.01))
        hvd.broadcast_variables(optimizer.variables, root_rank=0)
    record = {"losses": [], "seen": [], "rank0_evaluate": []}
    function = train_function(pattern, model, optimizer, wrapper)
    for call in range(CALLS):
        try:
            record["losses"].append(function(tf.constant(call * STEPS)).numpy().tolist())
        except tf.errors.OutOfRangeError:       # input_runs_out: the program's end of data
            record["losses"].append("out of range")
        record["seen"].append([w.ravel()[:8].tolist() for w in model.get_weights()])
        if pattern == "second_optimizer" and call == 1:
            # A new optimizer for the same model after call 1 (a recompile): fresh state.
            optimizer = optimizer_for(optimizer_name)
            function = train_function(pattern, model, optimizer, wrapper)
        if RANK == 0:   # rank 0 alone evaluates between calls: no collective may start
            record["rank0_evaluate"].append(
                float(tf.reduce_sum(model(VALIDATION, training=False))))
    record["weights"] = [w.ravel().tolist() for w in model.get_weights()]
    record["slots"] = slots_of(model, optimizer, variant)
    record["iterations"] = int(optimizer.iterations)
    record["state_bytes"] = state_bytes(optimizer, variant)
    record["optimizer_variables"] = len(optimizer_variables(optimizer))
    # What the tape left for an apply_gradients to find once its loops were traced.
    record["gradients_left_for_apply"] = len(tape_adapter._by_gradient)  # noqa: SLF001
    return record


def optimizer_variables(optimizer) -> list:
    variables = optimizer.variables
    return list(variables() if callable(variables) else variables)


def go_on(model, optimizer, function) -> dict:
    """Calls 1 to CALLS - 1 of ``function``: their losses, the final weights and state."""
    losses = [function(tf.constant(call * STEPS)).numpy().tolist() for call in range(1, CALLS)]
    return {"losses": losses, "weights": [w.ravel().tolist() for w in model.get_weights()],
            "slots": slots_of(model, optimizer, "tfoverlap")}


def checkpointed(run) -> dict:
    """``run`` saved on rank 0 after its first call (decoupled: first without, then after
    consolidate_optimizer_state), then (a) one more call, the checkpoint read on rank 0
    into the same objects and broadcast, and the run trained on; (b) a new model and
    optimizer read from the other variant's checkpoint, and a decoupled one from its own,
    before their first step (plain: on every rank; decoupled: on rank 0 alone) and
    trained on. Also, per variant: the first call's losses, the bytes of optimizer state
    at the end and the decisions."""
    model_name, optimizer_name = run.split("/")
    record, paths = {}, {}
    for variant in ("horovod", "tfoverlap"):
        wrapper = (tfo_hvd.DistributedGradientTape if variant == "tfoverlap"
                   else hvd.DistributedGradientTape)
        model, optimizer = model_for(model_name), optimizer_for(optimizer_name)
        hvd.broadcast_variables(model.variables, root_rank=0)
        function = train_function("exact", model, optimizer, wrapper)
        decided = len(recent_decisions())
        first_call = function(tf.constant(0)).numpy().tolist()
        checkpoint = tf.train.Checkpoint(model=model, optimizer=optimizer)
        paths[variant] = os.path.join(SHARED, f"{run.replace('/', '-')}-{variant}")
        segment = {}
        if variant == "tfoverlap" and RANK == 0:
            try:
                checkpoint.write(paths[variant] + "-unconsolidated")
                segment["unconsolidated"] = "written"
            except ValueError as error:
                segment["unconsolidated"] = str(error)
        segment["consolidated"] = tfo_hvd.consolidate_optimizer_state()
        if RANK == 0:
            checkpoint.write(paths[variant])
            reader = tf.train.load_checkpoint(paths[variant])
            segment["saved"] = {name: reader.get_tensor(name).ravel().tolist()
                                for name in sorted(reader.get_variable_to_shape_map())
                                if not name.startswith("_CHECKPOINTABLE")}
        hvd.allreduce(tf.constant(0.0), name=f"saved_{variant}")    # the file is there
        function(tf.constant(STEPS))
        if RANK == 0:
            checkpoint.read(paths[variant])
        hvd.broadcast_variables(model.variables + optimizer_variables(optimizer), root_rank=0)
        segment["restored_midway"] = go_on(model, optimizer, function)
        segment.update(first_call=first_call, state_bytes=state_bytes(optimizer, variant),
                       decisions=recent_decisions()[decided:])
        record[variant] = segment
    for variant, source in (("horovod", "tfoverlap"), ("tfoverlap", "horovod"),
                            ("tfoverlap", "tfoverlap")):
        wrapper = (tfo_hvd.DistributedGradientTape if variant == "tfoverlap"
                   else hvd.DistributedGradientTape)
        model, optimizer = model_for(model_name), optimizer_for(optimizer_name)
        if variant == "horovod" or RANK == 0:
            tf.train.Checkpoint(model=model, optimizer=optimizer).read(paths[source])
        # The step counter; decoupled, the slots go from rank 0 when the step is built.
        hvd.broadcast_variables(model.variables + [optimizer.iterations], root_rank=0)
        function = train_function("exact", model, optimizer, wrapper)
        record[f"{variant}_from_{source}"] = go_on(model, optimizer, function)
    return record


def main():
    warnings = Warnings()
    logging.getLogger("tfoverlap").addHandler(warnings)
    chosen = os.environ.get("TAPE_DECOUPLED_RUNS")
    if chosen is not None:      # these runs alone (none if empty), without the patterns
        runs = [(run, "exact") for run in chosen.split(",") if run]
    else:
        runs = [(run, "exact") for run in RUNS] + [
            ("chain/momentum", pattern) for pattern in PATTERNS if pattern != "clipped"] + [
            ("chain/clipped", "clipped")]
    records = {}
    for run, pattern in runs:
        name = run if pattern == "exact" else f"{run}/{pattern}"
        records[name] = {}
        tfo_hvd.configure(**OPTIONS, cross_step=False,
                          decouple="auto" if pattern == "auto" else True)
        for variant in ("horovod", "tfoverlap"):
            warnings.messages.clear()
            decided = len(recent_decisions())
            try:
                record = train(run, pattern, variant)
            except Exception as error:  # noqa: BLE001 - the test reads it
                record = {"error": f"{type(error).__name__}: {error}"}
            record["decisions"] = recent_decisions()[decided:]
            record["warnings"] = list(warnings.messages)
            records[name][variant] = record
    tfo_hvd.configure(**OPTIONS, cross_step=False, decouple=True)
    checkpointed_runs = os.environ.get("TAPE_DECOUPLED_CHECKPOINTED")
    for run in checkpointed_runs.split(",") if checkpointed_runs else CHECKPOINTED:
        warnings.messages.clear()
        try:
            record = checkpointed(run)
        except Exception as error:  # noqa: BLE001 - the test reads it
            record = {"error": f"{type(error).__name__}: {error}"}
        record["warnings"] = list(warnings.messages)
        records.setdefault("checkpoints", {})[run] = record
    out = os.environ.get("TAPE_DECOUPLED_RECORDS")
    if out:
        with open(os.path.join(out, f"rank-{RANK}.json"), "w") as f:
            json.dump(records, f)
    print(json.dumps({"rank": RANK, "runs": sorted(records)}))


if __name__ == "__main__":
    main()
