"""Decoupled reduction: reduce-scatter under the backward pass, sharded update, all-gather
under the next forward pass. The plan on plain numbers and on a Horovod graph, the CLI,
and a 2-rank Gloo job (tests/jobs/decoupled_training.py, in the suite's one job of 2
ranks: conftest's ``horovod_jobs``) that trains two models 20 steps
with and without it and compares every value bit for bit, also across checkpoints."""
import json
import os
import sys

import numpy as np
import pytest
from hypothesis import given, settings, strategies as st

from tfoverlap.costs.network import ring_allreduce_seconds
from tests.helpers import (HorovodJob, build_horovod_graph,
                           run_plain_program_with_and_without)

JOB = os.path.join(os.path.dirname(__file__), "jobs", "decoupled_training.py")
STEPS = 20


def test_a_reduce_scatter_costs_half_an_allreduce_and_buckets_are_priced_so():
    from tfoverlap.planning.decoupled import reduce_scatter_buckets, reduce_scatter_seconds
    for size in (0, 1000, 25e6):
        assert reduce_scatter_seconds(size, 8, 3e9, 1e-4) == pytest.approx(
            ring_allreduce_seconds(size, 8, 3e9, 1e-4) / 2)
    assert reduce_scatter_seconds(1e6, 1, 3e9, 1e-4) == 0.0
    sizes, ready = [4e6, 8e6, 2e6], [0.001, 0.004, 0.009]
    buckets = reduce_scatter_buckets(sizes, ready, 4, 1e9, 1e-4)
    assert sorted(p.gradient for b in buckets for p in b.pieces) == [0, 1, 2]
    assert all(len({p.gradient for p in b.pieces}) == len(b.pieces) for b in buckets)
    for bucket in buckets:          # the plan's own times are reduce-scatters'
        assert bucket.finish - bucket.start == pytest.approx(
            reduce_scatter_seconds(bucket.size, 4, 1e9, 1e-4))


@settings(max_examples=100, deadline=None)
@given(st.lists(st.integers(1, 300), min_size=1, max_size=6), st.integers(1, 9))
def test_the_ranks_shards_cover_every_element_of_a_bucket_once(counts, ranks):
    from tfoverlap.horovod.session.decoupling import BucketLayout
    layout = BucketLayout.of(range(len(counts)), counts, ranks)
    assert layout.shard * ranks >= layout.total > (layout.shard - 1) * ranks
    covered = [np.zeros(count, int) for count in counts]
    for rank in range(ranks):
        owned = layout.owned(rank)
        assert sum(end - first for _, first, end in owned) <= layout.shard
        for position, first, end in owned:
            covered[position][first:end] += 1
    assert all((c == 1).all() for c in covered)


def test_all_gathers_go_in_few_requests_that_grow():
    from tfoverlap.planning.decoupled import gather_chunks
    chunks = gather_chunks([1] * 30, chunks=4)
    assert [i for chunk in chunks for i in chunk] == list(range(30))
    assert len(chunks) == 4 and [len(c) for c in chunks] == sorted(len(c) for c in chunks)
    assert gather_chunks([5, 5], chunks=4) == [[0], [1]]
    with pytest.raises(ValueError, match="chunks >= 1"):
        gather_chunks([1], chunks=0)


_CHAIN = """
import sys
import horovod.tensorflow as hvd
import tensorflow as tf
hvd.init()
graph = tf.Graph()
with graph.as_default():
    weights = [tf.compat.v1.get_variable(f"w{i}", [512, 512], use_resource=True)
               for i in range(6)]
    hidden = tf.ones([64, 512])
    for weight in weights:
        hidden = tf.nn.relu(tf.matmul(hidden, weight))
    loss = tf.reduce_sum(hidden)
    gradients = tf.gradients(loss, weights)
    optimizer = tf.compat.v1.train.MomentumOptimizer(0.01, 0.9)
    train = optimizer.apply_gradients(
        [(hvd.allreduce(g), w) for w, g in zip(weights, gradients)], name="train")
with open(sys.argv[1], "wb") as stream:
    stream.write(graph.as_graph_def().SerializeToString())
"""


