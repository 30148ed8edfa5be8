"""A Horovod job for tests/test_decoupled.py: two models trained STEPS steps with plain
Horovod and with tfoverlap.horovod's decouple (reduce-scatter, sharded update,
all-gather under the next forward pass) from the same initial weights, with SGD,
Momentum on a decayed rate and Adam. Between steps every rank computes a validation
loss, and rank 0 alone another one (neither may start a collective).

Also: gradients clipped after the reduction (refused), decouple="auto" below min_gain
(declined, cross-step overlap instead), and checkpoints written and read half way, with
and without decouple, against plain Horovod trained straight. Writes one JSON record per
rank (to $DECOUPLED_RECORDS/rank-N.json; $DECOUPLED_RUNS and $DECOUPLED_CHECKPOINTED,
comma-separated model/optimizer, train and checkpoint those alone;
$DECOUPLED_CHECKPOINT_KINDS, of "monitored,object", the kinds written beside Saver's):
per model, optimizer and variant, the losses, the validation values, the final weights,
the bytes of optimizer state on this rank, what was decoupled and tfoverlap's warnings;
per checkpointed run, each segment's losses and final weights, what the checkpoint holds
and what a save refused.
"""
import json
import logging
import os
import sys

import numpy as np
import tensorflow as tf

tf.compat.v1.disable_eager_execution()
import horovod.tensorflow as hvd  # noqa: E402

import tfoverlap.horovod as tfo_hvd  # noqa: E402
from job_logging import Warnings  # noqa: E402 - this directory
from tfoverlap.horovod.session.decoupling import decoupling_summary  # noqa: E402
from tfoverlap.horovod.session.deferral import deferral_summary  # noqa: E402
from tfoverlap.horovod.measure import measure_halves  # noqa: E402

STEPS = int(os.environ.get("DECOUPLED_STEPS", "100"))
# A slow link and slow compute: the plan has a backward pass to overlap.
OPTIONS = dict(bandwidth="100Mbit", latency=50e-6, flops=2.5e8, force=True,
               cycle_ms=1)  # planned for 1 ms: the job cycles at 10 (tests/helpers.py)
#: (model, optimizer) runs: each optimizer once (SGD, Momentum on a decayed rate, Adam),
#: both models
RUNS = (("chain", "sgd"), ("chain", "momentum"), ("convnet", "adam"))
#: (model, optimizer) runs whose gradients are clipped by their global norm after the
#: reduction: outside the contract, refused in one warning.
CLIPPED = (("chain", "momentum"),)
#: Runs saved and restored half way (tests/test_decoupled.py's checkpoint tests).
CHECKPOINTED = (("chain", "momentum"), ("convnet", "adam"))
#: ... and through object-based checkpoints (tf.train.Checkpoint of the optimizer).
OBJECT_CHECKPOINTED = (("convnet", "adam"),)
CHECKPOINT_STEPS = 10

hvd.init()
RANK = hvd.rank()
data = np.random.default_rng(100 + RANK)
VALIDATION = np.random.default_rng(999)


def chain(x):
    """Dense layers whose sizes do not divide by the ranks (odd biases)."""
    hidden = x
    for index, width in enumerate((61, 64, 33)):
        hidden = tf.nn.relu(tf.compat.v1.layers.dense(hidden, width, name=f"dense{index}"))
    return tf.compat.v1.layers.dense(hidden, 10, name="logits")


def convnet(x):
    images = tf.reshape(x, [-1, 8, 8, 1])
    hidden = tf.compat.v1.layers.conv2d(images, 8, 3, padding="same", activation=tf.nn.relu,
                                        name="conv0")
    hidden = tf.compat.v1.layers.conv2d(hidden, 16, 3, padding="same",
                                        activation=tf.nn.relu, name="conv1")
    return tf.compat.v1.layers.dense(tf.reshape(hidden, [-1, 8 * 8 * 16]), 10, name="logits")


MODELS = {"chain": chain, "convnet": convnet}


def optimizer_of(name, step):
    if name == "sgd":
        return tf.compat.v1.train.GradientDescentOptimizer(0.05)
    if name == "momentum":
        rate = tf.compat.v1.train.exponential_decay(0.05, step, 10, 0.8)
        return tf.compat.v1.train.MomentumOptimizer(rate, 0.9)
    return tf.compat.v1.train.AdamOptimizer(0.003)


