"""The TicTac pass on real GraphDefs, offline: structure, invariants, idempotency, bad input."""
import json
import logging

import pytest
from hypothesis import given, settings, strategies as st
import tensorflow as tf

import tfoverlap
from tfoverlap.graph.model import GraphModel
from tfoverlap.graph.verify import verify_graph_def
from tfoverlap.rewriters.control_edges import ARRIVAL_ATTR, GATES_ATTR
from tfoverlap.testbed.models import chain_model

from helpers import SERIAL




def chain_graph_def(num_layers=16, **kwargs):
    return chain_model(num_layers=num_layers, width=32, batch=4, **kwargs).graph.as_graph_def()


def layer_of(name, graph_def):
    """Which layer's kernel a transfer source reads (follows the read to the variable)."""
    model = GraphModel.from_graph_def(graph_def)
    node = model.index[name]
    while "kernel" not in model.names[node] or model.ops[node] not in (
            "VarHandleOp", "VariableV2"):
        node = model.data_inputs[node][0][0]
    return int(model.names[node].split("/")[0].removeprefix("layer"))


@pytest.mark.parametrize("use_resource", [True, False], ids=["resource", "ref"])
@pytest.mark.parametrize("schedule", ["tic", "tac"])
def test_chain_is_ordered_front_to_back(use_resource, schedule):
    graph_def = chain_graph_def(use_resource=use_resource)
    new, report = tfoverlap.optimize(graph_def, schedule=schedule, **SERIAL)
    (summary,) = [p.summary for p in report.passes]
    (order,) = summary["order"].values()
    assert [layer_of(name, graph_def) for name in order] == list(range(16))
    assert summary["ordering_edges"] == 15
    verify_graph_def(new)


@pytest.mark.parametrize("num_ps", [1, 2])
@pytest.mark.parametrize("window", [1, 3])
def test_rewrite_keeps_every_dependency_and_adds_only_marked_edges(num_ps, window):
    graph_def = chain_graph_def(num_ps=num_ps, training=True)
    original = graph_def.SerializeToString()
    new, report = tfoverlap.optimize(graph_def, schedule="tic", window=window, credit=0,
                                     force=True)
    assert graph_def.SerializeToString() == original, "the input was modified"
    assert report.modified
    old_nodes = {n.name: n for n in graph_def.node}
    added = 0
    for node in new.node:
        if node.name not in old_nodes:
            # New nodes are only arrival gates: a marked Identity on the worker.
            assert node.op == "Identity" and node.attr[ARRIVAL_ATTR].b
            assert node.device.startswith("/job:worker")
            continue
        before = list(old_nodes[node.name].input)
        assert list(node.input[:len(before)]) == before
        extra = list(node.input[len(before):])
        marked = ["^" + s.decode() for s in node.attr[GATES_ATTR].list.s] if extra else []
        assert extra == marked
        added += len(extra)
    # Each PS task's link has its own window: its first `window` transfers go ungated.
    assert added == report.passes[0].summary["ordering_edges"] == 16 - window * num_ps
    verify_graph_def(new)


def test_each_ps_link_has_its_own_window_over_the_order():
    """Two PS tasks, one transfer per group, window 1: each link's transfers are chained in
    the order's sequence, and no gate waits for a transfer from the other PS task (one
    window over both would idle a link while the other's transfer is in flight)."""
    from tfoverlap.options import parse_options
    from tfoverlap.planning.tictac import plan_transfer_order
    graph_def = chain_graph_def(num_ps=2)
    plan = plan_transfer_order(graph_def, parse_options(
        dict(schedule="tic", credit=0, window=1, force=True)))
    ((destination, order),) = plan.orders.items()
    model = plan.model
    devices = model.colocated_devices()
    task = {t: devices[plan.transfers[t].source] for t in order}
    name = {t: model.names[plan.transfers[t].source] for t in order}
    arrivals = {a.name: a for a in plan.arrivals}
    released = {source: gate for gate, source in plan.edges}
    for ps_task in sorted(set(task.values())):
        on_link = [t for t in order if task[t] == ps_task]
        assert len(on_link) == 8
        assert name[on_link[0]] not in released
        for before, after in zip(on_link, on_link[1:]):
            assert arrivals[released[name[after]]].tensors == (name[before],)
    assert len(plan.edges) == 14
    assert len(plan.groups[destination]) == 16
    assert [t for group in plan.groups[destination] for t in group] == order


