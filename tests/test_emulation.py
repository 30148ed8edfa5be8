"""Emulated accelerators: the kernel (shapes, dtypes, stream semantics, no CPU while it
waits) and the emulate pass (what it replaces, what stays real, its report, bad input).

Wall-time accuracy against the requested durations is measured by
scripts/bench_emulated_kernel.py, not here; these tests check orderings and overlaps with
margins far above timer noise.
"""
import concurrent.futures
import json
import time

import numpy as np
import pytest
import tensorflow as tf

import tfoverlap
from tfoverlap.costs.accelerators import DEVICE_MODELS, load_device_model
from tfoverlap.costs.trace import STREAM_WAIT_OP, emulated_kernels, step_timeline
from tfoverlap.graph.verify import verify_graph_def
from tfoverlap.integrations.emulated_kernel import load_emulated_ops
from tfoverlap.rewriters.emulated_ops import EMULATED_OP
from tfoverlap.testbed.models import build_model, control_flow_model

from helpers import run_python

WORKER = "/job:worker/task:0"


def _emulated(inputs, dtypes, shapes, milliseconds, stream=0, name=None, blocking=True,
              pool=0):
    return load_emulated_ops().tf_overlap_emulated_compute(
        inputs, Tout=dtypes, output_shapes=shapes, duration_us=milliseconds * 1e3,
        stream=stream, blocking=blocking, pool=pool, name=name)


def _wait(tensors, producers, name=None):
    return load_emulated_ops().tf_overlap_stream_wait(tensors, producers=producers, name=name)


def _graph_session():
    graph = tf.Graph()
    return graph, tf.compat.v1.Session(graph=graph)


def test_outputs_are_zeros_of_the_given_dtypes_and_static_shapes():
    graph, session = _graph_session()
    with graph.as_default():
        x = tf.constant(np.ones((4, 8), np.float32))
        outputs = _emulated([x, tf.constant(3)], [tf.float32, tf.int32, tf.float16],
                            [[4, 8], [3], [2, 0, 5]], 1)
        assert [o.shape.as_list() for o in outputs] == [[4, 8], [3], [2, 0, 5]]
    with session:
        for _ in range(2):   # the second step returns the cached tensors
            values = session.run(outputs)
            assert [v.dtype for v in values] == [np.float32, np.int32, np.float16]
            assert [v.shape for v in values] == [(4, 8), (3,), (2, 0, 5)]
            assert all(not v.any() for v in values)


def test_bad_attributes_are_clear_errors():
    graph, session = _graph_session()
    with graph.as_default():
        with pytest.raises(ValueError, match="output_shapes"):
            _emulated([], [tf.float32, tf.float32], [[1]], 1)
        unknown = _emulated([], [tf.float32], [[None, 2]], 1)
        negative = _emulated([], [tf.float32], [[1]], -1)
        strings = _emulated([], [tf.string], [[1]], 1)
    with session:
        with pytest.raises(tf.errors.InvalidArgumentError, match="plain numbers, not string"):
            session.run(strings)
        with pytest.raises(tf.errors.InvalidArgumentError, match="static output shapes"):
            session.run(unknown)
        with pytest.raises(tf.errors.InvalidArgumentError, match="duration_us must be >= 0"):
            session.run(negative)


def _timed(session, fetches, repeat=3):
    session.run(fetches)
    start = time.perf_counter()
    cpu = time.process_time()
    for _ in range(repeat):
        session.run(fetches)
    return (time.perf_counter() - start) / repeat, (time.process_time() - cpu) / repeat


def test_one_stream_runs_kernels_one_at_a_time_and_two_streams_overlap():
    """Four independent 60 ms kernels: one stream takes their sum, two streams half of it;
    the process spends almost no CPU while they wait."""
    graph, session = _graph_session()
    with graph.as_default():
        x = tf.constant(1.0)
        same = [_emulated([x], [tf.float32], [[]], 60)[0] for _ in range(4)]
        split = [_emulated([x], [tf.float32], [[]], 60, stream=k % 2)[0] for k in range(4)]
    with session:
        one_stream, one_cpu = _timed(session, same)
        two_streams, _ = _timed(session, split)
    assert 0.22 < one_stream < 0.40, one_stream
    assert 0.11 < two_streams < 0.20, two_streams
    assert one_cpu < 0.25 * one_stream, (one_cpu, one_stream)