def build(model, optimizer_name, variant, clip=False, restore_early=None):
    """The training graph of ``model`` with ``optimizer_name``, plain Horovod's or through
    tfoverlap.horovod as ``variant`` configures it, and an object-based checkpoint of its
    weights, step and optimizer: ``restore_early`` (a path) is read into it before the
    train op exists (the slots' restores wait for their variables)."""
    if variant == "decoupled":
        tfo_hvd.configure(decouple=True, cross_step=False, **OPTIONS)
        distributed = tfo_hvd
    elif variant == "declined":     # "auto" below min_gain: cross-step overlap instead
        tfo_hvd.configure(decouple="auto", cross_step=True, min_gain=0.99,
                          **{**OPTIONS, "bandwidth": "4Mbit", "flops": 2.5e6})
        distributed = tfo_hvd
    else:
        distributed = hvd
    graph = tf.Graph()
    with graph.as_default():
        x = tf.compat.v1.placeholder(tf.float32, [32, 64])
        y = tf.compat.v1.placeholder(tf.int64, [32])
        step = tf.compat.v1.train.get_or_create_global_step()
        loss = tf.reduce_mean(tf.nn.sparse_softmax_cross_entropy_with_logits(
            y, MODELS[model](x)))
        weights = tf.compat.v1.trainable_variables()
        inner = optimizer_of(optimizer_name, step)
        optimizer = distributed.DistributedOptimizer(inner)
        checkpoint = tf.compat.v1.train.Checkpoint(
            optimizer=inner, step=step, **{f"w{index}": w for index, w in enumerate(weights)})
        checkpoint.save_counter.initializer     # created now: written and initialized too
        restoring = None if restore_early is None else checkpoint.restore(restore_early)
        if clip:
            pairs = optimizer.compute_gradients(loss)
            clipped, _ = tf.clip_by_global_norm([g for g, _ in pairs], 0.5)
            train_op = optimizer.apply_gradients(zip(clipped, [v for _, v in pairs]),
                                                 global_step=step)
        else:
            train_op = optimizer.minimize(loss, global_step=step)
        init = tf.compat.v1.global_variables_initializer()
        broadcast = hvd.broadcast_global_variables(0)
        # What the optimizer holds on this rank: its slots (a shard of each bucket where
        # decoupled) and its other variables (Adam's beta powers).
        state = optimizer.variables()
    tfo_hvd.configure()
    return dict(graph=graph, x=x, y=y, loss=loss, weights=weights, train=train_op,
                init=init, broadcast=broadcast, state=state, checkpoint=checkpoint,
                restoring=restoring)


def train(model, optimizer_name, variant, inputs, labels, validation, clip=False):
    built = build(model, optimizer_name, variant, clip)
    graph, x, y, loss, weights = (built[k] for k in ("graph", "x", "y", "loss", "weights"))
    record = {}
    with tf.compat.v1.Session(graph=graph) as session:
        session.run(built["init"])
        initial = np.random.default_rng(7)       # the same start in every variant
        for weight in weights:
            weight.load(initial.normal(0, 0.1, weight.shape).astype(np.float32), session)
        session.run(built["broadcast"])
        losses, validations = [], []
        for index in range(STEPS):
            losses.append(float(session.run([loss, built["train"]],
                                            {x: inputs[index], y: labels[index]})[0]))
            if index % 10 == 9:           # every rank alike, then rank 0 alone
                validations.append(float(session.run(loss, {x: validation[0],
                                                            y: validation[1]})))
                if RANK == 0:
                    validations.append(float(session.run(loss, {x: validation[0],
                                                                y: validation[1]})))
        record["losses"] = losses
        record["validations"] = validations
        record["final"] = [w.tolist() for w in session.run(weights)]
        record["optimizer_bytes"] = int(sum(v.shape.num_elements() * 4
                                            for v in built["state"]
                                            if v.shape.num_elements() > 1))
    record["decoupled"] = decoupling_summary(graph)
    record["deferred"] = deferral_summary(graph)
    return record


def barrier():
    """Every rank waits here for the others (a checkpoint rank 0 wrote is complete)."""
    with tf.Graph().as_default():
        done = hvd.allreduce(tf.constant(0.0), name="barrier")
        with tf.compat.v1.Session() as session:
            session.run(done)