def test_second_run_changes_nothing():
    graph_def = chain_graph_def(training=True)
    once, first = tfoverlap.optimize(graph_def, schedule="tic", credit="10KB", force=True)
    assert first.modified
    twice, report = tfoverlap.optimize(once, schedule="tic", credit="10KB", force=True)
    assert not report.modified
    assert twice.SerializeToString() == once.SerializeToString()


def test_replanning_replaces_earlier_edges():
    graph_def = chain_graph_def()
    ordered, _ = tfoverlap.optimize(graph_def, schedule="tic", credit="10KB", force=True)
    reordered, _ = tfoverlap.optimize(ordered, schedule="tic", **SERIAL)
    direct, _ = tfoverlap.optimize(graph_def, schedule="tic", **SERIAL)
    assert reordered.SerializeToString(deterministic=True) == direct.SerializeToString(
        deterministic=True)


@pytest.mark.parametrize("options, lines", [
    ({}, 1),
    ({"schedule": "tic", "allreduce": "caramel"}, 1),
    # Caramel alone: a Horovod job, where TicTac runs only as the default schedule.
    ({"allreduce": "caramel"}, 0),
])
def test_graphs_without_transfers_are_unchanged_with_one_info_line_per_process(
        options, lines, caplog, monkeypatch):
    graph = tf.Graph()
    with graph.as_default():
        tf.reduce_sum(tf.ones([2, 2]))
    graph_def = graph.as_graph_def()
    monkeypatch.setattr("tfoverlap.log._said", set())      # said before by another test
    caplog.set_level(logging.INFO, logger="tfoverlap")
    for _ in range(2):                                     # Grappler sees graphs often
        new, report = tfoverlap.optimize(graph_def, **options)
        assert new is graph_def and not report.modified
        assert report.passes[0].name == "tictac"
        assert report.passes[0].summary["transfers"] == 0
    assert sum("no transfer from a parameter-server device" in r.getMessage()
               for r in caplog.records) == lines


def test_a_message_said_once_is_said_again_once_forgotten(caplog, monkeypatch):
    """What a harness that runs programs in turn in one process (tests/jobs/in_sequence.py)
    does between them: each program gets its own warnings."""
    from tfoverlap import log
    monkeypatch.setattr(log, "_said", set())
    caplog.set_level(logging.WARNING, logger="tfoverlap")
    for _ in range(2):
        log.warn_once("a warning of the first program")
    log.forget_said()
    log.warn_once("a warning of the first program")
    said = [record.getMessage() for record in caplog.records]
    assert said == ["a warning of the first program"] * 2


def test_gates_never_wait_for_later_transfers_in_shared_consumers():
    """An op that needs two transfers cannot gate the second of them (a cycle)."""
    graph = tf.Graph()
    with graph.as_default():
        with tf.device("/job:ps/task:0"):
            a, b, c = (tf.compat.v1.get_variable(name, [8, 8], use_resource=False)
                       for name in "abc")
        with tf.device("/job:worker/task:0"):
            first = tf.matmul(tf.ones([2, 8]), a, name="first")
            tf.reduce_sum(tf.matmul(first, tf.matmul(b, c, name="b_times_c")))
    new, report = tfoverlap.optimize(graph.as_graph_def(), schedule="tic", gate="consumer",
                                     **SERIAL)
    verify_graph_def(new)
    (order,) = report.passes[0].summary["order"].values()
    # TIC: b and c unblock an op with two transfers (M+ 2), a only with three.
    assert set(order[:2]) == {"b/read", "c/read"} and order[2] == "a/read"
    # The first of b, c has no valid consumer gate (its consumer needs the second): its
    # arrival gates the second; b_times_c gates a.
    gates = {n.name: [g.decode() for g in n.attr[GATES_ATTR].list.s] for n in new.node
             if GATES_ATTR in n.attr}
    assert gates == {order[1]: [f"tfoverlap/arrived/0/{order[0]}"], "a/read": ["b_times_c"]}