def test_blocking_kernels_on_a_pool_take_whichever_thread_is_free():
    """A CPU executor's semantics: four independent 60 ms kernels, all naming stream 0, on
    a pool of two threads take two kernel times, on a pool of one four; a pool needs
    blocking kernels."""
    graph, session = _graph_session()
    with graph.as_default():
        x = tf.constant(1.0)
        two = [_emulated([x], [tf.float32], [[]], 60, pool=2)[0] for _ in range(4)]
        one = [_emulated([x], [tf.float32], [[]], 60, pool=1)[0] for _ in range(4)]
        launched = _emulated([x], [tf.float32], [[]], 1, pool=2, blocking=False)
    with session:
        on_two, cpu = _timed(session, two)
        on_one, _ = _timed(session, one)
        with pytest.raises(tf.errors.InvalidArgumentError, match="only blocking kernels"):
            session.run(launched)
    assert 0.11 < on_two < 0.20, on_two
    assert 0.22 < on_one < 0.40, on_one
    assert cpu < 0.25 * on_two, (cpu, on_two)


def test_a_stream_completes_kernels_in_issue_order():
    """A long kernel (150 ms) and, on its own stream, a 30 ms gate start together; two
    short kernels issued when the gate ends must, on the long kernel's stream, wait for it
    (a CUDA stream's semantics), and on a third stream not."""
    graph, session = _graph_session()
    with graph.as_default():
        x = tf.constant(1.0)
        long = _emulated([x], [tf.float32], [[]], 150, name="long")[0]
        gate = _emulated([x], [tf.float32], [[]], 30, stream=2, name="gate")[0]
        short_same = _emulated([gate], [tf.float32], [[]], 1, name="short_same")[0]
        short_other = _emulated([gate], [tf.float32], [[]], 1, stream=1,
                                name="short_other")[0]
    options = tf.compat.v1.RunOptions(trace_level=tf.compat.v1.RunOptions.FULL_TRACE)
    with session:
        session.run([long, short_same, short_other])
        metadata = tf.compat.v1.RunMetadata()
        session.run([long, short_same, short_other], options=options, run_metadata=metadata)
    ends = {n.node_name: n.all_start_micros + n.all_end_rel_micros
            for d in metadata.step_stats.dev_stats for n in d.node_stats}
    assert ends["short_same"] >= ends["long"], ends
    assert ends["short_other"] < ends["long"] - 100_000, ends


def _end_times(session, fetches):
    options = tf.compat.v1.RunOptions(trace_level=tf.compat.v1.RunOptions.FULL_TRACE)
    session.run(fetches)
    metadata = tf.compat.v1.RunMetadata()
    start = time.perf_counter()
    session.run(fetches, options=options, run_metadata=metadata)
    wall = time.perf_counter() - start
    nodes = [n for d in metadata.step_stats.dev_stats for n in d.node_stats]
    first = min(n.all_start_micros for n in nodes)
    return {n.node_name: (n.all_start_micros + n.all_end_rel_micros - first) / 1e3
            for n in nodes}, wall


