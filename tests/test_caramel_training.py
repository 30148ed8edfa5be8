"""Caramel in real Horovod jobs (2 ranks, Gloo and MPI; graph mode, TF2 and Keras): every
way in trains exactly like Horovod, with the same plan on every rank. The graph-mode runs
take a Horovod job of their own (a fresh process: plain Horovod's order of independent
gradients varies in its first steps); the TF2, Keras (under MPI) and transformer runs join
the suite's shared jobs (conftest's ``horovod_jobs``), and all of them train while other
tests run. The timeline and plan-mismatch runs need a job each (Horovod's timeline is a
process's; a mismatch ends its job)."""
import json
import os
import sys

import numpy as np
import pytest

from tfoverlap.testbed.horovod_launch import run_horovod
from tfoverlap.testbed.network import EmulatedNetwork
from tests.helpers import HorovodJob

JOB = os.path.join(os.path.dirname(__file__), "jobs", "caramel_training.py")
MODELS_JOB = os.path.join(os.path.dirname(__file__), "jobs", "cross_step_models.py")


def _job(network, ranks, controller, argv, env=None, timeout=420):
    result = run_horovod(network, ranks, [sys.executable, JOB] + argv, controller=controller,
                         env=env, timeout=timeout)
    return result


def _reports(result, ranks):
    assert result.returncode == 0, [o[-3000:] for o in result.outputs]
    reports = {}
    for rank, output in enumerate(result.outputs):
        for line in output.splitlines():
            if line.startswith("{"):
                record = json.loads(line)
                reports[(record["rank"], record["variant"])] = record
    assert {rank for rank, _ in reports} == set(range(ranks)), result.outputs
    return reports


@pytest.fixture(scope="module")
def network():
    with EmulatedNetwork(2, bandwidth=1.25e9) as emulated:
        yield emulated


def _scenario(name, mode, steps, variants, **env):
    return {"name": name, "mode": mode, "steps": steps, "variants": variants, "env": env}


#: The graph-mode runs of the tests below, one after another in one job of 2 Gloo ranks
#: (one Horovod start-up, not one per test); each test reads its scenario's records. The
#: scenarios without a plain Horovod run of their own compare with "plain"'s: the same
#: model, data and steps.
GRAPH_SCENARIOS = [
    # First, in a process of its own: plain Horovod's order of independent gradients
    # varies in a fresh process's first steps.
    _scenario("parallel", "graph", 5, ["horovod", "flag", "dropin"],
              CARAMEL_TEST_MODEL="parallel"),
    _scenario("plain", "graph", 4, ["horovod", "flag", "dropin"]),
    _scenario("profiled", "graph", 4, ["dropin"], CARAMEL_TEST_PROFILE_STEPS="2"),
    # Planned for a slow link and slow compute (see the cross-step test).
    _scenario("deferred", "graph", 4, ["deferred"], CARAMEL_TEST_FLOPS="2e8",
              CARAMEL_TEST_BANDWIDTH="10Mbit"),
    _scenario("control_flow", "graph", 4, ["horovod", "flag", "dropin"],
              CARAMEL_TEST_MODEL="control_flow"),
]
#: The TF2 runs, in the shared job of 2 Gloo ranks.
EAGER_SCENARIOS = [
    _scenario("plain", "tf2", 4, ["horovod", "flag", "dropin"]),
    _scenario("control_flow", "tf2", 4, ["horovod", "flag", "dropin"],
              CARAMEL_TEST_MODEL="control_flow"),
]
#: model.fit under MPI, in the shared MPI job (Keras under Gloo: the timeline test below
#: and tests/test_examples.py).
KERAS_SCENARIOS = [_scenario("keras", "keras", 4, ["horovod", "dropin"])]


def _records_in(directory):
    return {"CARAMEL_RECORDS": str(directory)}


HOROVOD_JOBS = {
    "caramel_graph": HorovodJob(JOB, _records_in, disables_eager=True, process="caramel_graph",
                                argv=("--scenarios", json.dumps(GRAPH_SCENARIOS))),
    "caramel_tf2": HorovodJob(JOB, _records_in,
                              argv=("--scenarios", json.dumps(EAGER_SCENARIOS))),
    "caramel_keras_mpi": HorovodJob(JOB, _records_in, controller="mpi",
                                    argv=("--scenarios", json.dumps(KERAS_SCENARIOS))),
    # The benchmark's transformer with 2 of its 12 layers: the same embedding, gather and
    # layers, in less than half the time.
    "cross_step_transformer": HorovodJob(
        MODELS_JOB, lambda directory: {"CROSS_STEP_MODEL_RECORDS": str(directory)},
        disables_eager=True, argv=("transformer", 2)),
}


def _scenario_reports(horovod_jobs, name, scenarios, ranks=2):
    """The records of the job ``name`` that ran ``scenarios``: (scenario, rank, variant) ->
    record, every one there."""
    reports = {(record["scenario"], record["rank"], record["variant"]): record
               for records in horovod_jobs.records(name) for record in records}
    assert set(reports) == {(s["name"], rank, variant) for s in scenarios
                            for rank in range(ranks) for variant in s["variants"]}, reports
    return reports