def write_profile(path, op_seconds, transfer_seconds):
    path.write_text(json.dumps({"format": "tfoverlap-profile", "version": 1, "steps": 1,
                                "op_seconds": op_seconds, "transfer_seconds": transfer_seconds,
                                "transfer_bytes": {}}))


def test_profile_of_another_graph_warns_and_changes_nothing(tmp_path, caplog):
    path = tmp_path / "other.json"
    write_profile(path, {"conv1": 0.1}, {"resnet/conv1/read": 0.2, "resnet/fc/read": 0.3})
    graph_def = chain_graph_def()
    caplog.set_level(logging.WARNING, logger="tfoverlap")
    new, report = tfoverlap.optimize(graph_def, schedule="tac", profile=str(path))
    assert new is graph_def and not report.modified and report.reverted
    message = " ".join(r.getMessage() for r in caplog.records)
    assert "does not match this graph" in message and "profile this model again" in message


def test_tac_uses_profile_times(tmp_path):
    """Two independent layers: TAC sends first the one that unblocks more compute per byte."""
    graph = tf.Graph()
    with graph.as_default():
        with tf.device("/job:ps/task:0"):
            small = tf.compat.v1.get_variable("small", [4, 4], use_resource=False)
            big = tf.compat.v1.get_variable("big", [4, 4], use_resource=False)
        with tf.device("/job:worker/task:0"):
            left = tf.matmul(tf.ones([2, 4]), small, name="left")
            right = tf.matmul(tf.ones([2, 4]), big, name="right")
            tf.add(tf.reduce_sum(left), tf.reduce_sum(right), name="total")
    graph_def = graph.as_graph_def()
    path = tmp_path / "profile.json"

    def order_with(left_compute, right_compute):
        write_profile(path, {"left": left_compute, "right": right_compute},
                      {"small/read": 1.0, "big/read": 1.0})
        _, report = tfoverlap.optimize(graph_def, schedule="tac", profile=str(path), force=True)
        (order,) = report.passes[0].summary["order"].values()
        return order

    # Equal transfer times: the transfer that unblocks the longer compute goes first.
    assert order_with(5.0, 1.0) == ["small/read", "big/read"]
    assert order_with(1.0, 5.0) == ["big/read", "small/read"]


def random_ps_graph_def(seed, num_variables, num_ops, use_resource):
    """Random worker DAG over PS variables: each op adds some earlier ops and variables."""
    import random
    rng = random.Random(seed)
    graph = tf.Graph()
    with graph.as_default():
        variables = []
        for index in range(num_variables):
            with tf.device(f"/job:ps/task:{index % 2}"):
                variables.append(tf.compat.v1.get_variable(f"v{index}", [4, 4],
                                                           use_resource=use_resource))
        with tf.device("/job:worker/task:0"):
            values = []
            for index in range(num_ops):
                pool = values + variables
                picks = rng.sample(range(len(pool)), min(len(pool), rng.randint(1, 3)))
                values.append(tf.add_n([tf.identity(pool[p]) for p in picks], name=f"op{index}"))
            tf.add_n(values, name="total")
    return graph.as_graph_def()


@settings(max_examples=25, deadline=None)
@given(st.integers(0, 10_000), st.integers(1, 12), st.integers(1, 25), st.booleans(),
       st.sampled_from(["tic", "tac"]), st.integers(1, 3), st.sampled_from(["arrival", "consumer"]),
       st.sampled_from([0, 64, 200, "auto"]))
def test_random_graphs_stay_acyclic_and_keep_every_dependency(seed, num_variables, num_ops,
                                                              use_resource, schedule, window,
                                                              gate, credit):
    graph_def = random_ps_graph_def(seed, num_variables, num_ops, use_resource)
    options = dict(schedule=schedule, window=window, gate=gate, credit=credit, force=True)
    new, report = tfoverlap.optimize(graph_def, strict=True, **options)
    verify_graph_def(new)
    old_nodes = {n.name: n for n in graph_def.node}
    for node in new.node:
        if node.name not in old_nodes:
            assert node.attr[ARRIVAL_ATTR].b
            continue
        before = list(old_nodes[node.name].input)
        assert list(node.input[:len(before)]) == before
        assert all(text.startswith("^") for text in node.input[len(before):])
    again, second = tfoverlap.optimize(new, **options)
    assert not second.modified