def test_launched_kernels_complete_at_once_and_a_wait_forwards_at_its_producers_end():
    """A GPU's semantics: non-blocking kernels complete for the executor at launch (the
    host runs ahead); a stream wait forwards each value when the kernel that produced it
    has ended on the stream, not when the whole stream is idle."""
    graph, session = _graph_session()
    with graph.as_default():
        x = tf.constant(1.0)
        first = _emulated([x], [tf.float32], [[]], 50, name="first", blocking=False)[0]
        second = _emulated([first], [tf.float32], [[]], 200, name="second",
                           blocking=False)[0]
        after_first = _wait([first], ["first"], name="after_first")[0]
        after_second = _wait([second], ["second"], name="after_second")[0]
    with session:
        ends, wall = _end_times(session, [after_first, after_second])
    assert ends["second"] < 30, ends                  # launched, not finished
    assert 45 <= ends["after_first"] < 150, ends      # the first kernel's end, ~50 ms
    assert 240 <= ends["after_second"] < 400, ends    # both kernels, ~250 ms
    assert 0.24 <= wall < 0.45


def test_a_kernel_starts_when_its_producer_on_another_stream_has_ended(tmp_path):
    """Two dependent 300 ms kernels on two streams take 600 ms, not 300: the pass names
    the producer in the consumer's ``after``, once, and adds it to graphs made before."""
    graph = tf.Graph()
    with graph.as_default():
        x = tf.constant(np.ones((64, 64), np.float32))
        tf.reduce_sum(tf.matmul(tf.matmul(x, x, name="a"), x, name="b"), name="total")
    device = tmp_path / "device.json"
    device.write_text(json.dumps({"base": "v100", "op_seconds": {"a": 0.3, "b": 0.3}}))
    options = dict(fetch=["total"], schedule="none", emulate=str(device), emulate_streams=2)
    new, report = tfoverlap.optimize(graph.as_graph_def(), **options)
    kernels = {n.name: n for n in new.node if n.op == EMULATED_OP}
    assert kernels["a"].attr["stream"].i != kernels["b"].attr["stream"].i
    assert list(kernels["b"].attr["after"].list.s) == [b"a"]
    assert not kernels["a"].attr["after"].list.s
    assert report.passes[0].summary["cross_stream_waits"] == 1
    again, second = tfoverlap.optimize(new, **options)
    assert again is new and not second.modified
    older = tf.compat.v1.GraphDef()
    older.CopyFrom(new)
    del next(n for n in older.node if n.name == "b").attr["after"]
    upgraded, third = tfoverlap.optimize(older, **options)
    assert third.modified and upgraded == new
    emulated = tf.Graph()
    with emulated.as_default():
        tf.graph_util.import_graph_def(new, name="")
    with tf.compat.v1.Session(graph=emulated) as session:
        wall, _ = _timed(session, "total:0", repeat=2)
    assert wall >= 0.5, wall


def test_sessions_with_the_same_node_names_never_see_each_others_kernels():
    """Session A's wait for its 500 ms kernel "k" is held by a gate while session B runs a
    1 ms kernel also called "k" on another stream: A still waits for its own kernel."""
    graph_a, session_a = _graph_session()
    with graph_a.as_default():
        x = tf.constant(1.0)
        kernel = _emulated([x], [tf.float32], [[]], 500, name="k", blocking=False)[0]
        launched, gate = tf.queue.FIFOQueue(1, tf.float32), tf.queue.FIFOQueue(1, tf.float32)
        with tf.control_dependencies([kernel]):
            announce = launched.enqueue(x)
        wait_launched, open_gate = launched.dequeue(), gate.enqueue(x)
        after_kernel = _wait([kernel, gate.dequeue()], ["k"])[0]
    graph_b, session_b = _graph_session()
    with graph_b.as_default():
        kernel_b = _emulated([tf.constant(1.0)], [tf.float32], [[]], 1, stream=1, name="k",
                             blocking=False)[0]
        after_kernel_b = _wait([kernel_b], ["k"])[0]
    limit = tf.compat.v1.RunOptions(timeout_in_ms=10_000)

    def step_of_a():
        start = time.perf_counter()
        session_a.run([after_kernel, announce], options=limit)
        return time.perf_counter() - start

    with session_a, session_b, concurrent.futures.ThreadPoolExecutor(1) as pool:
        step = pool.submit(step_of_a)
        session_a.run(wait_launched, options=limit)    # A's "k" is on its stream
        session_b.run(after_kernel_b, options=limit)
        session_a.run(open_gate, options=limit)
        assert step.result() >= 0.45