def segment(model, optimizer_name, variant, inputs, labels, first, steps, restore=None,
            restore_on="every rank", save=None, consolidate=True, saver="Saver"):
    """Trains steps ``first`` to ``first + steps``: from ``restore`` (a checkpoint, read on
    every rank, or on rank 0 alone and broadcast) or the common initial weights; rank 0
    alone saves to ``save`` at the end (after every rank consolidated, if asked).
    ``saver``: "Saver", or "Checkpoint" (object-based), which restores before the train
    op exists ("Checkpoint early") or after. Returns the losses, the final weights and
    what the save raised."""
    restores = restore is not None and (restore_on == "every rank" or RANK == 0)
    early = restore if restores and saver == "Checkpoint early" else None
    built = build(model, optimizer_name, variant, restore_early=early)
    graph, x, y, loss, weights = (built[k] for k in ("graph", "x", "y", "loss", "weights"))
    with graph.as_default():
        if saver == "Saver":
            saver = tf.compat.v1.train.Saver()
        else:
            saver = ObjectSaver(built["checkpoint"], built["restoring"])
    record = {}
    with tf.compat.v1.Session(graph=graph) as session:
        session.run(built["init"])
        if restore is None:
            initial = np.random.default_rng(7)
            for weight in weights:
                weight.load(initial.normal(0, 0.1, weight.shape).astype(np.float32), session)
        elif restores:
            saver.restore(session, restore)
        session.run(built["broadcast"])
        record["losses"] = [float(session.run([loss, built["train"]],
                                              {x: inputs[i], y: labels[i]})[0])
                            for i in range(first, first + steps)]
        if save is not None:
            if not consolidate and RANK == 0:     # rank 0 alone: the state is sharded
                try:
                    saver.save(session, save + "-unconsolidated")
                    record["unconsolidated_save"] = "saved"
                except tf.errors.OpError as error:
                    record["unconsolidated_save"] = error.message
            tfo_hvd.consolidate_optimizer_state(session)
            if RANK == 0:
                saver.save(session, save)
        record["final"] = [w.tolist() for w in session.run(weights)]
    if save is not None:
        barrier()
        record["saved"] = sorted(map(list, tf.train.list_variables(save)))
    return record


class ObjectSaver:
    """A Saver's save and restore, through an object-based checkpoint (restored early
    where ``restoring``, the status of a restore, is given)."""

    def __init__(self, checkpoint, restoring=None):
        self.checkpoint, self.restoring = checkpoint, restoring

    def restore(self, session, path):
        status = self.restoring or self.checkpoint.restore(path)
        status.assert_consumed().run_restore_ops(session)

    def save(self, session, path):
        written = self.checkpoint.write(path, session=session)
        assert written == path, written


def monitored(model, optimizer_name, variant, inputs, labels, directory, last_step, every):
    """Trains in a MonitoredTrainingSession whose CheckpointSaverHook runs on rank 0 alone
    (every ``every`` steps, and at the end), as Horovod's examples do, from the common
    initial weights. Returns the losses, the checkpoints written and every value of the
    last one."""
    built = build(model, optimizer_name, variant)
    graph, x, y, loss, weights = (built[k] for k in ("graph", "x", "y", "loss", "weights"))

    def load_initial(_, session):
        initial = np.random.default_rng(7)
        for weight in weights:
            weight.load(initial.normal(0, 0.1, weight.shape).astype(np.float32), session)

    losses = []
    with graph.as_default():
        hooks = [hvd.BroadcastGlobalVariablesHook(0),
                 tf.compat.v1.train.StopAtStepHook(last_step=last_step)]
        with tf.compat.v1.train.MonitoredTrainingSession(
                checkpoint_dir=directory if RANK == 0 else None, hooks=hooks,
                scaffold=tf.compat.v1.train.Scaffold(init_fn=load_initial),
                save_checkpoint_steps=every, save_checkpoint_secs=None,
                save_summaries_steps=None, save_summaries_secs=None,
                log_step_count_steps=None) as session:
            while not session.should_stop():
                index = len(losses)
                losses.append(float(session.run([loss, built["train"]],
                                                {x: inputs[index], y: labels[index]})[0]))
    barrier()
    saved = list(tf.train.get_checkpoint_state(directory).all_model_checkpoint_paths)
    return {"losses": losses, "saved": saved,
            "last": {name: tf.train.load_variable(saved[-1], name).ravel().tolist()
                     for name, _ in tf.train.list_variables(saved[-1])}}