@pytest.mark.parametrize("schedule", ["tic", "tac"])
def test_a_source_computed_from_another_source_is_ordered_after_it(schedule):
    """A PS-side chain: ``scaled`` is computed on the PS from ``read``, and the worker's first
    op needs only ``scaled``. Ordering ``scaled`` first would make ``read`` wait for the
    arrival of a tensor computed from it: a cycle."""
    graph = tf.Graph()
    with graph.as_default():
        with tf.device("/job:ps/task:0"):
            kernel = tf.compat.v1.get_variable("kernel", [64, 64])
            read = tf.identity(kernel, name="read")
            scaled = tf.multiply(read, 2.0, name="scaled")
        with tf.device("/job:worker/task:0"):
            hidden = tf.matmul(tf.ones([4, 64]), scaled)
            for _ in range(4):
                hidden = tf.tanh(tf.matmul(hidden, scaled))
            tf.reduce_sum(tf.matmul(hidden, read), name="loss")
    new, report = tfoverlap.optimize(graph.as_graph_def(), schedule=schedule, strict=True,
                                     **SERIAL)
    (order,) = report.passes[0].summary["order"].values()
    assert order == ["read", "scaled"]
    verify_graph_def(new)


def test_release_groups_share_one_gate_that_waits_for_the_whole_group():
    """With a credit of about two kernels, transfers go in pairs: group j+2 leaves the PS
    when every transfer of group j has arrived, through one IdentityN on the worker."""
    from tfoverlap.options import parse_options
    from tfoverlap.planning.tictac import plan_transfer_order
    graph_def = chain_graph_def()
    kernel_bytes = 32 * 32 * 4
    options = dict(schedule="tic", credit=2.5 * kernel_bytes, window=2, force=True)
    plan = plan_transfer_order(graph_def, parse_options(options))
    ((destination, groups),) = plan.groups.items()
    assert [len(g) for g in groups] == [2] * 8
    new, report = tfoverlap.optimize(graph_def, **options)
    verify_graph_def(new)
    summary = report.passes[0].summary
    assert summary["release_groups"] == {destination: [2] * 8}
    assert summary["gates"] == 6 and summary["ordering_edges"] == 12
    nodes = {n.name: n for n in new.node}
    source_name = {t: plan.model.names[plan.transfers[t].source] for g in groups for t in g}
    for j, group in enumerate(groups[2:], start=2):
        for t in group:
            (gate,) = [g.decode() for g in nodes[source_name[t]].attr[GATES_ATTR].list.s]
            assert nodes[gate].op == "IdentityN" and nodes[gate].attr[ARRIVAL_ATTR].b
            assert nodes[gate].device == destination
            assert sorted(nodes[gate].input) == sorted(source_name[u] for u in groups[j - 2])
    for group in groups[:2]:
        assert all(GATES_ATTR not in nodes[source_name[t]].attr for t in group)


def ps_graph_def(kernel_size, num_layers, batch, repeats):
    """Layers of ``kernel_size``^2 float kernels on the PS, each used ``repeats`` times by a
    [batch, kernel_size] activation on the worker: compute grows with batch x repeats."""
    graph = tf.Graph()
    with graph.as_default():
        with tf.device("/job:ps/task:0"):
            kernels = [tf.compat.v1.get_variable(f"kernel{k}", [kernel_size] * 2)
                       for k in range(num_layers)]
        with tf.device("/job:worker/task:0"):
            hidden = tf.ones([batch, kernel_size])
            for kernel in kernels:
                weights = tf.identity(kernel)      # one transfer per kernel
                for _ in range(repeats):
                    hidden = tf.tanh(tf.matmul(hidden, weights))
            tf.reduce_sum(hidden, name="loss")
    return graph.as_graph_def()