def test_a_pool_of_another_size_never_frees_a_busy_slot():
    """Four 400 ms kernels fill a pool of four; a kernel on a pool of two (as another
    graph's would be) runs at once, and does not shrink the pool of four: a kernel issued
    on it 100 ms later still waits for a slot to free."""
    graph, session = _graph_session()
    with graph.as_default():
        x = tf.constant(1.0)
        busy = [_emulated([x], [tf.float32], [[]], 400, pool=4)[0] for _ in range(4)]
        first_gate = _emulated([x], [tf.float32], [[]], 50, stream=1)[0]
        second_gate = _emulated([x], [tf.float32], [[]], 100, stream=2)[0]
        small = _emulated([first_gate], [tf.float32], [[]], 1, pool=2, name="small")[0]
        late = _emulated([second_gate], [tf.float32], [[]], 400, pool=4, name="late")[0]
    with session:
        ends, _ = _end_times(session, busy + [small, late])
    assert ends["small"] < 300, ends
    assert ends["late"] >= 750, ends


def test_a_cancelled_step_ends_at_once_and_delays_no_later_step():
    """A step that times out while a stream wait or a blocking kernel waits for a 3 s
    kernel ends at once; the next session's kernels on the same streams do not wait for
    the aborted ones."""
    def kernels(milliseconds):
        x = tf.constant(1.0)
        launched = _emulated([x], [tf.float32], [[]], milliseconds, name="launched",
                             blocking=False)[0]
        return (_wait([launched], ["launched"])[0],
                _emulated([x], [tf.float32], [[]], milliseconds, stream=1)[0])

    graph, session = _graph_session()
    with graph.as_default():
        long_kernels = kernels(3000)
    with session:
        for fetch in long_kernels:
            start = time.perf_counter()
            with pytest.raises((tf.errors.DeadlineExceededError, tf.errors.CancelledError)):
                session.run(fetch, options=tf.compat.v1.RunOptions(timeout_in_ms=200))
            assert time.perf_counter() - start < 1.5
    graph, session = _graph_session()
    with graph.as_default():
        short_kernels = kernels(100)
    with session:
        start = time.perf_counter()
        session.run(short_kernels)
        assert time.perf_counter() - start < 1.0


def _ps_resnet(training=True):
    return build_model("resnet20", batch=8, num_ps=1, worker_device=WORKER,
                       training=training, image_size=32)


def test_the_pass_replaces_heavy_worker_compute_and_keeps_the_rest_real():
    model = _ps_resnet()
    graph_def = model.graph.as_graph_def()
    fetch = [model.loss.op.name, model.train_op.name]
    new, report = tfoverlap.optimize(graph_def, fetch=fetch, schedule="none", emulate="v100",
                                     dilation=10)
    (entry,) = report.passes
    summary = entry.summary
    assert entry.name == "emulate" and entry.modified
    before = {n.name: n for n in graph_def.node}
    emulated = [n for n in new.node if n.op == EMULATED_OP]
    assert len(emulated) == summary["emulated_ops"] > 40
    types = summary["emulated_op_types"]
    for op_type in ("Conv2D", "Conv2DBackpropFilter", "Conv2DBackpropInput"):
        assert types.get(op_type, 0) >= 19, types
    for node in emulated:
        original = before[node.name]
        assert node.device == original.device and node.device.startswith(WORKER)
        assert [text.split(":")[0] for text in node.input] == [
            text.split(":")[0].removeprefix("tfoverlap/stream_wait/") for text in original.input]
        assert node.attr["original_op"].s.decode() == original.op
        assert node.attr["duration_us"].f > 0
    waits = [n for n in new.node if n.op == "TfOverlapStreamWait"]
    assert len(waits) == summary["stream_waits"] > 0
    emulated_names = {n.name for n in emulated}
    for node in new.node:
        if node.op not in (EMULATED_OP, "TfOverlapStreamWait"):
            assert not any(text.split(":")[0] in emulated_names for text in node.input), node.name
    kept = {n.op for n in new.node if n.op not in (EMULATED_OP, "TfOverlapStreamWait")}
    assert {"VarHandleOp", "ReadVariableOp", "ResourceApplyGradientDescent"} <= kept
    assert all(before[n.name].op == n.op for n in new.node
               if n.device.startswith("/job:ps") or n.name in fetch)
    assert not any(n.attr["blocking"].b for n in emulated)
    (milliseconds,) = summary["emulated_ms"].values()
    assert milliseconds > 0
    verify_graph_def(new, fetch, before=graph_def)
    again, second = tfoverlap.optimize(new, fetch=fetch, schedule="none", emulate="v100",
                                       dilation=10)
    assert again is new and not second.modified
    # Durations: the device model's, times the dilation.
    durations = {n.name: n.attr["duration_us"].f for n in emulated}
    faster, _ = tfoverlap.optimize(graph_def, fetch=fetch, schedule="none", emulate="h100",
                                   dilation=10)
    assert sum(n.attr["duration_us"].f for n in faster.node if n.op == EMULATED_OP) < sum(
        durations.values())