@pytest.fixture(scope="module")
def graph_runs(horovod_jobs):
    return _scenario_reports(horovod_jobs, "caramel_graph", GRAPH_SCENARIOS)


@pytest.fixture(scope="module")
def eager_runs(horovod_jobs):
    return _scenario_reports(horovod_jobs, "caramel_tf2", EAGER_SCENARIOS)


def _runs(request, mode):
    return request.getfixturevalue("graph_runs" if mode == "graph" else "eager_runs")


# Each mode with both ways in (the flag and the drop-in) against plain Horovod, under Gloo
# (Keras under MPI: the model.fit test; graph mode and tapes under MPI:
# tests/test_contract_matrix.py's MPI cases). 2 ranks, not 4: tfoverlap takes the rank count from
# hvd.size() and uses it only as a number (tests/test_caramel.py plans for 4 ranks), and
# 4 ranks on a 2-core host cost the job twice the time.
@pytest.mark.slow
@pytest.mark.parametrize("mode", ["graph", "tf2"])
def test_caramel_trains_exactly_like_horovod(request, mode):
    reports = _runs(request, mode)
    variants = ["horovod", "flag", "dropin"]
    for rank in (0, 1):
        plain = reports[("plain", rank, "horovod")]["losses"]
        assert len(plain) == 4 and np.isfinite(plain).all()
        for variant in variants[1:]:
            record = reports[("plain", rank, variant)]
            assert record["plan"] and record["plan"]["ranks"] == 2, record
            np.testing.assert_allclose(record["losses"], plain, rtol=1e-5,
                                       err_msg=f"rank {rank} {variant}")
    # Each rank trains on its own data: the losses differ between ranks, and still all
    # ranks planned the same buckets.
    assert reports[("plain", 0, "horovod")]["losses"] != reports[("plain", 1, "horovod")][
        "losses"]
    digests = {reports[("plain", r, variants[1])]["plan"]["plan_digest"] for r in (0, 1)}
    assert len(digests) == 1


@pytest.mark.slow
def test_a_profiled_warm_up_plans_with_measured_times_and_trains_like_horovod(graph_runs):
    """configure(profile_steps=2): every rank plans with rank 0's measured op times (the
    same plan on both ranks), and training is plain Horovod's."""
    for rank in (0, 1):
        record = graph_runs[("profiled", rank, "dropin")]
        assert record["plan"]["ready_times_from"] == "profile", record["plan"]
        np.testing.assert_allclose(record["losses"],
                                   graph_runs[("plain", rank, "horovod")]["losses"],
                                   rtol=1e-5, err_msg=f"rank {rank}")
    assert len({graph_runs[("profiled", r, "dropin")]["plan"]["plan_digest"]
                for r in (0, 1)}) == 1


@pytest.mark.slow
def test_cross_step_defers_the_last_gradients_and_trains_exactly_like_horovod(
        graph_runs):
    """configure(cross_step=True): the gradients ready last are stored at the end of a
    step, reduced after it, and applied before anything uses those variables. The losses
    are Horovod's bit for bit, and so are the weights read after the last step without a
    flush, and after it. (Planned for a slow link and slow compute: the first
    convolutions' reductions then save more ring time than their request costs, and fit
    in the forward pass.)"""
    for rank in (0, 1):
        plain = graph_runs[("plain", rank, "horovod")]
        deferred = graph_runs[("deferred", rank, "deferred")]
        assert deferred["plan"]["cross_step"]["deferred"] >= 1, deferred["plan"]
        assert deferred["losses"] == plain["losses"], rank
        assert deferred["before_flush"] == plain["weights"], rank
        assert deferred["weights"] == plain["weights"], rank


@pytest.mark.slow
def test_cross_step_on_the_transformer_defers_its_embedding_and_keeps_the_losses(horovod_jobs):
    """The transformer reads its embedding with a gather, not a plain read: with the
    embedding deferred, its forward pass still waits for the update, and losses and final
    weights are plain Horovod's."""
    for record in horovod_jobs.records("cross_step_transformer"):
        assert record["deferred"]["deferred"] >= 1, record
        assert record["same_losses"] and record["same_final_weights"], record


@pytest.mark.slow
def test_keras_model_fit_trains_with_caramels_plan_like_horovod_keras(horovod_jobs):
    """tfoverlap.horovod.keras.DistributedOptimizer in model.fit: Horovod Keras's losses,
    and the plan of the train function is the same on both ranks (under MPI)."""
    reports = {(rank, variant): record for (_, rank, variant), record in _scenario_reports(
        horovod_jobs, "caramel_keras_mpi", KERAS_SCENARIOS).items()}
    for rank in (0, 1):
        plain = reports[(rank, "horovod")]["losses"]
        assert len(plain) == 4 and np.isfinite(plain).all()
        record = reports[(rank, "dropin")]
        assert record["plan"] and record["plan"]["allreduces"] == 4, record
        np.testing.assert_allclose(record["losses"], plain, rtol=1e-5, err_msg=f"rank {rank}")
    assert len({reports[(r, "dropin")]["plan"]["plan_digest"] for r in (0, 1)}) == 1