@pytest.fixture(scope="module")
def chain_graph(tmp_path_factory):
    import tensorflow as tf
    path = tmp_path_factory.mktemp("decoupled") / "chain.pb"
    build_horovod_graph(_CHAIN, path)
    graph_def = tf.compat.v1.GraphDef()
    graph_def.ParseFromString(path.read_bytes())
    return path, graph_def


def test_the_simulated_step_gathers_before_each_layer_and_scatters_after_its_gradient(
        chain_graph):
    """Each variable's forward reads wait for its all-gather, each reduce-scatter for its
    gradients; with a slow link the decoupled step beats Horovod's, and with free compute
    its ring time is one AllReduce of every byte (each half moves half the bytes)."""
    from tfoverlap.planning.decoupled import plan_decoupled
    from tfoverlap.sim.engine import COLLECTIVE, simulate
    _, graph_def = chain_graph
    op_seconds = {node.name: 0.002 for node in graph_def.node}
    network = (4, 125e6, 50e-6)
    plan = plan_decoupled(graph_def, *network, op_seconds, threads=2)
    assert len(plan.variables) == 6 and None not in plan.variables
    assert sorted(i for chunk in plan.gather_chunks for i in chunk) == list(
        range(len(plan.buckets)))
    problem = plan.problem(op_seconds, 4, threads=2)
    schedule = simulate(problem)
    collectives = np.flatnonzero(problem.kind == COLLECTIVE)
    gathers, scatters = (collectives[:len(plan.gather_chunks)],
                         collectives[len(plan.gather_chunks):])
    for gather, chunk in zip(gathers, plan.gather_chunks):
        readers = {r for b in chunk for p in plan.buckets[b].pieces
                   for r in plan.readers[plan.variables[p.gradient]]}
        assert readers and set(problem.successors[gather]) == readers
        assert all(schedule.start[r] >= schedule.end[gather] - 1e-12 for r in readers)
    for scatter in scatters:
        waits = [t for t in range(problem.num_tasks) if scatter in problem.successors[t]]
        assert waits and all(schedule.start[scatter] >= schedule.end[t] - 1e-12
                             for t in waits)
    assert plan.predicted_step == pytest.approx(schedule.makespan)
    assert plan.predicted_step < plan.horovod_step
    free = simulate(plan.problem({}, 4, threads=2))
    total = sum(plan.plan.sizes)
    assert free.makespan == pytest.approx(
        ring_allreduce_seconds(total, 4, 125e6, 0.0)
        + (len(plan.buckets) + len(plan.gather_chunks)) * 3 * 50e-6)


def test_the_cli_shows_the_decoupled_plan_beside_the_others(chain_graph, capsys):
    from tfoverlap import cli
    path, _ = chain_graph
    assert cli.main(["schedule", str(path), "--algo", "decoupled", "--workers", "4",
                     "--bandwidth", "1Gbit", "--json"]) == 0
    plan = json.loads(capsys.readouterr().out)
    assert set(plan["predicted_step_s"]) == {"horovod", "caramel", "cross_step", "decoupled"}
    assert sum(b["bytes"] for b in plan["reduce_scatter_buckets"]) == 6 * 512 * 512 * 4
    assert cli.main(["schedule", str(path), "--algo", "decoupled", "--workers", "4"]) == 0
    out = capsys.readouterr().out
    assert "reduce-scatter buckets" in out and "predicted step: horovod" in out
    assert cli.main(["simulate", str(path), "--algo", "default,caramel,decoupled",
                     "--workers", "4", "--bandwidth", "1Gbit"]) == 0
    rows = capsys.readouterr().out.splitlines()[2:]
    assert [row.split()[0] for row in rows] == ["default", "caramel", "decoupled"]


def _job_env(steps: int, runs=(), checkpointed=(), checkpoint_kinds=None):
    """The job's environment, given its records' directory: ``steps`` steps, ``runs`` and
    ``checkpointed`` alone (where given), ``checkpoint_kinds`` (of "monitored" and
    "object") beside Saver's checkpoints."""
    def env(directory) -> dict:
        settings = {"DECOUPLED_RECORDS": str(directory), "DECOUPLED_STEPS": str(steps)}
        if runs:
            settings["DECOUPLED_RUNS"] = ",".join(runs)
        if checkpointed:
            settings["DECOUPLED_CHECKPOINTED"] = ",".join(checkpointed)
        if checkpoint_kinds is not None:
            settings["DECOUPLED_CHECKPOINT_KINDS"] = ",".join(checkpoint_kinds)
        return settings
    return env