def test_the_pass_runs_after_tictac_which_plans_on_the_original_graph():
    model = _ps_resnet(training=False)
    graph_def = model.graph.as_graph_def()
    fetch = [model.loss.op.name]
    ordered, plain = tfoverlap.optimize(graph_def, fetch=fetch, schedule="tic", force=True)
    both, report = tfoverlap.optimize(graph_def, fetch=fetch, schedule="tic", force=True,
                                      emulate="v100")
    assert [p.name for p in report.passes] == ["tictac", "emulate"]
    assert report.passes[0].summary["order"] == plain.passes[0].summary["order"]
    # TicTac's ordering edges (control inputs) are all there, on the same nodes.
    ordered_edges = {n.name: [i for i in n.input if i.startswith("^")] for n in ordered.node}
    both_edges = {n.name: [i for i in n.input if i.startswith("^")] for n in both.node}
    assert all(both_edges[name] == edges for name, edges in ordered_edges.items())


def test_tictacs_estimate_on_a_graph_already_emulated_costs_its_kernels_as_they_run():
    """Grappler runs the passes again on the graph its first round emulated. TicTac's
    estimate there takes each emulated kernel's own duration, as in the first round, not
    a static guess for an op it does not know: the two rounds predict alike."""
    model = _ps_resnet()
    graph_def = model.graph.as_graph_def()
    fetch = [model.loss.op.name, model.train_op.name]
    options = dict(schedule="tic", emulate="v100", dilation=10, bandwidth="1Gbit", workers=4)
    emulated, first = tfoverlap.optimize(graph_def, fetch=fetch, **options)
    assert any(n.op == EMULATED_OP for n in emulated.node)
    _, second = tfoverlap.optimize(emulated, fetch=fetch, **options)
    first_round, second_round = (next(p.summary for p in report.passes if p.name == "tictac")
                                 for report in (first, second))
    assert second_round["comp_ms"] == pytest.approx(first_round["comp_ms"], rel=0.05)
    assert second_round["predicted_gain"] == pytest.approx(first_round["predicted_gain"],
                                                           abs=0.02)


def test_a_graph_with_control_flow_trains_emulated_without_error():
    """LSTM (while loop), Keras batch norm with a learning-phase cond: control flow and its
    predicates stay real, the graph runs, every step, in a session."""
    model = control_flow_model(training=True, worker_device="/device:CPU:0",
                               ps_device="/device:CPU:0", width=256, batch=64)
    config = tfoverlap.session_config(schedule="none", emulate="v100", strict=True)
    with tf.compat.v1.Session(graph=model.graph, config=config) as session:
        session.run(model.init)
        for step in range(3):
            value, _ = session.run([model.loss, model.train_op],
                                   model.feeds(step) if model.feeds else None)
            assert np.isfinite(value)
    report = next(r for r in reversed(tfoverlap.recent_reports())
                  if any(p.name == "emulate" and p.modified for p in r.passes))
    (entry,) = [p for p in report.passes if p.name == "emulate"]
    assert entry.summary["emulated_ops"] > 0


