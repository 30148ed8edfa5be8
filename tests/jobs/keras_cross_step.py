"""A Horovod job for tests/test_cross_step.py: Keras ``model.fit`` patterns, each trained
with horovod.tensorflow.keras and with tfoverlap.horovod.keras (cross-step overlap) from
the same initial weights, on a chain of dense layers whose first layers' reductions are
deferred.

argv: the patterns to run (default: all of :data:`PATTERNS`). Prints one JSON line per
rank: per pattern and variant, every loss the callbacks saw, the weights a callback read
after each call, the validation losses, the checkpoint written after the first epoch
(every tensor), the final weights and optimizer variables, the decision, tfoverlap's
warnings and any error.
"""
import json
import logging
import os
import sys
import tempfile

import numpy as np
import tensorflow as tf
import horovod.tensorflow.keras as hvd_keras  # noqa: E402

import tfoverlap.horovod as tfo_hvd  # noqa: E402
import tfoverlap.horovod.keras as tfo_keras  # noqa: E402
from job_logging import Warnings  # noqa: E402 - this directory
from keras_optimizers import optimizer_for  # noqa: E402 - this directory

#: "what the program does/its optimizer" (the optimizer alone where the name is one): each
#: optimizer is tried once, beside one of the program's features. Not AdamW where the input
#: runs out: its decay does not wait for the gradient, and plain TensorFlow applies it to
#: some variables in the step that found no input, before the error ends the step.
PATTERNS = ("validation/sgd", "schedule", "checkpoint/adamw", "input_runs_out/adam",
            "embedding/legacy_momentum", "embedding_dense/legacy_adam",
            "one_step_per_call", "clipnorm", "auto")
# A slow link and slow compute: the plan's ring has a tail to defer.
OPTIONS = dict(bandwidth="4Mbit", latency=50e-6, flops=1e7, force=True,
               cycle_ms=1)  # planned for 1 ms: the job cycles at 10 (tests/helpers.py)
WIDTHS = [64, 64, 64, 10]
BATCH, STEPS = 32, 10
CHECKPOINTS = os.environ.get("CROSS_STEP_CHECKPOINTS") or tempfile.mkdtemp()

hvd_keras.init()
RANK = hvd_keras.rank()
data = np.random.default_rng(100 + RANK)
INPUTS = data.normal(size=(STEPS * BATCH, 64)).astype(np.float32)
LABELS = data.integers(0, 10, size=(STEPS * BATCH,))
VALIDATION = (np.random.default_rng(999).normal(size=(BATCH, 64)).astype(np.float32),
              np.random.default_rng(998).integers(0, 10, size=(BATCH,)))


class Counted(tf.keras.Sequential):
    """A Sequential that counts the traces of its train step (``traces``)."""

    traces = 0

    def train_step(self, data):
        type(self).traces += 1
        return super().train_step(data)


def model_for(pattern):
    tf.keras.utils.set_random_seed(7)
    layers = [tf.keras.layers.Dense(width, activation="relu" if i < len(WIDTHS) - 1 else None,
                                    name=f"dense{i}") for i, width in enumerate(WIDTHS)]
    if pattern.startswith("embedding"):
        # The first layer's gradient (ready last) is sparse (IndexedSlices): Horovod
        # gathers it, and it is never deferred; the dense layers after it may be. With
        # sparse_as_dense (embedding_dense) it is reduced dense, and may be deferred.
        return Counted([tf.keras.Input((8,)), tf.keras.layers.Embedding(
            100, 8, name="embedding"), tf.keras.layers.Flatten()] + layers)
    if pattern == "schedule":   # no input shape: built by its first call, as in Horovod's
        return Counted(layers)  # examples
    return Counted([tf.keras.Input((64,))] + layers)


def inputs_for(pattern):
    if pattern.startswith("embedding"):
        return np.abs(INPUTS[:, :8] * 30).astype(np.int64) % 100
    return INPUTS


