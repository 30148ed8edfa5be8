"""Caramel's bucket plan on plain numbers: brute force agrees, and the plan behaves."""
import itertools
import math

import pytest
from hypothesis import given, settings, strategies as st

from tfoverlap.costs.network import ring_allreduce_seconds
from tfoverlap.schedulers.caramel import plan_buckets

NET = dict(ranks=4, bandwidth=1e9, latency=1e-3)


def bucket_finish_times(bucket_sizes, bucket_ready, ranks, bandwidth, latency):
    """Buckets launched in order on one thread, each when ready: when each finishes."""
    finish, previous = [], 0.0
    for size, ready_at in zip(bucket_sizes, bucket_ready):
        previous = max(previous, ready_at) + ring_allreduce_seconds(size, ranks, bandwidth,
                                                                    latency)
        finish.append(previous)
    return finish


def brute_force_best(sizes, ready):
    """The best finish over every way to cut the ready order into consecutive buckets."""
    best = math.inf
    count = len(sizes)
    for cuts in itertools.product([False, True], repeat=count - 1):
        bounds, first = [], 0
        for index, cut in enumerate(cuts, start=1):
            if cut:
                bounds.append((first, index))
                first = index
        bounds.append((first, count))
        finish = bucket_finish_times([sum(sizes[a:b]) for a, b in bounds],
                                     [ready[b - 1] for a, b in bounds], **NET)
        best = min(best, finish[-1])
    return best


@settings(max_examples=150, deadline=None)
@given(st.lists(st.tuples(st.integers(0, 50_000_000), st.floats(0, 0.05)), min_size=1,
                max_size=8))
def test_plan_is_optimal_among_consecutive_bucketings(gradients):
    sizes = [size for size, _ in gradients]
    ready = sorted(gap for _, gap in gradients)
    buckets = plan_buckets(sizes, ready, **NET)
    assert buckets[-1].finish == pytest.approx(brute_force_best(sizes, ready), rel=1e-9)
    # Every byte of every gradient is in exactly one bucket, in ready order.
    covered = [(p.gradient, p.offset, p.size) for b in buckets for p in b.pieces]
    assert [g for g, _, _ in covered] == sorted(g for g, _, _ in covered)
    assert {g: sum(s for gg, _, s in covered if gg == g) for g, _, _ in covered} == {
        g: sizes[g] for g in range(len(sizes))}
    for earlier, later in zip(buckets, buckets[1:]):
        assert later.start >= earlier.finish - 1e-12 and later.start >= later.ready


@settings(max_examples=100, deadline=None)
@given(st.lists(st.tuples(st.integers(0, 50_000_000), st.floats(0, 0.05), st.floats(0, 0.05)),
                min_size=1, max_size=10))
def test_with_tails_the_plan_is_never_worse_than_horovods_fusion(gradients):
    from tfoverlap.schedulers.caramel import horovod_default_buckets, step_end
    sizes = [size for size, _, _ in gradients]
    ready = sorted(gap for _, gap, _ in gradients)
    tails = [tail for _, _, tail in gradients]
    for threads in (1, 2):
        plan = plan_buckets(sizes, ready, tails=tails, threads=threads, **NET)
        default = horovod_default_buckets(sizes, ready, **NET)
        assert step_end(plan, tails, threads) <= (
            step_end(default, tails, threads) * (1 + 1e-9) + 1e-12)


def test_latency_bound_network_fuses_and_bandwidth_bound_network_pipelines():
    sizes, ready = [1000] * 10, [0.001 * i for i in range(10)]
    slow_start = plan_buckets(sizes, ready, ranks=4, bandwidth=1e9, latency=0.01)
    assert len(slow_start) == 1            # 10 x 6 latencies would cost more than waiting
    # Each 100 MB AllReduce takes 0.15 s and the gradients come 0.2 s apart: each goes
    # alone, as soon as it is ready; only the last one is not hidden behind compute.
    big = [100_000_000] * 4
    spread = [0.2 * i for i in range(4)]
    pipelined = plan_buckets(big, spread, ranks=4, bandwidth=1e9, latency=1e-5)
    assert len(pipelined) == 4
    assert pipelined[-1].finish == pytest.approx(
        0.6 + ring_allreduce_seconds(100_000_000, 4, 1e9, 1e-5))


def test_large_gradients_are_split_so_their_first_part_travels_early():
    # A huge gradient ready early, then small ones that trickle in: one piece of the huge
    # one can go while the rest is still computing.
    sizes = [400_000_000, 1000, 1000]
    ready = [0.0, 0.5, 0.6]
    whole = plan_buckets(sizes, ready, **NET)
    split = plan_buckets(sizes, ready, chunk_bytes=50_000_000, **NET)
    assert all(len(b.pieces) >= 1 for b in split)
    assert sum(p.size for b in split for p in b.pieces if p.gradient == 0) == 400_000_000
    assert split[-1].finish <= whole[-1].finish + 1e-12