@pytest.mark.parametrize("options, message", [
    (dict(emulate="t4000"), "neither a device model"),
    (dict(emulate="v100", dilation=0.5), "'dilation' must be at least 1"),
    (dict(emulate="v100", emulate_streams=0), "'emulate_streams' must be at least 1"),
])
def test_bad_emulation_options_are_clear_errors(options, message):
    with pytest.raises(ValueError, match=message):
        tfoverlap.session_config(**options)


def test_device_files_override_the_model_and_bad_ones_are_named(tmp_path):
    measured = tmp_path / "measured.json"
    measured.write_text(json.dumps({"base": "a100", "launch_seconds": 0,
                                    "op_seconds": {"conv": 0.002}}))
    device = load_device_model(str(measured))
    assert device.name == "measured" and device.op_seconds == {"conv": 0.002}
    assert device.op_time("conv", "Conv2D", 1e12, 0) == 0.002
    assert device.op_time("other", "Conv2D", 1e12, 0) == pytest.approx(
        1e12 / (DEVICE_MODELS["a100"].matrix_flops * DEVICE_MODELS["a100"].matrix_efficiency))
    for text, message in (("{", "cannot read device file"),
                          ('{"matrix_flops": -1}', "matrix_flops must be a non-negative"),
                          ('{"op_seconds": {"a": "x"}}', "op_seconds must map"),
                          ('{"speed": 1}', "unknown field 'speed'")):
        bad = tmp_path / "bad.json"
        bad.write_text(text)
        with pytest.raises(ValueError, match=message):
            tfoverlap.session_config(emulate=str(bad))


def test_a_profile_replays_each_ops_share_else_its_mean_time(tmp_path):
    from tfoverlap.costs.profile import Profile, load_profile, save_profile
    with_shares = tmp_path / "with_shares.json"
    save_profile(Profile(op_seconds={"conv": 0.001}, transfer_seconds={},
                         op_mean_seconds={"conv": 0.003}, op_share_seconds={"conv": 0.002}),
                 str(with_shares))
    assert load_profile(str(with_shares)).op_share_seconds == {"conv": 0.002}
    assert load_device_model(str(with_shares)).op_time("conv", "Conv2D", 1e12, 0) == 0.002
    older = tmp_path / "older.json"          # written before shares were kept
    data = json.loads(with_shares.read_text())
    del data["op_share_seconds"]
    older.write_text(json.dumps(data))
    assert load_device_model(str(older)).op_time("conv", "Conv2D", 1e12, 0) == 0.003
    del data["op_mean_seconds"]              # ... and before means were
    older.write_text(json.dumps(data))
    assert load_device_model(str(older)).op_time("conv", "Conv2D", 1e12, 0) == 0.001
    for key in ("op_mean_seconds", "op_share_seconds"):
        data[key] = {"conv": -1}
        older.write_text(json.dumps(data))
        with pytest.raises(ValueError, match=key):
            load_device_model(str(older))
        del data[key]


def test_each_op_gets_its_share_of_the_moments_it_ran_in():
    from tensorflow.core.framework import step_stats_pb2
    from tfoverlap.costs.trace import op_wall_shares
    stats = step_stats_pb2.StepStats()
    mine = stats.dev_stats.add(device="/job:worker/replica:0/task:0/device:CPU:0")
    for name, start, end in (("a", 0, 10), ("b", 5, 15), ("c", 20, 25), ("empty", 30, 30)):
        mine.node_stats.add(node_name=name, all_start_micros=1000 + start,
                            op_start_rel_micros=0, op_end_rel_micros=end - start)
    other = stats.dev_stats.add(device="/job:worker/replica:0/task:1/device:CPU:0")
    other.node_stats.add(node_name="elsewhere", all_start_micros=1000, op_end_rel_micros=10)
    # a and b ran together from 5 to 10: half of those 5 µs each.
    assert op_wall_shares(stats, "/job:worker/task:0") == pytest.approx(
        {"a": 7.5, "b": 7.5, "c": 5.0})
    assert op_wall_shares(stats, "/job:worker/task:2") == {}