def test_pass_declines_where_computation_hides_the_transfers(caplog):
    # 8 x 4 KB of parameters against 8 x 64 matmuls of 4096 x 32 x 32: at 10 GFLOP/s the
    # compute takes ~13 ms, the transfers 26 us at 10 Gbit/s.
    graph_def = ps_graph_def(kernel_size=32, num_layers=8, batch=4096, repeats=64)
    caplog.set_level(logging.INFO, logger="tfoverlap")
    options = dict(schedule="tic", bandwidth="10Gbit", flops=1e10)
    new, report = tfoverlap.optimize(graph_def, **options)
    assert new is graph_def and not report.modified
    summary = report.passes[0].summary
    assert summary["transfers"] == 8 and summary["predicted_gain"] < 0.03
    assert summary["comp_ms"] > 100 * summary["comm_ms"]
    assert "ordering can gain 0.0%" in summary["declined"]
    assert "below min_gain 3.0%" in summary["declined"]
    lines = [r for r in caplog.records if "below min_gain" in r.getMessage()]
    assert len(lines) == 1 and lines[0].levelno == logging.INFO
    # force=True orders anyway; a min_gain of 0 accepts any gain. (The whole 32 KB would
    # be one release group at the automatic credit: a credit of 0 makes one per kernel.)
    for override in (dict(force=True), dict(min_gain=0)):
        forced, report = tfoverlap.optimize(graph_def, **options, credit=0, **override)
        assert report.modified and "declined" not in report.passes[0].summary
        verify_graph_def(forced)


def test_pass_acts_where_transfers_and_computation_are_comparable():
    # 8 x 4 MB of parameters (26 ms at 10 Gbit/s) against 8 matmuls of 16 x 1024 x 1024
    # (27 ms at 10 GFLOP/s): ordering can hide most of one behind the other.
    graph_def = ps_graph_def(kernel_size=1024, num_layers=8, batch=16, repeats=1)
    new, report = tfoverlap.optimize(graph_def, schedule="tic", bandwidth="10Gbit", flops=1e10)
    assert report.modified
    summary = report.passes[0].summary
    assert summary["predicted_gain"] > 0.3 and "declined" not in summary
    assert summary["ordering_edges"] > 0
    verify_graph_def(new)


def test_the_gain_estimate_counts_the_workers_that_share_each_ps_link(monkeypatch):
    """Transfers comparable to the compute for one worker; with 64 workers pulling from the
    same PS task its link carries every tensor 64 times a step, and ordering can gain
    little: the pass steps aside. TF_CONFIG's cluster says the same as the option."""
    import json
    monkeypatch.delenv("TF_CONFIG", raising=False)
    graph_def = ps_graph_def(kernel_size=1024, num_layers=8, batch=16, repeats=1)
    options = dict(schedule="tic", bandwidth="10Gbit", flops=1e10)
    _, alone = tfoverlap.optimize(graph_def, **options)
    _, shared = tfoverlap.optimize(graph_def, workers=64, **options)
    alone, shared = alone.passes[0].summary, shared.passes[0].summary
    assert shared["comm_ms"] == pytest.approx(64 * alone["comm_ms"], rel=1e-4)
    assert alone["predicted_gain"] > 0.3 and "declined" not in alone
    assert shared["predicted_gain"] < 0.03
    assert "64 workers sharing each PS link" in shared["declined"]
    cluster = {"chief": ["c:1"], "worker": [f"w:{k}" for k in range(63)],
               "ps": ["p:1"], "evaluator": ["e:1"]}
    monkeypatch.setenv("TF_CONFIG", json.dumps({"cluster": cluster, "task": {}}))
    _, from_cluster = tfoverlap.optimize(graph_def, **options)
    assert from_cluster.passes[0].summary["comm_ms"] == shared["comm_ms"]
    monkeypatch.setenv("TF_CONFIG", "{not json")       # unreadable: one worker, no error
    _, unreadable = tfoverlap.optimize(graph_def, **options)
    assert unreadable.passes[0].summary["comm_ms"] == alone["comm_ms"]


def test_with_two_ps_tasks_the_busiest_ps_link_bounds_the_transfers(monkeypatch):
    """Half the bytes on each of two PS tasks: two workers keep each PS link as busy as a
    worker's own link, four make the PS links the bound (twice the worker's bytes)."""
    monkeypatch.delenv("TF_CONFIG", raising=False)
    graph_def = chain_model(num_layers=16, width=512, batch=4, num_ps=2).graph.as_graph_def()
    comm = {}
    for workers in (1, 2, 4):
        _, report = tfoverlap.optimize(graph_def, schedule="tic", bandwidth="10Gbit",
                                       flops=1e10, min_gain=0, workers=workers)
        comm[workers] = report.passes[0].summary["comm_ms"]
    assert comm[2] == pytest.approx(comm[1], rel=1e-3)
    assert comm[4] == pytest.approx(2 * comm[1], rel=1e-3)


