"""cross_step's contract, on 2 Horovod ranks (tests/jobs/cross_step_contract.py, and the
Keras and tape jobs further down, in the suite's one job of 2 Gloo ranks: conftest's
``horovod_jobs``): for each pattern of a TF1 training program, every value a run returns, every checkpoint
tensor and the final weights are plain Horovod's bit for bit; programs outside the
contract are refused in one warning or stopped with a clear error before any collective."""
import os
import sys

import pytest

from tests.helpers import HorovodJob, run_plain_program_with_and_without

JOB = os.path.join(os.path.dirname(__file__), "jobs", "cross_step_contract.py")

EXACT = ["plain_loop", "validation", "rank0_validation", "batch_norm", "checkpoint",
         "restore_plain_checkpoint", "flush_midway", "two_optimizers", "schedule", "adam",
         "nesterov", "make_callable", "monitored_session", "end_of_input"]


def _cross_step_env(directory) -> dict:
    """A cross-step job's environment: checkpoints in ``directory``, each rank's JSON
    record in its records/ (a file: a long last line of output may not come through
    horovodrun)."""
    (directory / "records").mkdir()
    return {"CROSS_STEP_CHECKPOINTS": directory, "CROSS_STEP_RECORDS": directory / "records"}


RECORD = "records/rank-{rank}.json"
HOROVOD_JOBS = {
    "cross_step_graph": HorovodJob(JOB, _cross_step_env, disables_eager=True),
    "cross_step_keras": HorovodJob(
        os.path.join(os.path.dirname(__file__), "jobs", "keras_cross_step.py"),
        _cross_step_env),
    "cross_step_tape": HorovodJob(
        os.path.join(os.path.dirname(__file__), "jobs", "tape_cross_step.py"),
        _cross_step_env),
}


@pytest.fixture(scope="module")
def patterns(horovod_jobs):
    """Each rank's record of each pattern and variant."""
    return [record["patterns"] for record in horovod_jobs.records("cross_step_graph", RECORD)]


@pytest.mark.parametrize("pattern", EXACT)
def test_every_value_checkpoint_and_weight_is_horovods(patterns, pattern):
    """Something was deferred, and what the program sees is plain Horovod's, bit for bit:
    - validation: a loss-only run on every rank between steps (each gradient once);
    - rank0_validation: the same on rank 0 alone (no collective; exact, no hang);
    - batch_norm: the optimizer built inside control_dependencies(UPDATE_OPS) (no cycle);
    - checkpoint: saved after step 2, restored on rank 0 in a new session and broadcast;
    - restore_plain_checkpoint: a checkpoint written by plain Horovod restores;
    - flush_midway: the flush in mid-training (Momentum gets no extra update);
    - two_optimizers: a second deferring optimizer trained in its own runs;
    - schedule, adam, nesterov: a decayed rate, Adam's beta powers, Nesterov momentum;
    - make_callable, monitored_session: a step callable, and MonitoredTrainingSession
      with Horovod's broadcast hook (a finalized graph);
    - end_of_input: after each step, a run over an exhausted input fails at once while it
      applies the pending update (the update completes; none is lost or applied twice)."""
    for rank, records in enumerate(patterns):
        plain, deferred = records[pattern]["horovod"], records[pattern]["cross_step"]
        assert "error" not in plain and "error" not in deferred, (rank, plain, deferred)
        assert deferred["deferred"].get("deferred", 0) >= 1, (rank, deferred["deferred"])
        assert deferred["values"] == plain["values"], rank
        assert deferred.get("checkpoint") == plain.get("checkpoint"), rank
        assert deferred["final"] == plain["final"], rank
        assert deferred["warnings"] == [], (rank, deferred["warnings"])
        decision = deferred["decisions"][-1]      # what the Caramel report says
        assert decision["deferred"] >= 1 and decision["mode"] == "on", decision
        assert decision["predicted_step_ms"] > 0 and decision["in_step_ms"] > 0, decision
    if pattern == "two_optimizers":
        assert all(r[pattern]["cross_step"]["deferred"]["optimizers"] == 2 for r in patterns)
    if pattern == "checkpoint":
        assert patterns[0][pattern]["cross_step"]["checkpoint"], "nothing was saved"