def _op_types(library, function_name, seen=None):
    """The op types in a library function and in the functions it calls."""
    seen = set() if seen is None else seen
    if function_name in seen or function_name not in library:
        return set()
    seen.add(function_name)
    types = set()
    for node in library[function_name].node_def:
        types.add(node.op)
        for value in node.attr.values():
            if value.HasField("func"):
                types |= _op_types(library, value.func.name, seen)
    return types


def deferred_reductions(model):
    """In the traced train function, the conditional reductions of deferred chunks: how
    many, whether they run one after another (one request each), whether any waits for an
    update of a variable (as it did when a chunk's reduction and update were one
    conditional), and whether each waits for the step's input."""
    function = model.train_function.__wrapped__
    concrete = function._list_all_concrete_functions()[0]
    library = {f.signature.name: f for f in concrete.graph.as_graph_def().library.function}

    def writes(types):
        return any(t.startswith("ResourceApply") or (t.startswith("Assign")
                                                      and t.endswith("VariableOp"))
                   for t in types)

    found = {"reductions": 0, "chained": True, "wait_for_updates": False,
             "after_input": True}
    for body in library.values():
        nodes = {node.name: node for node in body.node_def}
        contents = {name: _op_types(library, node.attr["then_branch"].func.name)
                    for name, node in nodes.items() if node.op in ("If", "StatelessIf")}
        reductions = [name for name in nodes if "HorovodAllreduce" in contents.get(name, ())]

        def ancestors(name):
            stack, seen = [name], set()
            while stack:
                for source in nodes[stack.pop()].input:
                    source = source.lstrip("^").split(":")[0]
                    if source in nodes and source not in seen:
                        seen.add(source)
                        stack.append(source)
            return seen

        before = {name: ancestors(name) for name in reductions}
        for i, one in enumerate(reductions):       # one after another, in some order
            for other in reductions[i + 1:]:
                found["chained"] &= one in before[other] or other in before[one]
        for name in reductions:
            found["wait_for_updates"] |= any(
                writes(contents[a]) for a in before[name] | {name} if a in contents)
            found["after_input"] &= any(nodes[a].op.startswith("IteratorGetNext")
                                        for a in before[name])
        found["reductions"] += len(reductions)
    return found


def train(pattern, variant):
    distributed = tfo_keras if variant == "tfoverlap" else hvd_keras
    if pattern == "auto":       # the default mode: the plan decides
        tfo_hvd.configure(**OPTIONS, cross_step="auto")
    try:
        return _train(pattern, variant, distributed)
    finally:
        tfo_hvd.configure(cross_step=True, **OPTIONS)