_PS = "/job:ps/replica:0/task:0/device:CPU:0"
_WORKER = "/job:worker/replica:0/task:0/device:CPU:0"


def _tf2_update_graph(update_op):
    """What Grappler sees of a TF2 ParameterServerStrategy step's update, as Keras' SGD
    with momentum builds it: the variable is a resource argument of the function (shape
    in its handle data), the worker's gradient has no static shape, and on the PS it
    passes Neg and Mul before ``update_op`` writes the variable."""
    from google.protobuf import text_format
    text = f"""
    node {{ name: "kernel" op: "_Arg" device: "{_PS}"
           attr {{ key: "T" value {{ type: DT_RESOURCE }} }}
           attr {{ key: "index" value {{ i: 0 }} }}
           attr {{ key: "_handle_dtypes" value {{ list {{ type: DT_FLOAT }} }} }}
           attr {{ key: "_handle_shapes" value {{ list {{ shape {{ dim {{ size: 256 }}
                                                                  dim {{ size: 64 }} }} }} }} }} }}
    node {{ name: "gradient" op: "Placeholder" device: "{_WORKER}"
           attr {{ key: "dtype" value {{ type: DT_FLOAT }} }} }}
    node {{ name: "negative" op: "Neg" input: "gradient" device: "{_PS}"
           attr {{ key: "T" value {{ type: DT_FLOAT }} }} }}
    node {{ name: "rate" op: "Const" device: "{_PS}"
           attr {{ key: "dtype" value {{ type: DT_FLOAT }} }}
           attr {{ key: "value" value {{ tensor {{ dtype: DT_FLOAT tensor_shape {{ }}
                                                 float_val: 0.1 }} }} }} }}
    node {{ name: "step" op: "Mul" input: "negative" input: "rate" device: "{_PS}"
           attr {{ key: "T" value {{ type: DT_FLOAT }} }} }}
    node {{ name: "update" op: "{update_op}" input: "kernel" input: "step" device: "{_PS}"
           attr {{ key: "dtype" value {{ type: DT_FLOAT }} }} }}
    """
    return text_format.Parse(text, tf.compat.v1.GraphDef())


def test_a_tf2_gradient_pushed_through_element_wise_ops_counts_as_its_variables_size():
    """TicTac's push estimate in a TF2 step: the gradient into ``Neg`` on the PS carries
    as many bytes as the variable that the update two ops later writes. Where nothing
    within reach writes a variable, its size stays unknown."""
    from tfoverlap.graph.model import edge_bytes
    graph_def = _tf2_update_graph("AssignAddVariableOp")
    model = GraphModel.from_graph_def(graph_def)
    gradient, negative = model.index["gradient"], model.index["negative"]
    assert edge_bytes(graph_def, model, gradient, negative) == 256 * 64 * 4
    graph_def = _tf2_update_graph("Identity")
    model = GraphModel.from_graph_def(graph_def)
    assert edge_bytes(graph_def, model, gradient, negative) is None


def test_the_reports_since_a_mark_are_those_logged_after_it_when_old_ones_are_dropped():
    """A mark is a count, not an index: once the log is full, the reports after a mark are
    still the new ones (an index taken before would select none)."""
    from tfoverlap.passes.base import Report, ReportLog
    log = ReportLog(capacity=3)
    reports = [Report(item_id=f"graph{i}", source="test", num_nodes=i) for i in range(5)]
    for report in reports[:2]:
        log.append(report)
    mark = log.count
    for report in reports[2:]:
        log.append(report)
    assert log.snapshot(since=mark) == reports[2:]
    assert log.snapshot() == reports[2:]
    mark = log.count
    log.append(reports[0])
    assert log.snapshot(since=mark) == [reports[0]] and log.snapshot(since=log.count) == []