@pytest.mark.parametrize("pattern, warning", [
    ("clip", "is not the reduced gradient (changed after the reduction, e.g. clipped"),
    ("accumulation", "backward_passes_per_step > 1: Horovod's own reduction is used"),
    # TensorFlow would ignore the waits added to the reads the session already has.
    ("built_in_session", "a session already ran this graph with w0/"),
    ("ref_variables", "not resource variables (tf.compat.v1.disable_v2_behavior() makes"),
])
def test_a_program_outside_the_contract_is_refused_in_one_warning_and_trains_exactly(
        patterns, pattern, warning):
    for rank, records in enumerate(patterns):
        plain, deferred = records[pattern]["horovod"], records[pattern]["cross_step"]
        assert deferred["deferred"] == {}, rank
        assert len(deferred["warnings"]) == 1 and warning in deferred["warnings"][0], \
            deferred["warnings"]
        assert deferred["values"] == plain["values"] and deferred["final"] == plain["final"]


def test_on_by_default_it_defers_nothing_below_min_gain_and_the_report_says_why(patterns):
    for records in patterns:
        record = records["auto_declined"]["cross_step"]
        assert record["deferred"] == {} and record["warnings"] == [], record["warnings"]
        decision, = record["decisions"]
        assert decision["mode"] == "auto" and decision["deferred"] == 0, decision
        assert "below min_gain 99.0%" in decision["reason"], decision
        assert record["values"] == records["auto_declined"]["horovod"]["values"]


def test_a_reduced_gradient_used_after_the_step_is_built_stops_before_any_run(patterns):
    """A global norm of the reduced gradients built after apply_gradients cannot be had
    (the deferred ones are reduced in the next step): the first run stops with an error
    that says what to do, before any collective."""
    for records in patterns:
        assert "error" not in records["gradient_after"]["horovod"]
        error = records["gradient_after"]["cross_step"]["error"]
        assert error.startswith("DeferralError: tfoverlap: cross_step: "), error
        assert "before the optimizer's apply_gradients is built" in error, error


def _chain_graph(defer: bool, clip: bool = False, chunks=((0,), (1,))):
    """Three tanh layers trained with Momentum; the reduction is an Identity (one
    process), so the deferral's machinery runs without Horovod: the background run, the
    waits of every later use, the stored step values. Returns the graph's parts."""
    import numpy as np
    import tensorflow as tf
    from tfoverlap.horovod.session.deferral import defer_updates
    rng = np.random.default_rng(3)
    graph = tf.Graph()
    with graph.as_default():
        weights = [tf.compat.v1.get_variable(f"w{i}", initializer=rng.normal(
            0, 0.3, (8, 8)).astype(np.float32), use_resource=True) for i in range(3)]
        x = tf.compat.v1.placeholder(tf.float32, [4, 8])
        hidden = x
        for weight in weights:
            hidden = tf.tanh(tf.matmul(hidden, weight))
        loss = tf.reduce_mean(tf.square(hidden))
        local = tf.gradients(loss, weights)
        stand_ins = [tf.identity(g, name=f"reduce{i}") for i, g in enumerate(local)]
        reduced = [tf.identity(s) for s in stand_ins]
        step = tf.compat.v1.train.get_or_create_global_step()
        optimizer = tf.compat.v1.train.MomentumOptimizer(
            tf.compat.v1.train.exponential_decay(0.2, step, 1, 0.8), 0.9)
        grads = tf.clip_by_global_norm(reduced, 1.0)[0] if clip else reduced
        pairs = list(zip(grads, weights))

        def apply_in_step(kept):
            return optimizer.apply_gradients(kept, global_step=step)
        train = (defer_updates(optimizer, pairs, local, reduced, [s.op for s in stand_ins],
                               [list(c) for c in chunks], apply_in_step)
                 if defer else apply_in_step(pairs))
        init = tf.compat.v1.global_variables_initializer()
    return dict(graph=graph, weights=weights, x=x, loss=loss, train=train, init=init,
                reduced=reduced, saver=None)


