"""The Horovod wrappers' core as plain data: the decision registry, the reduction rules
and the patch helper (tfoverlap/horovod/core/), without a Horovod job."""
import types

import pytest

from tfoverlap.horovod.core import decisions as registry
from tfoverlap.horovod.core.patching import MARKER, patch, unpatched


@pytest.fixture
def empty_registry(monkeypatch):
    monkeypatch.setattr(registry, "_entries", {})


def test_one_decision_per_wrapped_object_names_what_runs_and_why_the_rest_was_declined(
        empty_registry):
    graph_optimizer, tape_step = object(), ("tape", "variables")
    registry.record(registry.planned("decouple", True, "compression: only uncompressed"),
                    "graph", key=graph_optimizer, name="Momentum")
    registry.record(dict(registry.planned("cross_step", True), deferred=3, deferred_mb=1.5,
                         predicted_step_ms=90.0, in_step_ms=100.0),
                    "graph", key=graph_optimizer)
    registry.record(registry.planned("cross_step", "auto", "below min_gain 3.0%"), "tape",
                    key=tape_step)
    graph, tape = registry.decisions()
    assert (graph.api, graph.name, graph.mechanism, graph.deferred, graph.mode) == (
        "graph", "Momentum", "cross_step", 3, "on")
    assert graph.declined == {"decouple": "compression: only uncompressed"}
    assert (graph.predicted_step_ms, graph.in_step_ms, graph.reason) == (90.0, 100.0, "")
    assert (tape.mechanism, tape.mode, tape.deferred) == ("in_step", "auto", 0)
    assert tape.reason == "cross_step: below min_gain 3.0%"
    # A trace that decides again replaces the decision of the same mechanism.
    registry.record(dict(registry.planned("cross_step", "auto"), deferred=2), "tape",
                    key=tape_step)
    assert [d.deferred for d in registry.decisions()] == [3, 2]
    assert len(registry.recent_decisions()) == 3


def test_a_decision_that_grows_is_read_when_asked_and_kept_once_its_object_is_gone(
        empty_registry):
    live = {"plan": dict(registry.planned("cross_step", "auto"), deferred=4, drains=1)}
    registry.record(lambda: live["plan"], "keras", key="model", name="model")
    live["plan"] = dict(live["plan"], drains=7)
    assert registry.decisions()[0].plan["drains"] == 7
    live["plan"] = None                     # the model was collected
    decision, = registry.decisions()
    assert (decision.mechanism, decision.deferred, decision.plan["drains"]) == (
        "cross_step", 4, 7)


def test_an_unknown_mechanism_is_named():
    with pytest.raises(ValueError, match="unknown mechanism 'overlap'"):
        registry.record({}, "graph", mechanism="overlap")


def test_every_api_applies_the_same_reduction_rules():
    hvd = pytest.importorskip("horovod.tensorflow")
    from tfoverlap.horovod.core import contract

    def rules(**arguments):
        reduction = contract.reduction_of(**arguments)
        return (contract.horovods_reduction_kept(reduction),
                contract.deferral_refused_by_reduction(reduction),
                contract.decoupling_refused_by_reduction(reduction))

    assert rules() == ("", "", "")
    assert rules(op=hvd.Sum) == ("", "", "")
    assert rules(op=hvd.Adasum)[0] == "Adasum"
    assert rules(groups=[[0]], backward_passes_per_step=2)[0] == (
        "explicit groups, backward_passes_per_step > 1")
    fp16 = rules(compression=hvd.Compression.fp16)
    assert fp16[:2] == ("", "") and "only uncompressed" in fp16[2]
    assert "only unscaled" in rules(gradient_predivide_factor=2.0)[2]
    assert "compression" in rules(compression=types.SimpleNamespace(__name__="Mine"))[1]


def test_a_patch_is_made_once_and_remembers_what_it_replaced():
    owner = types.SimpleNamespace(run=lambda: "plain")
    plain = owner.run

    def counting(original):
        def run():
            return "ours+" + original()
        return run

    patch(owner, "run", counting)
    patch(owner, "run", counting)           # a second install: nothing more
    assert owner.run() == "ours+plain"
    assert getattr(owner.run, MARKER) is plain and unpatched(owner.run) is plain


def test_a_deferrals_buffers_and_flag_go_with_its_variables():
    """One buffer per variable and one pending flag per deferred set, however often a step
    is traced; a process that builds models in turn (a sweep, a test suite) keeps none of
    the old ones alive through them."""
    import gc
    import weakref

    import tensorflow as tf
    from tfoverlap.horovod.in_call import pending
    before = len(pending._buffers), len(pending._pending)  # noqa: SLF001
    variables = [tf.Variable(tf.ones([4, 3])), tf.Variable(tf.ones([3]))]
    traced, again = (pending.Deferral(decision={}, chunks=[[0, 1]], variables=variables)
                     for _ in range(2))
    pending.make_buffers(traced)
    pending.make_buffers(again)
    assert traced.buffers[0] is again.buffers[0] and traced.pending is again.pending
    assert traced.buffers[0].shape == (4, 3) and traced.buffers[1].shape == (3,)
    buffer, variable = weakref.ref(traced.buffers[0]), weakref.ref(variables[0])
    del variables, traced, again
    gc.collect()
    assert variable() is None and buffer() is None
    assert (len(pending._buffers), len(pending._pending)) == before  # noqa: SLF001


def test_an_entry_whose_variable_takes_no_weak_reference_stays_with_it():
    from tfoverlap.horovod.in_call.pending import PerVariables
    table, plain = PerVariables(), object()      # object() takes no weak reference
    assert table.get([plain], lambda: "made") == "made"
    assert table.get([plain], lambda: "again") == "made" == table.find([plain])
    assert table.find([object()]) is None and len(table) == 1