def test_a_cpu_profile_keeps_each_ops_share_and_an_emulated_one_none(tmp_path):
    model = build_model("resnet20", batch=8, num_ps=0, worker_device="/cpu:0", training=True,
                        image_size=32)
    config = tf.compat.v1.ConfigProto(inter_op_parallelism_threads=2,
                                      intra_op_parallelism_threads=1)
    with tf.compat.v1.Session(graph=model.graph, config=config) as session:
        session.run(model.init)
        measured = tfoverlap.profile(session, model.fetch, steps=2, worker_device="")
    assert set(measured.op_share_seconds) <= set(measured.op_mean_seconds)
    assert len(measured.op_share_seconds) > 50
    # A share is at most the op's own time; where ops ran together, less.
    assert all(share <= measured.op_mean_seconds[name] + 1e-9
               for name, share in measured.op_share_seconds.items())
    assert sum(measured.op_share_seconds.values()) < sum(measured.op_mean_seconds.values())


def test_a_process_without_tfoverlap_cannot_run_the_op_and_tfoverlap_load_registers_it():
    """Servers that run emulated graphs must load tfoverlap (tfoverlap.load())."""
    result = run_python("""
import tensorflow as tf
from tensorflow.core.framework import op_def_pb2
from tensorflow.python.framework import op_def_registry
print("before", op_def_registry.get("TfOverlapEmulatedCompute") is not None)
import tfoverlap
tfoverlap.load()
print("after", op_def_registry.get("TfOverlapEmulatedCompute") is not None)
""")
    assert result.returncode == 0, result.stderr[-2000:]
    assert "before False" in result.stdout and "after True" in result.stdout


def test_worker_side_updates_are_emulated_and_ps_side_updates_stay_real():
    """Replicated weights (Horovod: every variable on the worker) are updated by emulated
    memory-bound kernels; with a PS, the updates run on the PS, for real."""
    local = build_model("vgg16", batch=2, num_ps=0, worker_device="/cpu:0", training=True,
                        image_size=32)
    new, report = tfoverlap.optimize(local.graph.as_graph_def(), fetch=[local.train_op.name],
                                     schedule="none", emulate="v100")
    types = report.passes[0].summary["emulated_op_types"]
    assert types.get("ResourceApplyGradientDescent", 0) >= 13, types
    updates = [n for n in new.node if n.attr["original_op"].s == b"ResourceApplyGradientDescent"]
    assert all(not n.attr["Tout"].list.type and n.attr["duration_us"].f > 0 for n in updates)
    graph = tf.Graph()
    with graph.as_default():
        tf.graph_util.import_graph_def(new, name="")
    with tf.compat.v1.Session(graph=graph) as session:
        session.run(local.init.name)
        session.run(local.train_op.name)