def checkpoints(directory, inputs, labels) -> dict:
    """Plain Horovod trained 2 x HALF steps straight, against: decoupled for HALF steps,
    saved on rank 0, then plain Horovod from that checkpoint; plain, saved, then
    decoupled from it restored on rank 0 alone and broadcast; decoupled, saved, then
    decoupled restored on every rank. Also a save on rank 0 without consolidating, and a
    save before the first step."""
    half, runs = min(CHECKPOINT_STEPS, STEPS // 2), {}
    chosen = os.environ.get("DECOUPLED_CHECKPOINTED")
    checkpointed = ([tuple(run.split("/")) for run in chosen.split(",")] if chosen
                    else CHECKPOINTED)
    kinds = os.environ.get("DECOUPLED_CHECKPOINT_KINDS", "monitored,object").split(",")
    for model, name in checkpointed:
        path = os.path.join(directory, f"{model}-{name}")
        entry = {"straight": segment(model, name, "horovod", inputs, labels, 0, 2 * half),
                 "initial": segment(model, name, "decoupled", inputs, labels, 0, 0,
                                    save=path + "-initial", consolidate=False)}
        first = segment(model, name, "decoupled", inputs, labels, 0, half,
                        save=path + "-decoupled", consolidate=False)
        entry["decoupled_then_plain"] = [first, segment(
            model, name, "horovod", inputs, labels, half, half, restore=path + "-decoupled")]
        first = segment(model, name, "horovod", inputs, labels, 0, half, save=path + "-plain")
        entry["plain_then_decoupled"] = [first, segment(
            model, name, "decoupled", inputs, labels, half, half, restore=path + "-plain",
            restore_on="rank 0")]
        entry["decoupled_then_decoupled"] = [entry["decoupled_then_plain"][0], segment(
            model, name, "decoupled", inputs, labels, half, half, restore=path + "-decoupled")]
        runs[f"{model}/{name}"] = entry
    for model, name in checkpointed[:1] if "monitored" in kinds else ():
        path = os.path.join(directory, f"{model}-{name}-monitored")
        # Every 6 of 20 steps: the third save with decouple, postponed, falls on the last.
        entry = {variant: monitored(model, name, variant, inputs, labels, f"{path}-{variant}",
                                    2 * half, (2 * half + 1) // 3 - 1)
                 for variant in ("horovod", "decoupled")}
        middle = next(p for p in entry["decoupled"]["saved"]
                      if 0 < int(p.rsplit("-", 1)[1]) < 2 * half)
        step = int(middle.rsplit("-", 1)[1])
        entry["continued"] = segment(model, name, "horovod", inputs, labels, step,
                                     2 * half - step, restore=middle)
        entry["straight"] = runs[f"{model}/{name}"]["straight"]
        runs[f"{model}/{name}/monitored"] = entry
    for model, name in [run for run in OBJECT_CHECKPOINTED
                        if run in checkpointed and "object" in kinds]:
        path = os.path.join(directory, f"{model}-{name}-object")
        straight = runs[f"{model}/{name}"]["straight"]
        decoupled = segment(model, name, "decoupled", inputs, labels, 0, half,
                            save=path + "-decoupled", saver="Checkpoint")
        plain = segment(model, name, "horovod", inputs, labels, 0, half,
                        save=path + "-plain", saver="Checkpoint")
        runs[f"{model}/{name}/object"] = {
            "straight": straight,
            "decoupled_then_plain": [decoupled, segment(
                model, name, "horovod", inputs, labels, half, half,
                restore=path + "-decoupled", saver="Checkpoint early")],
            "plain_then_decoupled": [plain, segment(
                model, name, "decoupled", inputs, labels, half, half, restore=path + "-plain",
                restore_on="rank 0", saver="Checkpoint early")],
            "decoupled_then_decoupled": [decoupled, segment(
                model, name, "decoupled", inputs, labels, half, half,
                restore=path + "-decoupled", saver="Checkpoint")]}
    return runs


def main():
    records = {}
    inputs = data.normal(size=(STEPS, 32, 64)).astype(np.float32)
    labels = data.integers(0, 10, size=(STEPS, 32))
    validation = (VALIDATION.normal(size=(32, 64)).astype(np.float32),
                  VALIDATION.integers(0, 10, size=32))
    caught = Warnings()
    logging.getLogger("tfoverlap").addHandler(caught)
    chosen = os.environ.get("DECOUPLED_RUNS")
    if chosen:          # these runs alone, without the refused and declined ones
        runs = [(*run.split("/"), False, "decoupled") for run in chosen.split(",")]
    else:
        runs = [(model, name, False, "decoupled") for model, name in RUNS]
        runs += [(model, name, True, "decoupled") for model, name in CLIPPED]
        runs += [("chain", "momentum", False, "declined")]
    for model, optimizer_name, clip, other in runs:
        entry = {}
        for variant in ("horovod", other):
            caught.messages = []
            try:
                entry[variant] = train(model, optimizer_name, variant, inputs, labels,
                                       validation, clip)
            except Exception as error:  # noqa: BLE001 - recorded for the test
                entry[variant] = {"error": f"{type(error).__name__}: {error}"}
            entry[variant]["warnings"] = caught.messages
        records[f"{model}/{optimizer_name}" + ("/clip" if clip else "")
                + ("/declined" if other == "declined" else "")] = entry
    directory = os.environ["DECOUPLED_RECORDS"]
    saved = checkpoints(directory, inputs, labels)
    halves = measure_halves(repeats=2)
    with open(os.path.join(directory, f"rank-{RANK}.json"), "w") as stream:
        json.dump({"rank": RANK, "size": hvd.size(), "records": records,
                   "checkpoints": saved, "halves": halves}, stream)
    print(f"rank {RANK} done", flush=True)


if __name__ == "__main__":
    sys.exit(main())