def _train_chain(model, steps=4):
    """Losses, validation losses between the steps, final weights (read, not flushed)."""
    import numpy as np
    import tensorflow as tf
    data = np.random.default_rng(5).normal(size=(steps + 1, 4, 8)).astype(np.float32)
    losses, validations = [], []
    with tf.compat.v1.Session(graph=model["graph"]) as session:
        session.run(model["init"])
        for index in range(steps):
            losses.append(session.run([model["loss"], model["train"]],
                                      {model["x"]: data[index]})[0])
            validations.append(session.run(model["loss"], {model["x"]: data[steps]}))
        return losses, validations, session.run(model["weights"])


def test_deferred_updates_are_applied_once_by_whichever_run_uses_the_variable_first():
    """With an Identity for the reduction (no Horovod): training with loss-only runs
    between the steps gives the in-step losses, validation losses and weights bit for
    bit (each deferred gradient applied once, with its own step's decayed rate), and the
    first layer's forward read waits for its chunk's apply."""
    import numpy as np
    from tfoverlap.horovod.session.deferral import deferral_summary
    plain = _train_chain(_chain_graph(defer=False))
    model = _chain_graph(defer=True)
    assert deferral_summary(model["graph"])["deferred"] == 2
    deferred = _train_chain(model)
    assert [float(v) for v in deferred[0]] == [float(v) for v in plain[0]]
    assert [float(v) for v in deferred[1]] == [float(v) for v in plain[1]]
    assert all(np.array_equal(a, b) for a, b in zip(deferred[2], plain[2]))
    read = next(op for op in model["weights"][0].handle.consumers()
                if op.type == "ReadVariableOp" and op.outputs[0].consumers()
                and op.outputs[0].consumers()[0].type == "MatMul")
    assert any(control.name.startswith("tfoverlap/deferred/chunk0/apply")
               for control in read.control_inputs), read.control_inputs


def test_a_clip_after_the_reduction_defers_nothing_and_says_why(caplog):
    import logging
    from tfoverlap.horovod.session.deferral import deferral_summary
    caplog.set_level(logging.WARNING, logger="tfoverlap")
    model = _chain_graph(defer=True, clip=True)
    assert deferral_summary(model["graph"]) == {}
    assert "w0 is not the reduced gradient" in caplog.text


def test_a_use_of_a_deferred_reduced_gradient_built_later_stops_every_run():
    """It exists only in the background run: a run that needed it would wait for ever."""
    import tensorflow as tf
    from tfoverlap.horovod.session.pending import DeferralError
    model = _chain_graph(defer=True)
    with model["graph"].as_default():
        tf.norm(model["reduced"][0], name="gradient_norm")
    with tf.compat.v1.Session(graph=model["graph"]) as session:
        for _ in range(2):          # every run, not only the first
            with pytest.raises(DeferralError, match="gradient_norm/mul uses the reduced "
                                                    "gradient Identity:0"):
                session.run(model["init"])


@pytest.mark.parametrize("value", ["yes", 1, None, "Auto"])
def test_a_cross_step_setting_other_than_true_false_or_auto_is_named(value):
    import tfoverlap.horovod as tfo_hvd
    with pytest.raises(ValueError, match='cross_step must be True, False or "auto"'):
        tfo_hvd.configure(cross_step=value)


# Keras model.fit (tests/jobs/keras_cross_step.py): the pending state lives inside one call
# of the train function (steps_per_execution=4) and is drained before it returns.
KERAS_EXACT = ["validation/sgd", "schedule", "checkpoint/adamw", "input_runs_out/adam",
               "embedding/legacy_momentum", "embedding_dense/legacy_adam"]


@pytest.fixture(scope="module")
def keras_patterns(horovod_jobs):
    """Each rank's record of each Keras pattern and variant."""
    return horovod_jobs.records("cross_step_keras", RECORD)


