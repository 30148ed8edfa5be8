"""The Horovod wrappers' contract over API x mechanism x Horovod's reduction arguments
(tests/jobs/contract_matrix.py): every case trains bit for bit as plain Horovod does at 2
ranks; a case the mechanism carries out says so in tfoverlap.horovod.core.decisions(), a case
it cannot carry out is refused in one warning that names the reason. The suite's one job
of 2 Gloo ranks (conftest's ``horovod_jobs``) holds every case but Adasum, which Horovod
runs under MPI only: one MPI job holds it, and Sum in graph mode. Plain Average is each mechanism's own suite's (tests/test_cross_step.py,
tests/test_decoupled.py, tests/test_tape_decoupled.py); here it is tried through keras_tf
alone.
"""
import itertools
import os

import pytest

from tests.helpers import HorovodJob

JOB = os.path.join(os.path.dirname(__file__), "jobs", "contract_matrix.py")
APIS = ("graph", "tape", "keras", "keras_tf")
MECHANISMS = ("cross_step", "decouple")
#: "sum" also passes a process set (the global one): one training forwards both arguments
GLOO_VARIANTS = ("average", "sum", "fp16", "backward_passes_2", "sparse", "sparse_as_dense")
#: under MPI: Adasum where Horovod's wrapper takes it, and one carried-out case
MPI_CASES = ("graph/adasum", "tape/adasum", "graph/sum")
#: Horovod's own wrappers do not take these (its tape has no backward_passes_per_step,
#: its Keras optimizer raises on Adasum); keras_tf (a Keras optimizer given to
#: horovod.tensorflow's DistributedOptimizer, which hands it to horovod.tensorflow.keras:
#: tfoverlap.horovod's must get the Keras mechanisms too) is run for Average and Sum
NOT_HOROVODS = {("tape", "backward_passes_2"), ("keras", "adasum")} | {
    ("keras_tf", variant) for variant in ("adasum", "fp16", "backward_passes_2", "sparse",
                                          "sparse_as_dense")}
#: tested by each mechanism's suite
ELSEWHERE = {(api, "average") for api in ("graph", "tape", "keras")}
#: variants each mechanism carries out; the rest are refused in one warning
CARRIED_OUT = {
    "cross_step": {"average", "sum", "fp16", "sparse_as_dense"},
    "decouple": {"average", "sum", "sparse_as_dense"},
}
#: A sparse gradient keeps the graph's deferral to its in-step plan (its update is one
#: apply_gradients); the TF2 steps defer the dense gradients and reduce the sparse one in
#: the step.
CARRIED_OUT_BY_API = {("tape", "cross_step", "sparse"), ("keras", "cross_step", "sparse")}


def _cases(variants):
    return [f"{api}/{mechanism}/{variant}"
            for api, mechanism, variant in itertools.product(APIS, MECHANISMS, variants)
            if (api, variant) not in NOT_HOROVODS | ELSEWHERE]


def _env(cases):
    """The job's environment for ``cases``, given its records' directory."""
    return lambda directory: {"CONTRACT_RECORDS": str(directory),
                              "CONTRACT_CASES": ",".join(cases)}


HOROVOD_JOBS = {
    # Plain Horovod is trained once per api/variant pair, for both mechanisms.
    "contract_gloo": HorovodJob(JOB, _env(dict.fromkeys(
        case.split("/", 1)[0] + "/" + case.rsplit("/", 1)[1]
        for case in _cases(GLOO_VARIANTS))), timeout=900),
    "contract_mpi": HorovodJob(JOB, _env(MPI_CASES), controller="mpi"),
}


@pytest.fixture(scope="module")
def gloo_records(horovod_jobs):
    return horovod_jobs.records("contract_gloo")


@pytest.fixture(scope="module")
def mpi_records(horovod_jobs):
    return horovod_jobs.records("contract_mpi")


def _check(records, case: str) -> None:
    api, mechanism, variant = case.split("/")
    carried_out = (variant in CARRIED_OUT[mechanism]
                   or (api, mechanism, variant) in CARRIED_OUT_BY_API)
    for rank, record in enumerate(records):
        plain, ours = record[case]["horovod"], record[case]["tfoverlap"]
        assert "error" not in ours, (rank, ours["error"])
        assert ours["losses"] == plain["losses"], (rank, case)
        assert ours["weights"] == plain["weights"], (rank, case)
        decided = ours["decisions"]
        if carried_out:
            assert [d["mechanism"] for d in decided] == [mechanism], (rank, decided)
            assert decided[0]["deferred"] >= 1, decided
            assert decided[0]["api"] == ("keras" if api == "keras_tf" else api), decided
            assert ours["warnings"] == [], (rank, ours["warnings"])
            continue
        # Refused: one warning, whose reason the decision (where one was made) repeats.
        assert len(ours["warnings"]) == 1, (rank, case, ours["warnings"])
        warning = ours["warnings"][0]
        if decided:
            assert [d["mechanism"] for d in decided] == ["in_step"], (rank, decided)
            reason = decided[0]["declined"][mechanism]
            assert reason and reason in warning, (rank, reason, warning)
        else:       # the wrapper left the whole reduction to Horovod before any plan
            assert "Horovod's own reduction is used" in warning, warning


@pytest.mark.parametrize("case", _cases(GLOO_VARIANTS))
def test_each_case_trains_as_horovod_or_is_refused_in_one_warning(gloo_records, case):
    _check(gloo_records, case)


@pytest.mark.parametrize("case", [f"{api}/{mechanism}/{variant}" for api, variant in
                                  (case.split("/") for case in MPI_CASES)
                                  for mechanism in MECHANISMS])
def test_adasum_is_left_to_horovod_and_sum_carried_out_under_mpi(mpi_records, case):
    _check(mpi_records, case)