#: At 3 ranks: one run, of two slots a variable, through a Saver's checkpoint (see
#: test_at_3_ranks_the_results_are_horovods_up_to_summation_order)
AT_3_RANKS = "convnet/adam"
HOROVOD_JOBS = {
    "decoupled_graph": HorovodJob(JOB, _job_env(STEPS), disables_eager=True),
    "decoupled_graph_3_ranks": HorovodJob(
        JOB, _job_env(10, [AT_3_RANKS], [AT_3_RANKS], checkpoint_kinds=()), ranks=3,
        disables_eager=True),
}


@pytest.fixture(scope="module")
def records(horovod_jobs):
    return horovod_jobs.records("decoupled_graph")


@pytest.mark.parametrize("run", ["chain/sgd", "chain/momentum", "convnet/adam"])
def test_decoupled_training_is_horovods_bit_for_bit_with_half_the_optimizer_state(
        records, run):
    """20 steps: every loss, every validation loss (on every rank, and on rank 0 alone,
    which starts no collective) and the final weights are plain Horovod's; the optimizer
    state on each rank is half of Horovod's (2 ranks), plus at most a padding element per
    bucket and slot."""
    for rank, record in enumerate(record["records"] for record in records):
        plain, decoupled = record[run]["horovod"], record[run]["decoupled"]
        assert "error" not in plain and "error" not in decoupled, (rank, decoupled)
        assert decoupled["decoupled"]["decoupled"] >= 2, decoupled["decoupled"]
        assert decoupled["warnings"] == [], decoupled["warnings"]
        assert len(decoupled["losses"]) == STEPS
        assert decoupled["losses"] == plain["losses"], rank
        assert decoupled["validations"] == plain["validations"], rank
        assert len(decoupled["validations"]) == (2 if rank == 0 else 1) * (STEPS // 10)
        assert decoupled["final"] == plain["final"], rank
        buckets = len(decoupled["decoupled"]["buckets"])
        slots = plain["optimizer_bytes"] // decoupled["decoupled"]["bytes"]
        assert decoupled["optimizer_bytes"] <= plain["optimizer_bytes"] / 2 + 4 * buckets * slots


def test_at_3_ranks_the_results_are_horovods_up_to_summation_order(horovod_jobs):
    """At more than 2 ranks the reduce-scatter may add the ranks' gradients in another
    order than Horovod's ring, and at 3 no bucket need divide evenly: 10 steps stay within
    a few float32 ulps of plain Horovod, each rank holds a third of the optimizer state
    (plus padding), and 5 steps on from a Saver's checkpoint written half way (with or
    without decouple; restored on every rank or on rank 0 alone) stay as close to plain
    Horovod trained straight. One run, of two slots a variable: a shard's layout does not
    depend on the optimizer or the model (the hypothesis test above covers 1 to 9 ranks),
    and the other checkpoint kinds share the Saver's consolidation and restore (tested at
    2 ranks). (3 ranks, not 4: a quarter less of the job on a 2-core host.)"""
    run, ranks = AT_3_RANKS, 3
    for whole in horovod_jobs.records("decoupled_graph_3_ranks"):
        plain, decoupled = whole["records"][run]["horovod"], whole["records"][run]["decoupled"]
        assert "error" not in decoupled and decoupled["decoupled"]["decoupled"] >= 2
        np.testing.assert_allclose(decoupled["losses"], plain["losses"], rtol=2e-6)
        for ours, theirs in zip(decoupled["final"], plain["final"]):
            np.testing.assert_allclose(ours, theirs, rtol=0, atol=1e-5)
        buckets = len(decoupled["decoupled"]["buckets"])
        slots = plain["optimizer_bytes"] // decoupled["decoupled"]["bytes"]
        assert decoupled["optimizer_bytes"] <= (plain["optimizer_bytes"] / ranks
                                                + (ranks - 1) * 4 * buckets * slots)
        saved = whole["checkpoints"][run]
        for continued in _CONTINUED:
            np.testing.assert_allclose(saved[continued][1]["losses"],
                                       saved["straight"]["losses"][-5:], rtol=2e-6)
            for ours, theirs in zip(saved[continued][1]["final"], saved["straight"]["final"]):
                np.testing.assert_allclose(ours, theirs, rtol=0, atol=1e-5)
        assert set(whole["checkpoints"]) == {run}


CHECKPOINTED = ["chain/momentum", "convnet/adam"]
_CONTINUED = ("decoupled_then_plain", "plain_then_decoupled", "decoupled_then_decoupled")


@pytest.mark.parametrize("run", CHECKPOINTED)
def test_checkpoints_hold_the_whole_optimizer_state_under_its_plain_names(records, run):
    """A Saver on rank 0 alone writes the weights and the whole optimizer state
    (consolidated first on every rank) under the names plain Horovod's checkpoint has.
    Training on from it without decouple, from a plain checkpoint with decouple (restored
    on rank 0 alone, broadcast), and with decouple again (restored on every rank), every
    loss and the final weights are those of plain Horovod trained straight through."""
    for rank, record in enumerate(record["checkpoints"][run] for record in records):
        straight = record["straight"]["losses"]
        for continued in _CONTINUED:
            first, then = record[continued]
            half = len(first["losses"])
            assert half > 0 and len(then["losses"]) == half, continued
            assert first["losses"] == straight[:half], (rank, continued)
            assert then["losses"] == straight[half:], (rank, continued)
            assert then["final"] == record["straight"]["final"], (rank, continued)
        if rank == 0:
            names = record["plain_then_decoupled"][0]["saved"]
            assert record["decoupled_then_plain"][0]["saved"] == names
            assert record["initial"]["saved"] == names
            slots = [name for name, _ in names if name.rsplit("/", 1)[-1] in
                     ("Momentum", "Adam", "Adam_1")]
            assert slots and not any("tfoverlap" in name for name, _ in names)


def test_object_based_checkpoints_hold_the_whole_optimizer_state_too(records):
    """``tf.train.Checkpoint(optimizer=..., w0=...)``: the optimizer's slots for each
    decoupled variable are saved whole, under the keys plain Horovod's checkpoint has, and
    every value of the checkpoint is restored (``assert_consumed``), into plain Horovod or
    decoupled, before the train op exists or after: training goes on as plain Horovod
    trained straight through, bit for bit."""
    for rank, record in enumerate(record["checkpoints"]["convnet/adam/object"]
                                  for record in records):
        straight = record["straight"]
        for continued in _CONTINUED:
            first, then = record[continued]
            half = len(first["losses"])
            assert half > 0 and first["losses"] == straight["losses"][:half], continued
            assert then["losses"] == straight["losses"][half:], (rank, continued)
            assert then["final"] == straight["final"], (rank, continued)
        if rank == 0:
            names = record["plain_then_decoupled"][0]["saved"]
            assert record["decoupled_then_plain"][0]["saved"] == names
            assert sum(".OPTIMIZER_SLOT/optimizer/" in name for name, _ in names) == 2 * 6


def test_a_monitored_session_saving_on_rank_0_alone_writes_whole_checkpoints(records):
    """Horovod's examples: a MonitoredTrainingSession on every rank, its CheckpointSaverHook
    on rank 0 alone (every 6 of 20 steps, and at the end). With decouple, a save due after
    a train run waits one step, for the background run to gather the state on every rank
    (the request rides on the first all-gather): steps 7, 14 and 20, where the last, due at
    the last step, is made after the session's close gathered the state. Training is plain
    Horovod's, bit for bit; the final checkpoint holds every value plain Horovod's does;
    training on without decouple from one written in the middle is plain Horovod's
    trained straight through."""
    for rank, record in enumerate(r["checkpoints"]["chain/momentum/monitored"]
                                  for r in records):
        plain, decoupled, straight = record["horovod"], record["decoupled"], record["straight"]
        assert "error" not in decoupled, decoupled
        last = len(straight["losses"])
        every, due, expected = (last + 1) // 3 - 1, 0, [0]      # as the job sets it
        while due + every <= last:
            due = min(due + every + 1, last)
            expected.append(due)
        expected += [last] * (expected[-1] != last)             # the final save
        assert [int(path.rsplit("-", 1)[1]) for path in decoupled["saved"]] == expected
        assert decoupled["losses"] == plain["losses"] == straight["losses"], rank
        assert decoupled["last"] == plain["last"], rank
        assert any(name.endswith("/Momentum") for name in decoupled["last"])
        continued = record["continued"]["losses"]
        assert continued == straight["losses"][-len(continued):], rank
        assert record["continued"]["final"] == straight["final"], rank


@pytest.mark.parametrize("run", CHECKPOINTED)
def test_a_save_of_the_sharded_state_on_one_rank_is_refused_until_it_is_consolidated(
        records, run):
    """After a train run, rank 0 alone cannot write the state the other ranks hold: its
    Saver fails with the remedy named (no hang, no partial checkpoint); before the first
    train run the state is the optimizer's zeros and saves as it is."""
    record = records[0]["checkpoints"][run]
    refusal = record["decoupled_then_plain"][0]["unconsolidated_save"]
    assert "consolidate_optimizer_state(session) on every rank" in refusal
    assert record["initial"]["unconsolidated_save"] == "saved"


def test_gradients_changed_after_the_reduction_are_refused_in_one_warning(records):
    for record in (record["records"] for record in records):
        plain, decoupled = (record["chain/momentum/clip"]["horovod"],
                            record["chain/momentum/clip"]["decoupled"])
        assert decoupled["decoupled"] == {}
        assert len(decoupled["warnings"]) == 1
        assert "is not the reduced gradient" in decoupled["warnings"][0]
        assert decoupled["losses"] == plain["losses"] and decoupled["final"] == plain["final"]


def test_auto_below_min_gain_declines_and_cross_step_overlap_takes_over(records):
    for record in (record["records"] for record in records):
        plain, declined = (record["chain/momentum/declined"]["horovod"],
                           record["chain/momentum/declined"]["declined"])
        assert "error" not in declined, declined
        assert declined["decoupled"] == {} and declined["deferred"]["deferred"] >= 1
        assert declined["warnings"] == []
        assert declined["losses"] == plain["losses"] and declined["final"] == plain["final"]
        assert declined["validations"] == plain["validations"]


def test_the_halves_are_measured_on_rank_0_and_planned_with_on_every_rank(records,
                                                                          chain_graph):
    """Each rank gets rank 0's reduce-scatter and all-gather fits; a plan given a slower
    reduce-scatter predicts a slower step, and with free compute its ring time is the
    measured halves' sum."""
    from tfoverlap.planning.decoupled import plan_decoupled, reduce_scatter_seconds
    from tfoverlap.sim.engine import simulate
    halves = [record["halves"] for record in records]
    assert halves[0] == halves[1]
    assert all(value > 0 and np.isfinite(value) for pair in halves[0].values()
               for value in pair)
    _, graph_def = chain_graph
    op_seconds = {node.name: 0.002 for node in graph_def.node}
    even = plan_decoupled(graph_def, 4, 125e6, 50e-6, op_seconds, threads=2)
    slow = plan_decoupled(graph_def, 4, 125e6, 50e-6, op_seconds, threads=2,
                          scatter=(125e6 / 4, 50e-6), gather=(125e6, 1e-3))
    assert slow.predicted_step > even.predicted_step
    free = simulate(slow.problem({}, 4, threads=2)).makespan
    assert free == pytest.approx(
        sum(reduce_scatter_seconds(b.size, 4, 125e6 / 4, 50e-6) for b in slow.buckets)
        + sum(reduce_scatter_seconds(sum(slow.buckets[i].size for i in chunk), 4, 125e6,
                                     1e-3) for chunk in slow.gather_chunks))


def test_tfoverlap_run_decouples_an_unchanged_program_and_trains_exactly():
    """``tfoverlap run --allreduce caramel --decouple true -- python train.py``: the
    program's DistributedOptimizer decouples (each rank's summary line says so) and its
    losses and final weights are those of the same program without tfoverlap."""
    launch = [sys.executable, "-m", "tfoverlap", "run", "--allreduce", "caramel",
              "--decouple", "true", "--bandwidth", "100Mbit", "--latency", "50e-6",
              "--flops", "2.5e8", "--"]
    records, summaries = run_plain_program_with_and_without(launch, "graph")
    assert len(summaries) == 2 and all("decoupled reduction:" in line
                                       for line in summaries), summaries
    for plain, run in zip(records["plain"]["graph"], records["run"]["graph"]):
        assert run["wrapper"].startswith("tfoverlap.horovod"), run["wrapper"]
        assert run["losses"] == plain["losses"] and run["weights"] == plain["weights"]