@pytest.mark.parametrize("pattern", KERAS_EXACT)
def test_keras_fit_defers_and_every_value_checkpoint_and_weight_is_horovods(keras_patterns,
                                                                           pattern):
    """Something was deferred, and what user code sees is horovod.tensorflow.keras's, bit
    for bit: every loss a callback got, the weights a callback read after each call, the
    history (with validation losses), the checkpoint written after the first epoch and
    restored into a new model, the final weights and the optimizer's variables. Each
    pattern is "what the program does/its optimizer", so that every optimizer is tried
    once: Keras' SGD, Adam (its step count) and AdamW (its decay), the legacy SGD with
    momentum and Adam, and:
    - schedule: SGD with momentum at an exponentially decayed rate (each update at its
      own step's rate), on a Sequential without an input shape (built by its first call);
    - validation: validation_data, and rank 0 alone evaluating after each epoch (no
      collective: exact values, no hang);
    - checkpoint: a tf.train.Checkpoint of model and optimizer after epoch 1, restored in
      a new model that trains epoch 2;
    - embedding: an Embedding first (its sparse gradient, ready last, stays in the step;
      dense layers after it are deferred);
    - embedding_dense: the same with sparse_as_dense=True: the embedding's gradient,
      reduced dense as Horovod would, may be deferred too (the plan prefers the top
      layers here, which the next forward pass needs last);
    - input_runs_out: a dataset shorter than ``steps_per_epoch``; it runs out inside a
      call, after 2 of its 4 steps, and Keras ends the training there. The last step's
      deferred update is applied, once (its reductions wait for the next step's input,
      so a step without input leaves it whole for the drain)."""
    feature = pattern.split("/")[0]
    for rank, records in enumerate(keras_patterns):
        plain, deferred = records[pattern]["horovod"], records[pattern]["tfoverlap"]
        assert "error" not in plain and "error" not in deferred, (rank, plain, deferred)
        decision = deferred["decision"]
        assert decision["deferred"] >= 1 and decision["mode"] == "on", decision
        assert decision["drains"] >= 1 and decision["drain_ms"] > 0, decision
        for key in ("losses", "seen", "history", "checkpoint", "weights", "optimizer",
                    "rank0_evaluate"):
            if key == "optimizer" and feature == "input_runs_out":
                # Keras' own step counter counts the step that found no input (its
                # increment waits for nothing) where deferral's counts the updates.
                assert deferred[key][1:] == plain[key][1:], rank
                assert deferred[key][0] == [deferred["batches"]], rank
                continue
            assert deferred.get(key) == plain.get(key), (rank, key)
        assert deferred["warnings"] == [], (rank, deferred["warnings"])
        # The plan is made from AutoGraph's trial trace of the multi-step loop: the step
        # is traced as often as under Horovod alone.
        assert deferred["step_traces"] == plain["step_traces"] >= 2, rank
    # Chunk by chunk, one request each, as planned: each deferred chunk's reduction waits
    # for the one before it and for the step's input, and none waits for an update.
    for records in keras_patterns:
        reductions = records[pattern]["tfoverlap"]["deferred_reductions"]
        chunks = records[pattern]["tfoverlap"]["decision"]["chunks"]
        assert reductions["reductions"] == len(chunks), (reductions, chunks)
        assert reductions["chained"] and not reductions["wait_for_updates"], reductions
        assert reductions["after_input"], reductions
    if feature == "validation":
        assert len(keras_patterns[0][pattern]["tfoverlap"]["rank0_evaluate"]) == 2
    if feature == "checkpoint":
        assert keras_patterns[0][pattern]["tfoverlap"]["checkpoint"]
    if feature == "embedding":
        for records in keras_patterns:
            names = records[pattern]["tfoverlap"]["deferred_names"]
            assert not any(name.startswith("embedding") for name in names), names