def test_bad_plans_are_refused():
    with pytest.raises(ValueError, match="ready order"):
        plan_buckets([1, 2], [0.2, 0.1], **NET)
    with pytest.raises(ValueError, match="length"):
        plan_buckets([1, 2], [0.1], **NET)
    with pytest.raises(ValueError):
        plan_buckets([1], [0.0], ranks=0, bandwidth=1e9, latency=0.0)
    assert plan_buckets([], [], **NET) == []


def test_horovod_default_fuses_what_is_ready_each_cycle():
    from tfoverlap.schedulers.caramel import horovod_default_buckets
    sizes = [10, 20, 30, 40]
    ready = [0.0, 0.0004, 0.0025, 0.0026]
    buckets = horovod_default_buckets(sizes, ready, ranks=2, bandwidth=1e3, latency=0.0)
    # Cycle at 0 takes gradient 0; the thread is then busy for 10 bytes / 1e3 B/s = 10 ms;
    # at the next cycle after 10 ms everything else is ready and goes as one request.
    assert [[p.gradient for p in b.pieces] for b in buckets] == [[0], [1, 2, 3]]
    assert buckets[1].start == pytest.approx(0.010)
    capped = horovod_default_buckets(sizes, [0.0] * 4, ranks=2, bandwidth=1e3, latency=0.0,
                                      fusion_bytes=50)
    assert [[p.gradient for p in b.pieces] for b in capped] == [[0, 1], [2], [3]]


@settings(max_examples=100, deadline=None)
@given(st.lists(st.tuples(st.integers(1, 10 ** 7), st.floats(0, 0.05)), min_size=1,
                max_size=14), st.integers(10 ** 5, 10 ** 7))
def test_buckets_of_several_pieces_respect_the_cap(gradients, cap):
    sizes = [size for size, _ in gradients]
    ready = sorted(time for _, time in gradients)
    buckets = plan_buckets(sizes, ready, ranks=4, bandwidth=1e9, latency=0.0,
                           max_bucket_bytes=cap)
    assert sorted(p.gradient for b in buckets for p in b.pieces) == list(range(len(sizes)))
    for bucket in buckets:
        assert len(bucket.pieces) == 1 or bucket.size <= cap


def _plan_with(ready, finish):
    from tfoverlap.planning.caramel import AllreducePlan
    from tfoverlap.schedulers.caramel import Bucket, Piece
    count = len(ready)
    bucket = Bucket(tuple(Piece(i, 0, 1) for i in range(count)), ready[-1], ready[-1], finish)
    return AllreducePlan("caramel", None, list(range(count)), [1] * count, list(ready),
                         [0.0] * count, [bucket], [])


def test_cross_step_defers_the_last_ready_gradients_within_the_forward_pass_and_tail():
    """The gradients ready last (the first layers) go to the next step's forward pass:
    as many as fit, with one request per chunk, in both the time to the first gradient
    and the ring's tail after the last one; chunks grow so the forward pass starts soon."""
    from tfoverlap.planning.caramel import deferred_chunks
    ready = [0.020 + 0.001 * i for i in range(40)]           # forward: 20 ms
    rings = [0.001] * 40
    chunks = deferred_chunks(_plan_with(ready, finish=0.200), rings, chunks=3,
                             request_seconds=0.001)
    chosen = [p for chunk in chunks for p in chunk]
    assert chosen == list(range(39, 39 - len(chosen), -1))    # last ready first
    assert len(chosen) == 17                                  # 20 ms - 3 requests
    assert len(chunks) == 3 and [len(c) for c in chunks] == sorted(len(c) for c in chunks)
    # A short tail is the limit instead of the forward pass.
    short = deferred_chunks(_plan_with(ready, finish=ready[-1] + 0.006), rings, chunks=3,
                            request_seconds=0.001)
    assert [len(c) for c in short] == [2, 2]        # 6 ms: 2 requests leave 4 gradients
    # Fewer chunks where few gradients fit, none where none does.
    few = deferred_chunks(_plan_with(ready, finish=ready[-1] + 0.0035), rings, chunks=3,
                          request_seconds=0.001)
    assert [len(c) for c in few] == [2]                    # one request: 2.5 ms left
    assert deferred_chunks(_plan_with(ready, finish=ready[-1]), rings, chunks=3,
                           request_seconds=0.001) == []
    # Tiny gradients that save less ring time than their request costs stay.
    tiny = [0.0001] * 40
    assert deferred_chunks(_plan_with(ready, finish=ready[-1] + 0.0015), tiny, chunks=3,
                           request_seconds=0.001) == []


def _chain_training_graph(layers: int = 8, width: int = 256, updates: bool = True):
    """A TensorFlow training step of a chain of MatMuls whose gradients go through ops
    named as Horovod's AllReduces (plain Identities, renamed in the GraphDef: the plan
    reads only names and shapes), each into its variable's SGD update (none where not
    ``updates``: the graph as a wrapper plans it, before the updates are built)."""
    import tensorflow as tf
    graph = tf.Graph()
    with graph.as_default():
        weights = [tf.compat.v1.get_variable(f"w{i}", [width, width], use_resource=True)
                   for i in range(layers)]
        hidden = tf.ones([32, width])
        for i, weight in enumerate(weights):
            hidden = tf.nn.relu(tf.matmul(hidden, weight, name=f"forward{i}"))
        gradients = tf.gradients(tf.reduce_sum(hidden), weights)
        for i, (weight, gradient) in enumerate(zip(weights, gradients)):
            reduced = tf.identity(gradient, name=f"allreduce{i}")
            if updates:
                tf.raw_ops.ResourceApplyGradientDescent(var=weight.handle, alpha=0.01,
                                                        delta=reduced)
    graph_def = graph.as_graph_def(add_shapes=True)
    for node in graph_def.node:
        if node.name.startswith("allreduce"):
            node.op = "HorovodAllreduce"
    seconds = {node.name: 1e-3 for node in graph_def.node if node.op == "MatMul"}
    return graph_def, seconds