def _train(pattern, variant, distributed):
    pattern, _, optimizer_name = pattern.partition("/")
    optimizer_name = optimizer_name or pattern
    model = model_for(pattern)
    model.compile(optimizer=distributed.DistributedOptimizer(
                      optimizer_for(optimizer_name),
                      sparse_as_dense=pattern == "embedding_dense"),
                  loss=tf.keras.losses.SparseCategoricalCrossentropy(from_logits=True),
                  # (rank 0 alone evaluating a model with compiled metrics hangs
                  # horovod.tensorflow.keras itself: the validation pattern has none)
                  metrics=[] if pattern == "validation" else ["accuracy"],
                  steps_per_execution=1 if pattern == "one_step_per_call" else 4)
    record = {"losses": [], "seen": []}
    Counted.traces = 0

    class Look(tf.keras.callbacks.Callback):
        """What user code sees between calls: the loss and the weights."""

        def on_train_batch_end(self, batch, logs=None):
            record["losses"].append(float(logs["loss"]))
            record["seen"].append(float(sum(np.sum(w, dtype=np.float64)
                                            for w in self.model.get_weights())))

        def on_epoch_end(self, epoch, logs=None):
            if pattern == "validation" and RANK == 0:
                # An evaluation on rank 0 alone: no collective may start.
                record.setdefault("rank0_evaluate", []).append(
                    float(self.model.evaluate(*VALIDATION, verbose=0)))

    callbacks = [hvd_keras.callbacks.BroadcastGlobalVariablesCallback(0), Look()]
    fit = dict(batch_size=BATCH, shuffle=False, verbose=0, callbacks=callbacks)
    if pattern == "validation":
        fit["validation_data"] = VALIDATION
    if pattern == "checkpoint":
        # Epoch 1, a checkpoint on rank 0, a fresh model restored from it and broadcast,
        # then epoch 2: what a restarted job does.
        path = os.path.join(CHECKPOINTS, f"{variant}-{RANK}")
        model.fit(inputs_for(pattern), LABELS, epochs=1, **fit)
        # (The first model's traces: the fresh one's optimizer is built before its fit,
        # so the deferral's buffers are the only variables its first trace creates, and
        # TensorFlow traces a function that creates variables twice.)
        record["step_traces"] = Counted.traces
        checkpoint = tf.train.Checkpoint(model=model, optimizer=model.optimizer)
        written = checkpoint.write(path)
        reader = tf.train.load_checkpoint(written)
        record["checkpoint"] = {name: reader.get_tensor(name).ravel()[:6].tolist()
                                for name in sorted(reader.get_variable_to_shape_map())
                                if not name.startswith("_CHECKPOINTABLE")}
        model = model_for(pattern)
        model.compile(optimizer=distributed.DistributedOptimizer(
                          optimizer_for(optimizer_name)),
                      loss=tf.keras.losses.SparseCategoricalCrossentropy(from_logits=True),
                      steps_per_execution=4)
        model.optimizer.build(model.trainable_variables)
        tf.train.Checkpoint(model=model, optimizer=model.optimizer).read(written)
        history = model.fit(inputs_for(pattern), LABELS, epochs=1, **fit)
    elif pattern == "input_runs_out":
        # A dataset shorter than the steps asked for: it runs out inside the third call,
        # after 2 of its 4 steps, and Keras ends the training there.
        dataset = tf.data.Dataset.from_tensor_slices((inputs_for(pattern), LABELS)).batch(
            BATCH, drop_remainder=True)
        fit.pop("batch_size")
        history = model.fit(dataset, epochs=2, steps_per_epoch=STEPS + 2, **fit)
        record["batches"] = STEPS
    else:
        history = model.fit(inputs_for(pattern), LABELS, epochs=2, **fit)
    record["history"] = {key: [float(v) for v in values]
                         for key, values in history.history.items()}
    record["weights"] = [w.ravel().tolist() for w in model.get_weights()]
    record["optimizer"] = [np.asarray(v).ravel()[:16].tolist()
                           for v in model.optimizer.variables]
    record.setdefault("step_traces", Counted.traces)
    record["decision"] = tfo_keras.cross_step_decision(model) if variant == "tfoverlap" else None
    if variant == "tfoverlap" and pattern != "auto":
        record["deferred_reductions"] = deferred_reductions(model)
    if variant == "tfoverlap" and pattern.startswith("embedding"):
        from tfoverlap.horovod.adapters.keras_fit import _deferrals
        deferral = _deferrals[model]
        record["deferred_names"] = sorted(deferral.variables[i].name
                                          for i in deferral.deferred)
    return record


tfo_hvd.configure(cross_step=True, **OPTIONS)
caught = Warnings()
logging.getLogger("tfoverlap").addHandler(caught)
patterns = sys.argv[1:] or PATTERNS
result = {"rank": RANK}
for pattern in patterns:
    result[pattern] = {}
    for variant in ("horovod", "tfoverlap"):
        caught.messages.clear()
        try:
            result[pattern][variant] = train(pattern, variant)
        except Exception as error:  # noqa: BLE001 - reported to the test
            result[pattern][variant] = {"error": f"{type(error).__name__}: {error}"}
        result[pattern][variant]["warnings"] = list(caught.messages)
RECORD = json.dumps(result)
if os.environ.get("CROSS_STEP_RECORDS"):   # a file: the launcher's forwarding of a long
    with open(os.path.join(os.environ["CROSS_STEP_RECORDS"], f"rank-{RANK}.json"),
              "w") as stream:              # last line is not relied on
        stream.write(RECORD)
print(RECORD, flush=True)