def test_a_profile_of_an_emulated_run_holds_the_kernels_stream_times(tmp_path):
    """Launched kernels complete at once for the executor; the profile (TAC's costs, the
    simulator's) takes their stream time from the graph instead."""
    model = build_model("resnet20", batch=8, num_ps=0, worker_device="/cpu:0", training=True,
                        image_size=32)
    config = tfoverlap.session_config(schedule="none", emulate="v100", dilation=7)
    with tf.compat.v1.Session(graph=model.graph, config=config) as session:
        session.run(model.init)
        measured = tfoverlap.profile(session, model.fetch, steps=2, worker_device="",
                                     path=str(tmp_path / "profile.json"))
        metadata = tf.compat.v1.RunMetadata()
        session.run(model.fetch, options=tf.compat.v1.RunOptions(
            trace_level=tf.compat.v1.RunOptions.FULL_TRACE, output_partition_graphs=True),
            run_metadata=metadata)
    # The step's timeline shows the kernels as they occupy the stream, one after another,
    # and not the waits.
    compute = sorted(step_timeline(metadata)["compute"], key=lambda entry: entry[1])
    assert not any(entry[0].startswith("tfoverlap/stream_wait/") for entry in compute)
    kernels = emulated_kernels(metadata)
    streamed = [entry for entry in compute if entry[0] in kernels]
    assert len(streamed) > 50
    assert all(entry[2] == round(kernels[entry[0]].seconds * 1e6) for entry in streamed)
    overlaps = [(earlier, later) for earlier, later in zip(streamed, streamed[1:])
                if later[1] < earlier[1] + earlier[2]]
    assert not overlaps, overlaps[:3]
    assert measured.op_share_seconds == {}   # kernels on streams: no CPU time to share
    # The stream waits (where results leave the stream) wait
    # for the kernels' time and compute nothing: a profile that kept their durations would
    # count the stream again, many times over (TAC's costs, TicTac's gain estimate).
    waits = [n.name for n in tfoverlap.optimize(
        model.graph.as_graph_def(), fetch=[model.fetch.name], schedule="none",
        emulate="v100", dilation=7)[0].node if n.op == STREAM_WAIT_OP]
    assert waits and not set(waits) & set(measured.op_seconds)
    new, _ = tfoverlap.optimize(model.graph.as_graph_def(), fetch=[model.fetch.name],
                                schedule="none", emulate="v100", dilation=7)
    durations = {n.name: n.attr["duration_us"].f * 1e-6 for n in new.node
                 if n.op == EMULATED_OP and n.attr["original_op"].s == b"Conv2DBackpropFilter"}
    assert durations
    for name, seconds in durations.items():
        assert measured.op_seconds[name] == pytest.approx(seconds, rel=1e-6), name


_HOROVOD_STEP = """
import sys
import numpy as np
import tensorflow as tf
import horovod.tensorflow as hvd
hvd.init()
graph = tf.Graph()
with graph.as_default():
    x = tf.constant(np.ones((64, 1024), np.float32))
    w = tf.compat.v1.get_variable("w", [1024, 1024])
    loss = tf.reduce_sum(tf.matmul(x, w))
    (gradient,) = tf.gradients(loss, [w])
    reduced = hvd.allreduce(gradient, op=hvd.Sum, name="reduced")
    grouped = hvd.grouped_allreduce([gradient * 2.0, gradient * 3.0], op=hvd.Sum)
    train = tf.group(tf.compat.v1.assign_sub(w, reduced), *grouped, name="train")
open(sys.argv[1], "wb").write(graph.as_graph_def().SerializeToString())
"""

#: Built together with the other modules' graphs (conftest's horovod_graphs fixture).
HOROVOD_GRAPHS = {"emulation_horovod_step": _HOROVOD_STEP}


def test_horovod_collectives_stay_real(horovod_graphs):
    """Horovod's ops are not stateful to TensorFlow, and they are what is measured: never
    emulated, while the matmul and its gradients next to them are, with waits between."""
    graph_def = horovod_graphs["emulation_horovod_step"]
    new, report = tfoverlap.optimize(graph_def, fetch=["train"], schedule="none",
                                     emulate="v100")
    collectives = [n for n in graph_def.node if n.op.startswith("Horovod")]
    assert len(collectives) >= 2
    after = {n.name: n for n in new.node}
    for node in collectives:
        assert after[node.name].op == node.op, node.name
        assert all(text.split(":")[0].startswith("tfoverlap/stream_wait/")
                   or after[text.lstrip("^").split(":")[0]].op != EMULATED_OP
                   for text in after[node.name].input), after[node.name].input
    assert report.passes[0].summary["emulated_op_types"].get("MatMul", 0) >= 1
