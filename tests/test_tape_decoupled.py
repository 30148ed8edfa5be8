"""Decoupled reduction for TF2 (tfoverlap.horovod.in_call.decoupling): a
DistributedGradientTape step in a loop inside one tf.function, and Keras model.fit with
several steps per call, reduce-scattered, updated on each rank's shard and all-gathered
under the next forward pass, against plain Horovod on real Gloo ranks
(tests/jobs/tape_decoupled.py, tests/jobs/keras_decoupled.py)."""
import os

import numpy as np
import pytest

from tests.helpers import HorovodJob

JOB = os.path.join(os.path.dirname(__file__), "jobs", "tape_decoupled.py")
KERAS_JOB = os.path.join(os.path.dirname(__file__), "jobs", "keras_decoupled.py")
KERAS_RUNS = ["chain/momentum", "convnet/adam", "chain/legacy_adam",
              "chain/adam/input_runs_out"]
STEPS = 20          # in 4 calls: enough to tell a sharded update from a plain one
#: at 3 ranks (the summation order, uneven shards): one run, of two slots a variable,
#: trained through a checkpoint; the layout of a shard depends on neither the optimizer nor
#: the model (tests/test_decoupled.py's hypothesis test covers it for 1 to 9 ranks)
AT_3_RANKS = "convnet/adam"
#: each optimizer once (SGD with momentum: the patterns and tests/test_contract_matrix.py;
#: Adam, on the convnet, and the legacy Adam: CHECKPOINTED, trained through a checkpoint)
EXACT = ["chain/sgd", "chain/adamw", "chain/legacy_momentum", "chain/schedule"]


def _job_env(steps: int, runs=None, checkpointed=()):
    """A job's environment, given its records' directory: ``steps`` steps, ``runs`` and
    ``checkpointed`` alone (where given)."""
    def env(directory) -> dict:
        settings = {"TAPE_DECOUPLED_RECORDS": str(directory),
                    "TAPE_DECOUPLED_STEPS": str(steps)}
        if runs is not None:
            settings["TAPE_DECOUPLED_RUNS"] = ",".join(runs)
        if checkpointed:
            settings["TAPE_DECOUPLED_CHECKPOINTED"] = ",".join(checkpointed)
        return settings
    return env


#: The tape job (STEPS steps), the Keras job (100) and, at 3 ranks, the tape job's
#: AT_3_RANKS run alone through a checkpoint.
HOROVOD_JOBS = {
    "decoupled_tape": HorovodJob(JOB, _job_env(STEPS)),
    "decoupled_keras": HorovodJob(KERAS_JOB, _job_env(100)),
    "decoupled_tape_3_ranks": HorovodJob(JOB, _job_env(12, runs=[],
                                                       checkpointed=[AT_3_RANKS]), ranks=3),
}


@pytest.fixture(scope="module")
def records(horovod_jobs):
    return horovod_jobs.records("decoupled_tape")


def _decoupled(record) -> int:
    return sum(decision.get("decoupled", 0) for decision in record["decisions"])


@pytest.mark.parametrize("run", EXACT)
def test_a_decoupled_tape_loop_trains_as_horovod_bit_for_bit_on_half_the_state(records,
                                                                               run):
    """20 steps in 4 calls: every loss, the weights the program reads between calls,
    rank 0's evaluations between calls (alone: no collective may start), the final
    weights, the whole optimizer state and the step counter are plain Horovod's; each
    rank holds half of the optimizer state (plus at most one padding element per bucket
    and slot)."""
    for rank, record in enumerate(records):
        plain, ours = record[run]["horovod"], record[run]["tfoverlap"]
        assert "error" not in plain and "error" not in ours, (rank, ours.get("error"))
        assert _decoupled(ours) == len(plain["weights"]), ours["decisions"]
        assert ours["warnings"] == [], ours["warnings"]
        assert sum(len(losses) for losses in ours["losses"]) == STEPS
        assert ours["losses"] == plain["losses"], rank
        assert ours["seen"] == plain["seen"], rank
        assert ours["rank0_evaluate"] == plain["rank0_evaluate"]
        assert len(ours["rank0_evaluate"]) == (4 if rank == 0 else 0)
        assert ours["weights"] == plain["weights"], rank
        assert ours["slots"] == plain["slots"], rank
        assert ours["iterations"] == plain["iterations"] == STEPS
        assert ours["gradients_left_for_apply"] == 0     # the traces' tensors not kept
        decision = next(d for d in ours["decisions"] if d.get("decoupled"))
        padding = 4 * len(decision["buckets"]) * len(next(iter(plain["slots"].values())))
        assert plain["state_bytes"] > 0
        assert ours["state_bytes"] <= plain["state_bytes"] / 2 + padding