def test_keras_fit_lets_the_plan_decide_by_default_and_stays_exact(keras_patterns):
    """"auto", the default, decides in Keras by Caramel's plan, as in graph mode (the
    8-rank emulated row defers: docs/benchmarks.md). On this small chain the drain of
    each call outweighs what deferring saves, so the plan declines and says by how much;
    training is plain Horovod's, bit for bit."""
    for records in keras_patterns:
        plain, run = records["auto"]["horovod"], records["auto"]["tfoverlap"]
        assert "error" not in plain and "error" not in run, (plain, run)
        decision = run["decision"]
        assert decision["mode"] == "auto" and "predicted_gain" in decision, decision
        assert decision["in_step_ms"] > 0 and decision["drain_predicted_ms"] > 0, decision
        if not decision["deferred"]:
            assert "min_gain" in decision["reason"], decision
        assert run["losses"] == plain["losses"] and run["weights"] == plain["weights"]
        assert run["optimizer"] == plain["optimizer"]


@pytest.mark.parametrize("pattern, reason", [
    ("one_step_per_call", "steps_per_execution"), ("clipnorm", "clipping")])
def test_keras_fit_outside_the_contract_defers_nothing_says_why_and_trains_exactly(
        keras_patterns, pattern, reason):
    """One step per call (nothing to overlap within a call) and a global-norm clip (it
    needs every reduced gradient of the step): nothing deferred, the decision says why,
    and training is plain Horovod's."""
    for records in keras_patterns:
        plain, deferred = records[pattern]["horovod"], records[pattern]["tfoverlap"]
        assert "error" not in deferred, deferred
        assert deferred["decision"]["deferred"] == 0
        assert reason in deferred["decision"]["reason"], deferred["decision"]
        assert deferred["losses"] == plain["losses"]
        assert deferred["weights"] == plain["weights"]


# TF2 custom loops (tests/jobs/tape_cross_step.py): a DistributedGradientTape step in a
# loop inside one tf.function; the pending state lives inside one call and is drained
# after the loop.
TAPE_EXACT = ["between_calls/sgd", "schedule", "iterator/legacy_adam", "input_runs_out/adam",
              "checkpoint/adamw"]


@pytest.fixture(scope="module")
def tape_patterns(horovod_jobs):
    """Each rank's record of each tape pattern and variant."""
    return horovod_jobs.records("cross_step_tape", RECORD)


@pytest.mark.parametrize("pattern", TAPE_EXACT)
def test_a_tape_loop_defers_and_every_value_checkpoint_and_weight_is_horovods(tape_patterns,
                                                                             pattern):
    """Something was deferred in the loop's step, and what the program sees is
    horovod.tensorflow's, bit for bit: the losses of each call, the weights read after
    each call, the final weights and the optimizer's variables. Each pattern is "what the
    program does/its optimizer", so that every optimizer is tried once: Keras' SGD, Adam
    (its step count), AdamW (its decay) and the legacy Adam, and:
    - schedule: SGD with momentum at an exponentially decayed rate (each update at its
      own step's rate);
    - iterator: the loop takes its batches with next() from a tf.data iterator;
    - input_runs_out: that iterator runs out inside the last call, after 2 of its steps,
      and the program catches the OutOfRangeError: the last step's deferred update is
      applied, once, before the error reaches the program (Keras' step counter counts
      the step that found no input, deferral's counts the updates);
    - between_calls: rank 0 alone evaluates the model between calls (no collective:
      exact values, no hang);
    - checkpoint: a tf.train.Checkpoint of model and optimizer after the first call,
      restored in a new model and optimizer that train the second call."""
    feature = pattern.split("/")[0]
    for rank, records in enumerate(tape_patterns):
        plain, deferred = records[pattern]["horovod"], records[pattern]["tfoverlap"]
        assert "error" not in plain and "error" not in deferred, (rank, plain, deferred)
        decisions = deferred["decisions"]
        assert decisions and all(d["deferred"] >= 1 and d["api"] == "tape"
                                 for d in decisions), decisions
        # One decision per model and optimizer, however often TensorFlow traces the step
        # (tfoverlap run's summary counts them).
        assert len(decisions) == (2 if feature == "checkpoint" else 1), decisions
        for key in ("losses", "seen", "checkpoint", "rank0_evaluate", "weights",
                    "optimizer"):
            if key == "optimizer" and feature == "input_runs_out":
                assert deferred[key][1:] == plain[key][1:], rank
                assert deferred[key][0] == [deferred["batches"]], rank
                continue
            assert deferred.get(key) == plain.get(key), (rank, key)
        assert deferred["warnings"] == [], (rank, deferred["warnings"])
    if feature == "between_calls":
        assert len(tape_patterns[0][pattern]["tfoverlap"]["rank0_evaluate"]) == 2
    if feature == "checkpoint":
        assert tape_patterns[0][pattern]["tfoverlap"]["checkpoint"]