@pytest.mark.slow
@pytest.mark.parametrize("mode", ["graph", "tf2"])
def test_caramel_trains_a_model_with_control_flow_exactly_like_horovod(request, mode):
    """A while loop reading a weight in every iteration and a cond whose branch alternates:
    the flag and the drop-in train with plain Horovod's losses, every rank the same plan."""
    runs = _runs(request, mode)
    reports = {(rank, variant): record for (name, rank, variant), record in runs.items()
               if name == "control_flow"}
    variants = ["horovod", "flag", "dropin"]
    for rank in (0, 1):
        plain = reports[(rank, "horovod")]["losses"]
        assert len(plain) == 4 and np.isfinite(plain).all()
        for variant in variants[1:]:
            record = reports[(rank, variant)]
            assert record["plan"] and record["plan"]["allreduces"] == 5, record
            np.testing.assert_allclose(record["losses"], plain, rtol=1e-5,
                                       err_msg=f"rank {rank} {variant}")
    for variant in variants[1:]:
        assert len({reports[(r, variant)]["plan"]["plan_digest"] for r in (0, 1)}) == 1


@pytest.mark.slow
def test_backward_order_is_fixed_and_the_same_on_every_rank(graph_runs):
    """Eight independent branches: plain Horovod's gradient order changes from step to
    step; with Caramel (flag or drop-in) every traced step on every rank follows the plan."""
    reports = {(rank, variant): record for (name, rank, variant), record in graph_runs.items()
               if name == "parallel"}
    for variant in ("flag", "dropin"):
        plans = {tuple(reports[(r, variant)]["plan"]["gradient_order"]) for r in (0, 1)}
        assert len(plans) == 1
        plan = list(plans.pop())
        assert len(plan) == 9
        for rank in (0, 1):
            assert reports[(rank, variant)]["observed_orders"] == [plan] * 5
    plain = [tuple(o) for r in (0, 1) for o in reports[(r, "horovod")]["observed_orders"]]
    assert len(set(plain)) > 1, "plain Horovod's order never varied: the test shows nothing"


@pytest.mark.slow
@pytest.mark.parametrize("mode, variant", [("graph", "flag"), ("keras", "dropin")])
def test_buckets_and_their_order_show_in_horovods_timeline(network, tmp_path, mode, variant):
    """Graph mode with the session flag, and Keras model.fit with tfoverlap.horovod.keras."""
    timeline = tmp_path / "timeline.json"
    # bucket_chain="finished": each request waits for the one before to be reduced, so the
    # order is strict ("issued" lets two requests reach Horovod together).
    env = {"HOROVOD_TIMELINE": str(timeline), "HOROVOD_DISABLE_GROUP_FUSION": "1",
           "CARAMEL_TEST_FLOPS": "2e8", "CARAMEL_TEST_CHAIN": "finished",
           # Keras builds its own model (four weights, one of 2 MB; small buckets keep
           # that one apart); graph mode takes eight branches.
           "CARAMEL_TEST_MODEL": "parallel" if mode == "graph" else "",
           "CARAMEL_TEST_BUCKET_BYTES": str(4 * 2 ** 20 if mode == "graph" else 2 ** 16)}
    reports = _reports(_job(network, 2, "gloo", [mode, "3", variant], env=env), 2)
    plan = reports[(0, variant)]["plan"]
    rows = _timeline_rows(timeline.read_text())
    requests = sorted({name.rsplit("_", 1)[0] for name in rows if "/bucket_" in name},
                      key=lambda n: int(n.rsplit("_", 1)[1]))
    assert len(requests) == plan["requests"] >= 2, (requests, plan)
    for step in range(3):
        starts = []
        for request in requests:
            members = [n for n in rows if n.rsplit("_", 1)[0] == request]
            # One request: Horovod stamps its tensors one after another, microseconds apart.
            begins = [rows[m]["starts"][step] for m in members]
            assert max(begins) - min(begins) < 500, f"{request} was not reduced as one request"
            starts.append(min(begins))
            count = int(members[0].rsplit("of", 1)[1])
            assert len(members) == count
        assert starts == sorted(starts), f"step {step}: buckets out of plan order"
    sizes = [sum(rows[n]["bytes"] for n in rows if n.rsplit("_", 1)[0] == request)
             for request in requests]
    assert sizes == plan["bucket_bytes"]


def _timeline_rows(text: str) -> dict:
    """Horovod's timeline: per tensor, the begin times of its reductions and its bytes."""
    from tfoverlap.costs.horovod_timeline import read_timeline
    return {name: {"starts": [begin for begin, _ in record.reductions], "bytes": record.bytes}
            for name, record in read_timeline(text).items()}


@pytest.mark.slow
def test_ranks_with_different_plans_fail_with_a_clear_error(network):
    env = {"CARAMEL_TEST_RANK1_BANDWIDTH": "10Mbit"}
    result = _job(network, 2, "gloo", ["graph", "2", "flag"], env=env, timeout=180)
    assert result.returncode != 0
    for output in result.outputs:
        assert "planned different Caramel AllReduce buckets" in output, output[-3000:]