def test_an_iterator_that_runs_out_inside_a_call_leaves_every_update_applied(records):
    """The last call's next() runs out after some of its steps: the all-gather of the
    last step's update runs before the error reaches the program, so the weights and
    the state are plain Horovod's. (Keras' step counter also counts the step that found
    no input on plain Horovod; the decoupled one counts the updates.)"""
    for record in records:
        plain = record["chain/momentum/input_runs_out"]["horovod"]
        ours = record["chain/momentum/input_runs_out"]["tfoverlap"]
        assert ours["losses"][-1] == plain["losses"][-1] == "out of range"
        assert _decoupled(ours) and ours["losses"] == plain["losses"]
        assert ours["weights"] == plain["weights"] and ours["slots"] == plain["slots"]
        assert ours["iterations"] == STEPS - 2 and plain["iterations"] in (STEPS - 2,
                                                                            STEPS - 1)


@pytest.mark.parametrize("pattern, reason", [
    ("chain/clipped/clipped", "gradient clipping"),
])
def test_outside_the_contract_nothing_is_decoupled_one_line_says_why_and_it_is_exact(
        records, pattern, reason):
    for record in records:
        plain, ours = record[pattern]["horovod"], record[pattern]["tfoverlap"]
        assert _decoupled(ours) == 0
        assert any(reason in d.get("reason", "") for d in ours["decisions"])
        assert len(ours["warnings"]) == 1 and reason in ours["warnings"][0]
        assert ours["losses"] == plain["losses"] and ours["weights"] == plain["weights"]
        assert ours["slots"] == plain["slots"]


def test_an_optimizer_built_and_restored_first_hands_its_state_over_to_the_shards(records):
    """Built, its slots set on rank 0 alone and broadcast (Horovod's "build, restore,
    broadcast"), then decoupled: bit for bit as Horovod, and the optimizer's own slot
    variables are let go (its variables are its step counter alone)."""
    for record in records:
        plain = record["chain/momentum/built_first"]["horovod"]
        ours = record["chain/momentum/built_first"]["tfoverlap"]
        assert "error" not in ours, ours["error"]
        assert _decoupled(ours) == len(plain["weights"]) and ours["warnings"] == []
        assert ours["losses"] == plain["losses"] and ours["weights"] == plain["weights"]
        assert ours["slots"] == plain["slots"]
        assert ours["optimizer_variables"] == 1 < plain["optimizer_variables"]
        assert ours["state_bytes"] < plain["state_bytes"] * 0.6


def test_a_new_optimizer_for_decoupled_variables_starts_its_own_sharded_state(records):
    """Half way, the program trains the same model with a new optimizer (as a recompile
    does): it is decoupled too, from fresh state, as plain Horovod's new optimizer
    starts."""
    for record in records:
        plain = record["chain/momentum/second_optimizer"]["horovod"]
        ours = record["chain/momentum/second_optimizer"]["tfoverlap"]
        assert "error" not in ours and ours["warnings"] == [], ours.get("error")
        assert ours["losses"] == plain["losses"] and ours["weights"] == plain["weights"]
        assert ours["slots"] == plain["slots"]
        assert ours["iterations"] == plain["iterations"] == STEPS // 2   # calls 2 and 3
        assert 0 < ours["state_bytes"] <= plain["state_bytes"] / 2 + 4 * 8   # sharded


def test_a_read_after_the_update_in_the_loop_stops_the_trace_clearly(records):
    for record in records:
        error = record["chain/momentum/late_read"]["tfoverlap"]["error"]
        assert "dense0/kernel" in error and "after its apply_gradients" in error, error
        assert "configure(decouple=False)" in error, error
        assert "error" not in record["chain/momentum/late_read"]["horovod"]