@pytest.mark.parametrize("ring_seconds", [0.004, 0.050])
def test_a_measured_latency_plans_a_lone_request_at_what_it_took(ring_seconds):
    """A lone small AllReduce waits for Horovod's next cycle: it took max(cycle, ring).
    The plan adds the cycle to the measured latency itself, so the measurement leaves it
    out, and a request is planned at what it took, not at a cycle more."""
    from tfoverlap.horovod.measure import _alpha_beta
    from tfoverlap.planning.caramel import request_latency
    ranks, cycle, steps = 8, 0.032, 14
    took = max(cycle, ring_seconds)
    bandwidth, latency = _alpha_beta(took, took + 0.1, 4096, 8 << 20, ranks, steps, cycle)
    planned = steps * request_latency(latency, ranks, cycle)
    assert planned == pytest.approx(took, rel=0.01)
    assert bandwidth == pytest.approx(steps / ranks * ((8 << 20) - 4096) / 0.1)


def _timed_ring(monkeypatch, seconds_of):
    """measure_network's AllReduces, each taking ``seconds_of(nbytes)`` on a clock of its
    own, at 2 ranks: the sizes reduced, in order."""
    import types

    import horovod.tensorflow as hvd

    from tfoverlap.horovod import measure
    calls, clock = [], [0.0]

    def allreduce(tensor, **_):
        calls.append(int(tensor.shape[0]) * 4)
        clock[0] += seconds_of(calls[-1])
        return tensor

    monkeypatch.setattr(hvd, "size", lambda: 2)
    monkeypatch.setattr(hvd, "allreduce", allreduce)
    monkeypatch.setattr(measure, "time", types.SimpleNamespace(perf_counter=lambda: clock[0]))
    monkeypatch.setattr(measure, "_from_rank0", lambda values, name: values)
    return calls


@pytest.mark.parametrize("warm_seconds, warm_calls", [(30.0, 8), (0.0, 1)])
def test_the_network_is_measured_on_a_warm_ring(monkeypatch, warm_seconds, warm_calls):
    """A ring's connections are slow for their first hundreds of MB: every timed
    AllReduce comes after ``warm_bytes`` of large ones, or as many as fit in
    ``warm_seconds`` (a slow link), and every rank makes the same calls (they are
    collectives)."""
    from tfoverlap.horovod import measure
    calls = _timed_ring(monkeypatch, lambda nbytes: 1e-3 + nbytes / 1e9)
    measure.measure_network(small_bytes=4096, large_bytes=1 << 20, repeats=3,
                            warm_bytes=8 << 20, warm_seconds=warm_seconds)
    assert calls == [1 << 20] * warm_calls + [4096] * 4 + [1 << 20] * 4


def test_a_large_allreduce_hidden_in_horovods_cycle_grows_until_its_ring_shows(
        monkeypatch):
    """Back-to-back requests take max(cycle, ring): at 10 GB/s and a 5 ms cycle, 1 MB and
    4 KB take a cycle each, which fitted a bandwidth of bytes over microseconds of noise.
    The large size grows fourfold until it takes twice the small one, and the fit then
    prices a large bucket at what it took."""
    from tfoverlap.horovod import measure
    cycle, bandwidth = 0.005, 10e9
    calls = _timed_ring(monkeypatch, lambda nbytes: max(cycle, nbytes / bandwidth))
    fitted, latency = measure.measure_network(small_bytes=4096, large_bytes=1 << 20,
                                              repeats=3, warm_bytes=1 << 20,
                                              largest_bytes=1 << 30)
    sizes = list(dict.fromkeys(calls[5:]))       # after the warm call and the small ones
    assert sizes == [1 << 20, 4 << 20, 16 << 20, 64 << 20, 256 << 20]
    # The plan prices a request at its cycle plus its bytes over the bandwidth.
    took = (256 << 20) / bandwidth
    assert cycle + ((256 << 20) - 4096) / fitted == pytest.approx(took, rel=1e-6)
    # Capped: the largest size the job allows, however hidden its ring still is.
    calls.clear()
    measure.measure_network(small_bytes=4096, large_bytes=1 << 20, repeats=3,
                            warm_bytes=1 << 20, largest_bytes=16 << 20)
    assert list(dict.fromkeys(calls[5:])) == [1 << 20, 4 << 20, 16 << 20]


def test_a_variable_whose_reads_an_open_session_has_taken_is_not_left_to_wait():
    """TensorFlow ignores a control input added to an op that a session already took (it
    warns; the op runs without the wait): updates of such a variable must stay in the
    step. A closed session does not count, nor one made after."""
    import tensorflow as tf

    from tfoverlap.horovod.session.pending import read_by_a_session, watch_sessions
    watch_sessions()
    graph = tf.Graph()
    with graph.as_default():
        weight = tf.compat.v1.get_variable("weight", initializer=[1.0], use_resource=True)
        later = tf.compat.v1.get_variable("later", initializer=[2.0], use_resource=True)
    assert read_by_a_session([weight]) == ""
    session = tf.compat.v1.Session(graph=graph)
    session.run(weight.initializer)
    with graph.as_default():
        unseen = tf.compat.v1.get_variable("unseen", initializer=[3.0], use_resource=True)
    reason = read_by_a_session([later, weight])
    assert reason.startswith("a session already ran this graph with later/"), reason
    assert read_by_a_session([unseen]) == ""        # built after the session's run
    session.close()
    assert read_by_a_session([weight]) == ""