@pytest.mark.parametrize("pattern, reason", [
    ("one_step_per_call", "one step per call"),
    ("clip_global_norm", "clipped by global norm"),
    ("auto", "min_gain")])
def test_a_tape_step_outside_the_contract_defers_nothing_says_why_and_trains_exactly(
        tape_patterns, pattern, reason):
    """One step per call of the tf.function (the gradients would stay pending between
    calls), a clip by global norm of the reduced gradients (apply_gradients does not get
    them as the tape gave them), and "auto" where the plan predicts less than min_gain:
    nothing deferred, one line or the decision says why, and training is plain
    Horovod's."""
    for records in tape_patterns:
        plain, run = records[pattern]["horovod"], records[pattern]["tfoverlap"]
        assert "error" not in run, run
        assert all(d["deferred"] == 0 for d in run["decisions"]), run["decisions"]
        said = run["warnings"] + [d.get("reason", "") for d in run["decisions"]]
        assert any(reason in line for line in said), said
        assert run["losses"] == plain["losses"] and run["weights"] == plain["weights"]
        assert run["optimizer"] == plain["optimizer"]


def test_a_tape_step_that_reads_a_deferred_variable_after_its_update_stops_clearly(
        tape_patterns):
    """A read of a deferred variable after apply_gradients, in the loop, would see it one
    update behind: the trace stops, on every rank alike and before any step runs, with an
    error that names the variable and what to do."""
    for records in tape_patterns:
        error = records["late_read"]["tfoverlap"]["error"]
        assert "dense0/kernel" in error and "after its apply_gradients" in error, error
        assert "cross_step=False" in error, error
        assert "error" not in records["late_read"]["horovod"]


@pytest.mark.parametrize("modes", ["graph", "keras,horovod_keras,tape"])
def test_under_tfoverlap_run_a_plain_horovod_program_gets_the_wrappers_and_trains_exactly(
        modes):
    """``horovodrun ... tfoverlap run --allreduce caramel -- python train.py``: the
    program's ``DistributedOptimizer`` (TF1, and Keras from ``horovod.tensorflow.keras``
    or ``horovod.keras``) or ``DistributedGradientTape`` (a loop of steps in a
    ``tf.function``) is tfoverlap's, cross-step overlap
    decides for its step (one summary line per rank says so), and the losses and final
    weights are those of the same program without tfoverlap, bit for bit. The Keras and
    tape programs train in one process (one job)."""
    launch = [sys.executable, "-m", "tfoverlap", "run", "--allreduce", "caramel",
              "--bandwidth", "4Mbit", "--latency", "50e-6", "--flops", "2.5e7", "--"]
    records, summaries = run_plain_program_with_and_without(launch, modes)
    assert len(summaries) == 2, summaries
    # The wrapper decided on cross-step overlap (the Grappler pass alone has no such
    # decision).
    assert all("cross-step overlap" in line for line in summaries), summaries
    for mode in modes.split(","):
        for plain, run in zip(records["plain"][mode], records["run"][mode]):
            assert plain["wrapper"].startswith("horovod."), plain["wrapper"]
            assert run["wrapper"].startswith("tfoverlap.horovod"), run["wrapper"]
            assert run["losses"] == plain["losses"] and run["weights"] == plain["weights"]