def test_auto_decides_by_the_predicted_step_and_trains_exactly(records):
    for record in records:
        plain = record["chain/momentum/auto"]["horovod"]
        ours = record["chain/momentum/auto"]["tfoverlap"]
        decision = next(d for d in ours["decisions"] if "decoupled" in d)
        assert decision["mode"] == "auto" and decision["predicted_step_ms"] > 0
        if decision["decoupled"]:           # min_gain: 3% by default
            assert decision["predicted_gain"] >= 0.03, decision
        else:
            assert "below min_gain" in decision["reason"], decision
        assert ours["losses"] == plain["losses"] and ours["weights"] == plain["weights"]


CHECKPOINTED = ["convnet/adam", "chain/legacy_adam"]
_FRESH = ["horovod_from_tfoverlap", "tfoverlap_from_horovod", "tfoverlap_from_tfoverlap"]


@pytest.mark.parametrize("run", CHECKPOINTED)
def test_checkpoints_hold_the_whole_state_under_plain_keys_and_restore_both_ways(records,
                                                                                 run):
    """The first call decouples every variable and is plain Horovod's, bit for bit, on
    half the optimizer state. Saved on rank 0 after it: refused until every rank
    consolidated, then the very checkpoint plain Horovod writes (every key, every value).
    Read back on rank 0 into the same objects half way and broadcast, or into new ones
    before their first step (decoupled: on rank 0 alone), from either variant's
    checkpoint: every continuation is plain Horovod's, bit for bit."""
    for rank, record in enumerate(record["checkpoints"][run] for record in records):
        assert "error" not in record, record.get("error")
        assert record["warnings"] == [], record["warnings"]
        plain, ours = record["horovod"], record["tfoverlap"]
        straight = plain["restored_midway"]
        assert _decoupled(ours) == len(straight["weights"]), ours["decisions"]
        assert ours["first_call"] == plain["first_call"], rank
        decision = next(d for d in ours["decisions"] if d.get("decoupled"))
        padding = 4 * len(decision["buckets"]) * len(next(iter(straight["slots"].values())))
        assert ours["state_bytes"] <= plain["state_bytes"] / 2 + padding
        assert ours["consolidated"] is True
        if rank == 0:
            assert "consolidate_optimizer_state()" in ours["unconsolidated"]
            assert sorted(ours["saved"]) == sorted(plain["saved"])
            assert any("optimizer" in key and ("_variables/2" in key or "SLOT" in key)
                       for key in plain["saved"])
            for key, values in plain["saved"].items():
                assert ours["saved"][key] == values, key
        for continued in [ours["restored_midway"]] + [record[name] for name in _FRESH]:
            assert continued["losses"] == straight["losses"], rank
            assert continued["weights"] == straight["weights"], rank
            assert continued["slots"] == straight["slots"], rank


def test_at_3_ranks_the_results_are_horovods_up_to_summation_order(horovod_jobs):
    """At more than 2 ranks the reduce-scatter may add the ranks' gradients in another
    order than Horovod's ring, and at 3 no bucket need divide evenly: 12 steps (saved after
    the first call, restored, trained on) stay within a few float32 ulps of plain Horovod,
    each rank holds a third of the optimizer state (plus padding), and the checkpoints and
    every continuation from them stay as close."""
    ranks = 3
    for record in horovod_jobs.records("decoupled_tape_3_ranks"):
        saved = record["checkpoints"][AT_3_RANKS]
        assert "error" not in saved, saved.get("error")
        plain, ours = saved["horovod"], saved["tfoverlap"]
        decision = next(d for d in ours["decisions"] if d.get("decoupled"))
        np.testing.assert_allclose(ours["first_call"], plain["first_call"], rtol=2e-6)
        straight = plain["restored_midway"]
        for name, slots in straight["slots"].items():
            for slot, values in slots.items():
                np.testing.assert_allclose(ours["restored_midway"]["slots"][name][slot],
                                           values, rtol=0, atol=1e-5, err_msg=f"{name} {slot}")
        padding = ((ranks - 1) * 4 * len(decision["buckets"])
                   * len(next(iter(straight["slots"].values()))))
        assert ours["state_bytes"] <= plain["state_bytes"] / ranks + padding
        if "saved" in plain:
            assert sorted(ours["saved"]) == sorted(plain["saved"])
            for key, values in plain["saved"].items():
                np.testing.assert_allclose(ours["saved"][key], values, rtol=0, atol=1e-5,
                                           err_msg=key)
        for continued in [ours["restored_midway"]] + [saved[name] for name in _FRESH]:
            np.testing.assert_allclose(continued["losses"], straight["losses"], rtol=2e-6)
            for theirs, mine in zip(straight["weights"], continued["weights"]):
                np.testing.assert_allclose(mine, theirs, rtol=0, atol=1e-5)