def test_the_next_forward_passs_need_of_each_variable_comes_from_the_graph():
    """Each gradient's variable is first used by its layer's forward MatMul: the first
    layer's at once, the last layer's last."""
    from tfoverlap.planning.caramel import plan_allreduce
    graph_def, seconds = _chain_training_graph()
    plan = plan_allreduce(graph_def, "caramel", 8, 1e9, 1e-5, seconds, threads=1)
    names = [plan.model.names[node] for node in plan.nodes]
    assert names == [f"allreduce{i}" for i in reversed(range(8))]    # ready order
    users = [{plan.model.names[u] for u in needers} for needers in plan.needers]
    assert all(f"forward{7 - k}" in users[k] for k in range(8))
    assert plan.needs == sorted(plan.needs, reverse=True) and plan.needs[-1] == 0.0
    assert plan.needs[0] == pytest.approx(7e-3)       # after 7 forward MatMuls
    # Before the updates exist (a wrapper plans as it reduces), the variables come from
    # the wrapper; without them nothing is known.
    graph_def, seconds = _chain_training_graph(updates=False)
    blind = plan_allreduce(graph_def, "caramel", 8, 1e9, 1e-5, seconds, threads=1)
    assert blind.needers == [[]] * 8
    told = plan_allreduce(graph_def, "caramel", 8, 1e9, 1e-5, seconds, threads=1,
                          variables={f"allreduce{i}": f"w{i}" for i in range(8)})
    assert told.needs == plan.needs
    assert [{told.model.names[u] for u in needers} for needers in told.needers] == users


def test_cross_step_defers_what_the_next_forward_pass_needs_last_where_comm_bound():
    """Bound by its reductions, the step gains most by moving the top layers' reductions
    under the next forward pass (issued in need order, each before its layer's use),
    more than by moving the first layers', which the forward pass waits for; bound by
    compute, nothing is deferred; only eligible gradients are."""
    from tfoverlap.planning.caramel import bucket_problem, plan_allreduce, plan_cross_step
    from tfoverlap.sim.engine import simulate
    graph_def, seconds = _chain_training_graph()
    # A layer: 1 ms of forward compute, 2 ms of backward (on 2 threads), 4.6 ms of ring.
    network = dict(ranks=8, bandwidth=0.1e9, latency=1e-5)
    plan = plan_allreduce(graph_def, "caramel", **network, op_seconds=seconds, threads=2)
    cross = plan_cross_step(plan, seconds, **network, threads=2)
    assert cross.order == "next-forward need"
    assert cross.predicted_step < cross.candidates["in-step"] * 0.97
    assert cross.predicted_step <= cross.candidates.get("readiness suffix", math.inf)
    deferred = [p for chunk in cross.chunks for p in chunk]
    assert 0 in deferred and len(deferred) < len(plan.nodes)      # the top layer's first
    needs = [plan.needs[p] for p in deferred]
    assert needs == sorted(needs)                                  # issued in need order
    # The simulated next step: each deferred layer's MatMul starts after its reduction.
    problem = bucket_problem(plan, seconds, **network, threads=2, deferred=cross.chunks)
    schedule = simulate(problem)
    names = plan.model.names
    first_collective = plan.model.num_nodes + sum(1 for k in problem.kind[
        plan.model.num_nodes:] if k) - len(cross.chunks)
    for number, chunk in enumerate(cross.chunks):
        done = schedule.end[first_collective + number]
        for position in chunk:
            layer = names[plan.nodes[position]].removeprefix("allreduce")
            assert schedule.start[names.index(f"forward{layer}")] >= done - 1e-12
    # Compute-bound: the ring is idle at the end of the step, nothing to gain.
    fast = dict(network, bandwidth=1e12)
    fast_plan = plan_allreduce(graph_def, "caramel", **fast, op_seconds=seconds, threads=2)
    idle = plan_cross_step(fast_plan, seconds, **fast, threads=2)
    assert idle.predicted_step >= idle.in_step * (1 - 1e-9)
    # Only eligible gradients move.
    kept = plan_cross_step(plan, seconds, **network, threads=2, eligible=[3, 4, 5])
    assert {p for chunk in kept.chunks for p in chunk} < {3, 4, 5}
    # Never all of them: a step keeps a reduction of its own (one optimizer of two whose
    # every update moved would leave its step nothing to wait for).
    alone = plan_cross_step(plan, seconds, **network, threads=2, eligible=[0])
    assert alone.chunks == [] and alone.order == ""