@pytest.fixture(scope="module")
def keras_records(horovod_jobs):
    return horovod_jobs.records("decoupled_keras", "keras-rank-{rank}.json")


@pytest.mark.parametrize("run", KERAS_RUNS)
def test_keras_fit_decoupled_trains_as_horovod_and_checkpoints_each_epoch_whole(
        keras_records, run):
    """2 epochs of 50 steps, 5 per call: the losses and weights callbacks see after each
    call, the final weights, the whole optimizer state and the step counter are
    horovod.tensorflow.keras's, bit for bit, on half the state per rank. A ModelCheckpoint
    on rank 0 alone (TensorFlow's format, each epoch; another every 15 batches, inside an
    epoch) writes the very checkpoint plain Horovod writes; an .h5 save, which would
    leave the slots out, is refused. An input that runs out 2 steps into a call (epochs of
    28 steps on 50 batches) ends training on Horovod's weights and state too: the last
    call's update is gathered all the same."""
    calls, steps = (6 + 4, 50) if run.endswith("/input_runs_out") else (20, 100)
    for rank, record in enumerate(record[run] for record in keras_records):
        plain, ours = record["horovod"], record["tfoverlap"]
        assert "error" not in plain and "error" not in ours, (rank, ours.get("error"))
        assert ours["decision"]["decoupled"] == len(plain["weights"]), ours["decision"]
        assert ours["decision"]["api"] == "keras"
        assert ours["warnings"] == [], ours["warnings"]
        assert len(ours["losses"]) == calls and ours["losses"] == plain["losses"], rank
        assert ours["seen"] == plain["seen"], rank
        assert ours["weights"] == plain["weights"], rank
        assert ours["slots"] == plain["slots"], rank
        # Keras' step counter may also count the step that found no input on plain
        # Horovod (test_an_iterator_that_runs_out_inside_a_call_leaves_every_update_applied).
        assert ours["iterations"] == steps and plain["iterations"] in (steps, steps + 1), \
            (ours["iterations"], plain["iterations"])
        padding = 4 * len(ours["decision"]["buckets"]) * len(
            next(iter(plain["slots"].values())))
        assert ours["state_bytes"] <= plain["state_bytes"] / 2 + padding
        if rank == 0:
            assert any("optimizer" in key and ("_variables/2" in key or "SLOT" in key)
                       for key in plain["checkpoint"])
            for written in ("checkpoint", "batch_checkpoint", "keras_file"):
                assert sorted(ours[written]) == sorted(plain[written])
                for key, values in plain[written].items():
                    counter = written == "keras_file" and key == "optimizer/vars/0"
                    if counter:     # the step counter, as above
                        assert ours[written][key] == [ours["iterations"]]
                    else:
                        assert ours[written][key] == values, (written, key)
            assert ("optimizer/vars/2" in plain["keras_file"]) == ("legacy" not in run)
            assert "TensorFlow's checkpoint format" in ours["h5"], ours["h5"]


def test_keras_build_then_load_a_keras_file_hands_the_state_over_to_the_shards(
        keras_records):
    """A new model's optimizer built, plain Horovod's .keras file loaded into it on every
    rank, one more epoch: decoupled from that state, bit for bit as Horovod, and the
    optimizer's own slot variables let go."""
    for rank, record in enumerate(record["convnet/adam/resumed"] for record in keras_records):
        plain, ours = record["horovod"], record["tfoverlap"]
        assert "error" not in plain and "error" not in ours, (rank, ours.get("error"))
        assert ours["decision"]["decoupled"] == len(plain["weights"]), ours["decision"]
        assert ours["warnings"] == [], ours["warnings"]
        assert len(ours["losses"]) == 10 and ours["losses"] == plain["losses"], rank
        assert ours["weights"] == plain["weights"] and ours["slots"] == plain["slots"]
        assert ours["iterations"] == plain["iterations"] == 150
        assert ours["state_bytes"] < plain["state_bytes"] * 0.6
