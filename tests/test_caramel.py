"""The Caramel pass and the Horovod drop-ins: the rewrite's shape, its options and the
profiled warm-up (real Horovod jobs: tests/test_caramel_training.py)."""
import json
import os
import sys

import pytest

import tfoverlap
from tfoverlap.passes.caramel import ORDER_ATTR
from tfoverlap.planning.caramel import gradient_gates
from tfoverlap.graph.model import GraphModel
from tfoverlap.graph.verify import verify_graph_def
from tests.helpers import run_python


_BRANCHES = """
import sys
import horovod.tensorflow as hvd
import tensorflow as tf
hvd.init()
graph = tf.Graph()
with graph.as_default():
    weights = [tf.compat.v1.get_variable(f"w{i}", [256, 256], use_resource=True)
               for i in range(6)] + [tf.compat.v1.get_variable("big", [256, 2048],
                                                               use_resource=True)]
    hidden = tf.ones([64, 256])
    for weight in weights[:6]:
        hidden = tf.nn.relu(tf.matmul(hidden, weight))
    loss = tf.reduce_sum(tf.matmul(hidden, weights[6]))
    gradients = tf.gradients(loss, weights)
    train = tf.group(*[w.assign_sub(0.01 * hvd.allreduce(g, op=hvd.Average))
                       for w, g in zip(weights, gradients)], name="train")
with open(sys.argv[1], "wb") as stream:
    stream.write(graph.as_graph_def().SerializeToString())
"""


@pytest.fixture(scope="module")
def horovod_graph(horovod_graphs):
    return horovod_graphs["caramel_branches"]


def _rewrite(graph_def, **options):
    options = {"allreduce": "caramel", "schedule": "none", "ranks": 4, "bandwidth": "100Mbit",
               "flops": 1e9, "strict": True, "force": True, **options}
    return tfoverlap.optimize(graph_def, fetch=["train"], **options)


def test_every_gradient_lands_in_one_bucket_and_updates_wait_only_for_their_own(
        horovod_graph):
    rewritten, report = _rewrite(horovod_graph)
    summary = report.passes[0].summary
    assert report.modified and summary["allreduces"] == 7 and summary["buckets"] >= 2
    verify_graph_def(rewritten, ["train"])
    ops = [node.op for node in rewritten.node]
    grouped = [n for n in rewritten.node if n.op == "HorovodGroupedAllreduce"]
    assert sum(n.attr["num_tensors"].i for n in grouped) == 7
    assert ops.count("HorovodAllreduce") == 2            # only the plan check's two
    from tfoverlap.rewriters.allreduce_grouping import is_plan_check
    assert all(is_plan_check(n.name) for n in rewritten.node if n.op == "HorovodAllreduce")
    assert not any(is_plan_check(n.name) for n in grouped)
    model = GraphModel.from_graph_def(rewritten)
    for node in rewritten.node:
        if node.op == "AssignSubVariableOp":
            # Walk back from the update: it reaches exactly one bucket.
            seen, stack, buckets = set(), [model.index[node.name]], set()
            while stack:
                current = stack.pop()
                for producer, _ in model.data_inputs[current]:
                    if producer not in seen:
                        seen.add(producer)
                        if model.ops[producer] == "HorovodGroupedAllreduce":
                            buckets.add(producer)
                        else:
                            stack.append(producer)
            assert len(buckets) == 1, node.name
    # Every bucket waits for the rank agreement check.
    assert all(any(t.endswith("plan_check/assert") for t in n.input) for n in grouped)


def test_backward_order_edges_chain_the_gradient_producers(horovod_graph):
    rewritten, report = _rewrite(horovod_graph, bucket_chain="finished")
    summary = report.passes[0].summary
    order = summary["gradient_order"]
    assert len(order) == 7 and summary["order_edges"] == (
        6 + len(summary["weight_first"]) + summary["requests"] - 1)
    nodes = {n.name: n for n in rewritten.node}
    for before, after in zip(order, order[1:]):
        assert "^" + before in nodes[after].input
        assert [s.decode() for s in nodes[after].attr[ORDER_ATTR].list.s] == [before]
    for number in range(1, summary["requests"]):
        assert f"^tfoverlap/caramel/bucket_{number - 1}" in nodes[
            f"tfoverlap/caramel/bucket_{number}"].input


def test_weight_gradients_go_first_where_the_ring_waits_for_them(horovod_graph):
    """Per layer, from the plan: the weight gradients of the buckets the ring waits for
    run before the other consumers of their inputs (the layer's input gradient), and
    only those; the graph stays acyclic. Where compute is the bottleneck, nothing."""
    import tensorflow as tf
    from tfoverlap.planning.caramel import plan_allreduce
    rewritten, report = _rewrite(horovod_graph, threads=1)
    summary = report.passes[0].summary
    pairs = summary["weight_first"]
    assert pairs, summary
    nodes = {n.name: n for n in rewritten.node}
    for producer, sibling in pairs:
        assert "^" + producer in nodes[sibling].input
        assert nodes[sibling].op not in ("Identity", "IdentityN")    # Grappler drops them
        assert {t.split(":")[0] for t in nodes[producer].input} & {
            t.split(":")[0] for t in nodes[sibling].input if not t.startswith("^")}
    verify_graph_def(rewritten, ["train"])
    # The producers ordered first are exactly those of the buckets the ring waited for.
    plan = plan_allreduce(horovod_graph, "caramel", 4, 100e6 / 8, 50e-6,
                          {n.name: 1e-3 for n in horovod_graph.node}, threads=1)
    first = {plan.model.names[p] for p, _ in plan.weight_first}
    waited = [b for b in plan.buckets if b.start <= b.ready + 1e-12]
    assert waited and first
    producers = {plan.model.names[p] for p in plan.producers}
    assert first <= producers and len(first) < len(producers)
    with tf.Graph().as_default():
        tf.graph_util.import_graph_def(rewritten, name="")       # TensorFlow accepts it
    _, compute_bound = _rewrite(horovod_graph, bandwidth="100Gbit", threads=1)
    assert compute_bound.passes[0].summary["weight_first"] == []


def test_the_predicted_step_lets_horovod_fuse_buckets_queued_behind_a_busy_ring(
        horovod_graph):
    """Buckets handed to Horovod while the ring is busy go out as one request at its next
    cycle (measured: 29 planned buckets reached the ring as 4 requests), so the
    simulation charges them one request; buckets that wait for the one before to be
    reduced pay one each."""
    from tfoverlap.planning.caramel import bucket_problem, plan_allreduce
    from tfoverlap.sim.engine import COLLECTIVE, simulate
    op_seconds = {n.name: 1e-4 for n in horovod_graph.node}
    plan = plan_allreduce(horovod_graph, "caramel", 4, 10e6, 1e-4, op_seconds, threads=1,
                          chunk_bytes=2 ** 20)
    queued = [b for b in plan.buckets[1:] if b.start > b.ready]
    assert len(plan.buckets) >= 3 and queued
    # Requests that cost 2 ms of latency each: one request fewer is worth more than the
    # overlap of one bucket's updates with the next bucket's ring.
    fused = bucket_problem(plan, op_seconds, 4, 10e6, 2e-3, 1)
    separate = bucket_problem(plan, op_seconds, 4, 10e6, 2e-3, 1, fuse_queued=False)
    requests = int((fused.kind == COLLECTIVE).sum())
    assert int((separate.kind == COLLECTIVE).sum()) == len(plan.buckets) > requests
    assert simulate(fused).makespan < simulate(separate).makespan
    saved = (len(plan.buckets) - requests) * 2 * 3 * 2e-3      # 2 (n - 1) latencies each
    assert sum(separate.work[separate.kind == COLLECTIVE]) - sum(
        fused.work[fused.kind == COLLECTIVE]) == pytest.approx(saved)


def test_each_bucket_is_issued_once_the_inputs_of_the_one_before_exist(horovod_graph):
    rewritten, report = _rewrite(horovod_graph)
    summary = report.passes[0].summary
    assert summary["bucket_chain"] == "issued" and summary["requests"] >= 2
    nodes = {n.name: n for n in rewritten.node}
    for number in range(1, summary["requests"]):
        before = nodes[f"tfoverlap/caramel/bucket_{number - 1}"]
        after = nodes[f"tfoverlap/caramel/bucket_{number}"]
        inputs = {t.split(":")[0] for t in before.input if not t.startswith("^")}
        chained = {s.decode() for s in after.attr[ORDER_ATTR].list.s}
        assert chained == inputs and before.name not in chained
        assert all("^" + name in after.input for name in inputs)
    verify_graph_def(rewritten, ["train"])


def test_caramel_steps_aside_where_it_predicts_no_gain(horovod_graph, caplog):
    import logging
    caplog.set_level(logging.INFO, logger="tfoverlap")
    rewritten, report = _rewrite(horovod_graph, bandwidth="100Gbit", force=False)
    summary = report.passes[0].summary
    # Horovod's fusion stays; only the weight gradients are gated (tf.gradients does not).
    assert summary["predicted_gain"] < 0.03 and "own fusion is left" in summary["declined"]
    assert summary["gated_gradients"] == len(gradient_gates(horovod_graph)) > 0
    assert [n.op for n in rewritten.node] == [n.op for n in horovod_graph.node]
    assert _added_control_inputs(horovod_graph, rewritten) == {
        (before, after) for before, after in gradient_gates(horovod_graph)}
    assert summary["predicted_horovod_step_s"] > 0
    assert sum("below min_gain" in r.getMessage() for r in caplog.records) == 1
    # Where each message costs a millisecond and Horovod waits 5 ms cycles, planned
    # buckets pay fewer of both: the same graph is planned without force.
    _, acting = _rewrite(horovod_graph, force=False, bandwidth="1Gbit", latency=1e-3,
                         cycle_ms=5, flops=1e10, threads=2)
    assert acting.modified and acting.passes[0].summary["predicted_gain"] >= 0.03


def _added_control_inputs(before, after) -> set:
    old = {n.name: set(n.input) for n in before.node}
    return {(text[1:], node.name) for node in after.node for text in node.input
            if text.startswith("^") and text not in old.get(node.name, ())}


_TAPE_STEP = """
import sys
import horovod.tensorflow as hvd
import tensorflow as tf
hvd.init()
LOOP = sys.argv[1].endswith("loop.pb")   # caramel_tape_loop.pb
weights = []

def make_weights():
    weights.extend([tf.Variable(tf.random.stateless_normal([3, 3, 8, 8], seed=[i, 0]),
                                name=f"k{i}") for i in range(4)]
                   + [tf.Variable(tf.zeros([8 * 16 * 16, 10]), name="dense")])

def step(images):
    with tf.GradientTape() as tape:
        hidden = images
        for kernel in weights[:4]:
            hidden = tf.nn.relu(tf.nn.conv2d(hidden, kernel, 1, "SAME"))
        loss = tf.reduce_sum(tf.matmul(tf.reshape(hidden, [4, -1]), weights[4]))
    for weight, gradient in zip(weights, tape.gradient(loss, weights)):
        weight.assign_sub(0.01 * hvd.allreduce(gradient, op=hvd.Average))
    return loss

if LOOP:   # a while loop of steps with its frames, as Keras' steps_per_execution runs
    tf.compat.v1.disable_control_flow_v2()
    graph = tf.Graph()
    with graph.as_default():
        make_weights()
        images = tf.ones([4, 16, 16, 8])
        count = tf.compat.v1.while_loop(lambda i: i < 3, lambda i: [
            tf.identity(i + 1 + tf.cast(step(images) * 0, tf.int32))], [tf.constant(0)])
        tf.identity(count, name="train")
    graph_def = graph.as_graph_def()
else:
    make_weights()
    function = tf.function(lambda images: tf.identity(step(images), name="train"))
    graph_def = function.get_concrete_function(
        tf.TensorSpec([4, 16, 16, 8])).graph.as_graph_def()
with open(sys.argv[1], "wb") as stream:
    stream.write(graph_def.SerializeToString())
"""


@pytest.mark.parametrize("loop", [False, True], ids=["tf_function", "while_loop"])
def test_a_tapes_weight_gradients_are_gated_before_the_input_gradients(horovod_graphs, loop):
    """A GradientTape leaves each layer's weight gradient free to run after the rest of
    the backward pass (TF1's optimizers gate them); the pass gates them, in a
    tf.function and inside a while loop's frame (Keras' steps_per_execution), even where
    it leaves Horovod's fusion alone, and the graph stays valid and acyclic."""
    graph_def = horovod_graphs["caramel_tape_loop" if loop else "caramel_tape"]
    gates = gradient_gates(graph_def)
    nodes = {n.name: n for n in graph_def.node}
    model = GraphModel.from_graph_def(graph_def)
    producers = {before for before, _ in gates}
    assert len(producers) == 5                       # four kernels and the dense layer
    for before, after in gates:
        assert nodes[before].op in ("Conv2DBackpropFilter", "MatMul")
        assert nodes[after].op in ("Conv2DBackpropInput", "MatMul")
        shared = ({t.split(":")[0] for t in nodes[before].input}
                  & {t.split(":")[0] for t in nodes[after].input})
        assert shared, (before, after)               # the same upstream gradient
        if loop:
            assert model.frame[model.index[before]] == model.frame[model.index[after]] != ()
    rewritten, report = _rewrite(graph_def, force=False, bandwidth="100Gbit")
    summary = report.passes[0].summary
    assert report.modified and summary["gated_gradients"] == len(gates)
    assert _added_control_inputs(graph_def, rewritten) == set(gates)
    verify_graph_def(rewritten, ["train"])           # acyclic, frames and deadness kept
    assert gradient_gates(rewritten) == []           # a second run adds nothing
    again, second = _rewrite(rewritten, force=False, bandwidth="100Gbit")
    assert not second.modified


_GATED_BY_TF1 = """
import sys
import horovod.tensorflow as hvd
import tensorflow as tf
hvd.init()
graph = tf.Graph()
with graph.as_default():
    weights = [tf.compat.v1.get_variable(f"w{i}", [64, 64], use_resource=True) for i in range(4)]
    hidden = tf.ones([8, 64])
    for weight in weights:
        hidden = tf.nn.relu(tf.matmul(hidden, weight))
    optimizer = tf.compat.v1.train.GradientDescentOptimizer(0.1)   # gate_gradients=GATE_OP
    pairs = optimizer.compute_gradients(tf.reduce_sum(hidden), weights)
    optimizer.apply_gradients([(hvd.allreduce(g, op=hvd.Average), w) for g, w in pairs],
                              name="train")
with open(sys.argv[1], "wb") as stream:
    stream.write(graph.as_graph_def().SerializeToString())
"""

#: Built together with the other modules' graphs (conftest's horovod_graphs fixture).
HOROVOD_GRAPHS = {"caramel_branches": _BRANCHES, "caramel_tape": _TAPE_STEP,
                  "caramel_tape_loop": _TAPE_STEP, "caramel_gated_by_tf1": _GATED_BY_TF1}


def test_gradients_that_tf1_already_gates_get_no_edge(horovod_graphs):
    graph_def = horovod_graphs["caramel_gated_by_tf1"]
    assert any(n.op == "HorovodAllreduce" for n in graph_def.node)
    assert gradient_gates(graph_def) == []


def test_the_backward_pass_is_left_alone_when_compute_is_the_bottleneck(horovod_graph):
    rewritten, report = _rewrite(horovod_graph, bandwidth="100Gbit", bucket_chain="finished")
    summary = report.passes[0].summary
    assert not summary["order_backward"] and summary["gradient_order"] == []
    # Only the bucket chain, and each layer's weight gradient gated as TF1 would.
    gates = gradient_gates(horovod_graph)
    assert summary["gated_gradients"] == len(gates) > 0
    assert summary["order_edges"] == summary["requests"] - 1 + len(gates)
    gated = {after for _, after in gates}
    assert not any(ORDER_ATTR in n.attr for n in rewritten.node
                   if n.op != "HorovodGroupedAllreduce" and n.name not in gated)


def test_the_rewrite_is_idempotent_and_survives_tictac(horovod_graph):
    rewritten, first = _rewrite(horovod_graph)
    again, report = _rewrite(rewritten, schedule="tic")
    assert not report.modified and again is rewritten
    edges = sum(len(n.attr[ORDER_ATTR].list.s) for n in rewritten.node if ORDER_ATTR in n.attr)
    assert edges == first.passes[0].summary["order_edges"] >= 6


def test_plans_depend_on_the_network(horovod_graph):
    """Per-message latency far above everything else: one bucket; no latency and a link
    about as slow as the compute: several, so that reduction overlaps the backward pass."""
    costly_messages = _rewrite(horovod_graph, latency=1.0)[1].passes[0].summary
    overlapping = _rewrite(horovod_graph, latency=0.0, bandwidth="1Gbit")[1].passes[0].summary
    assert costly_messages["buckets"] == 1
    assert overlapping["buckets"] >= 3
    assert costly_messages["plan_digest"] != overlapping["plan_digest"]


def test_plans_are_functions_of_the_options_not_of_the_host(horovod_graph, monkeypatch):
    """Two hosts with other CPU counts and HOROVOD_CYCLE_TIME plan alike once the options
    carry rank 0's facts (as the wrappers set them); the facts show in the summary."""
    plans = []
    for cpus, cycle in ((2, "1"), (96, "5")):
        monkeypatch.setattr(os, "cpu_count", lambda cpus=cpus: cpus)
        monkeypatch.setenv("HOROVOD_CYCLE_TIME", cycle)
        plans.append(_rewrite(horovod_graph, threads=4, cycle_ms=2)[1].passes[0].summary)
    assert plans[0]["plan_digest"] == plans[1]["plan_digest"]
    assert plans[0]["threads"] == 4
    # Left to each host, the cycle enters the plan: a slow cycle merges buckets.
    monkeypatch.setenv("HOROVOD_CYCLE_TIME", "500")
    slow = _rewrite(horovod_graph, threads=4, latency=0.0, bandwidth="1Gbit")[1]
    monkeypatch.setenv("HOROVOD_CYCLE_TIME", "0.01")
    fast = _rewrite(horovod_graph, threads=4, latency=0.0, bandwidth="1Gbit")[1]
    assert slow.passes[0].summary["buckets"] < fast.passes[0].summary["buckets"]


def test_an_unknown_rank_count_is_a_warning(horovod_graph, monkeypatch, caplog):
    import logging
    for variable in ("HOROVOD_SIZE", "OMPI_COMM_WORLD_SIZE", "PMI_SIZE"):
        monkeypatch.delenv(variable, raising=False)
    monkeypatch.delitem(sys.modules, "horovod.tensorflow", raising=False)
    monkeypatch.setattr("tfoverlap.log._said", set())      # said before by another test
    caplog.set_level(logging.WARNING, logger="tfoverlap")
    from tfoverlap.planning.caramel import resolve_ranks
    assert resolve_ranks(0) == 1
    assert any("cannot tell how many Horovod ranks" in r.getMessage() for r in caplog.records)


@pytest.mark.parametrize("options, message", [
    ({"allreduce": "fastest"}, "option 'allreduce'"),
    ({"latency": -1}, "option 'latency'"),
    ({"split_bytes": 0}, "option 'split_bytes'"),
    ({"ranks": -2}, "option 'ranks'"),
    ({"flops": "many"}, "option 'flops'"),
])
def test_bad_caramel_options_are_named(horovod_graph, options, message):
    with pytest.raises(ValueError, match=message):
        _rewrite(horovod_graph, **options)


def test_split_gradients_are_reassembled_exactly(horovod_graphs):
    """A gradient cut in three pieces over two buckets reduces to the same values
    (one rank: the reduction is the identity, so the result must equal the input)."""
    path = horovod_graphs.paths["caramel_branches"]
    result = run_python(f"""
import numpy as np, tensorflow as tf
import horovod.tensorflow as hvd
from tfoverlap.rewriters.allreduce_grouping import BucketPieces, group_allreduces
hvd.init()
graph_def = tf.compat.v1.GraphDef()
graph_def.ParseFromString(open({str(path)!r}, "rb").read())
names = [n.name for n in graph_def.node if n.op == "HorovodAllreduce"]
big = next(n for n in names if "MatMul_6" in n)
others = [n for n in names if n != big]
buckets = [BucketPieces(tuple((n, 0) for n in others[:3]) + ((big, 0), (big, 1))),
           BucketPieces(((big, 2),) + tuple((n, 0) for n in others[3:]))]
rewritten = group_allreduces(graph_def, buckets, {{big: [100_000, 200_000, 224_288]}})
gradient = next(n.input[0] for n in graph_def.node if n.name == big)
gradient = gradient if ":" in gradient else gradient + ":0"
restored = next(n.name for n in rewritten.node if n.name.endswith("/restored"))
graph = tf.Graph()
with graph.as_default():
    tf.graph_util.import_graph_def(rewritten, name="")
with tf.compat.v1.Session(graph=graph) as session:
    session.run([op.name for op in graph.get_operations() if op.type == "AssignVariableOp"])
    raw, reduced = session.run([gradient, restored + ":0"])
print("EQUAL" if raw.shape == reduced.shape == (256, 2048) and np.array_equal(raw, reduced)
      else "DIFF")
""")
    assert result.returncode == 0, result.stderr[-3000:]
    assert "EQUAL" in result.stdout


def test_the_warm_up_times_the_gradients_in_a_copy_and_names_what_it_cannot_feed():
    import tensorflow as tf
    from tfoverlap.integrations.warmup_profile import WarmupError, profile_gradients
    graph = tf.Graph()
    with graph.as_default():
        weight = tf.compat.v1.get_variable("w", [64, 64], use_resource=True)
        static = tf.compat.v1.placeholder(tf.float32, [32, 64], name="static")
        loss = tf.reduce_sum(tf.matmul(tf.nn.relu(tf.matmul(static, weight)), weight))
        gradient, = tf.gradients(loss, [weight])
        dynamic = tf.compat.v1.placeholder(tf.float32, [None, 64], name="dynamic")
        other, = tf.gradients(tf.reduce_sum(tf.matmul(dynamic, weight)), [weight])
    ops_before = len(graph.get_operations())
    measured = profile_gradients(graph, [gradient], steps=2)
    assert len(graph.get_operations()) == ops_before       # the user's graph: untouched
    assert measured.steps == 2
    timed = {name for name in measured.op_seconds if name.startswith("gradients/")}
    assert any("MatMul" in name for name in timed), sorted(measured.op_seconds)
    assert all(value >= 0 for value in measured.op_seconds.values())
    with pytest.raises(WarmupError, match="dynamic"):
        profile_gradients(graph, [other], steps=1)


_WARMUP_JOB = """
import json, os, sys
import horovod.tensorflow as hvd
import tensorflow as tf
import tfoverlap.horovod as tfo_hvd
from tfoverlap.costs.profile import load_profile
tf.compat.v1.disable_eager_execution()
hvd.init()
for shape in sys.argv[1:]:
    print("--- " + shape, file=sys.stderr, flush=True)
    graph = tf.Graph()
    with graph.as_default():
        weight = tf.compat.v1.get_variable("w", [32, 32], use_resource=True)
        batch = None if shape == "dynamic" else 8
        inputs = tf.compat.v1.placeholder(tf.float32, [batch, 32], name="inputs")
        gradient, = tf.gradients(tf.reduce_sum(tf.matmul(inputs, weight)), [weight])
    path = tfo_hvd.warmup_profile(graph, [gradient], 2, {})
    result = {"shape": shape, "path": path}
    if path:
        result["ops"] = len(load_profile(path).op_seconds)
        os.remove(path)
    print(json.dumps(result), flush=True)
"""


def test_a_warm_up_that_cannot_run_leaves_the_static_estimates_with_a_warning(tmp_path):
    """Rank 0's warm-up is shared through Horovod; where it cannot run (a placeholder of
    unknown batch size), the wrapper says why in one warning and plans without it. (One
    process: a graph with a static batch first, which profiles without a word, then one
    without.)"""
    import subprocess
    script = tmp_path / "warmup.py"
    script.write_text(_WARMUP_JOB)
    env = {**os.environ, "HOROVOD_CONTROLLER": "gloo", "HOROVOD_CPU_OPERATIONS": "gloo"}
    result = subprocess.run([sys.executable, str(script), "static", "dynamic"], env=env,
                            capture_output=True, text=True, timeout=240)
    assert result.returncode == 0, result.stderr[-3000:]
    static, dynamic = (json.loads(line) for line in result.stdout.strip().splitlines()
                       if line.startswith("{"))
    assert static["shape"] == "static" and static["path"] and static["ops"] > 0
    assert dynamic["shape"] == "dynamic" and dynamic["path"] == ""
    quiet, said = result.stderr.split("--- dynamic")
    for message in ("has no static shape", "Caramel plans with static estimates"):
        assert message not in quiet, quiet[-3000:]
    assert "placeholder 'inputs' has no static shape" in said
    assert said.count("Caramel plans with static estimates") == 1, said[-3000:]


@pytest.mark.parametrize("options, message", [
    ({"profile_steps": -1}, "profile_steps must be an integer from 0 to 100"),
    ({"profile_steps": 2.5}, "profile_steps must be an integer"),
    ({"profile_steps": 2, "profile": "p.json"}, "not both"),
])
def test_bad_warm_up_options_are_named(options, message):
    import tfoverlap.horovod as tfo_hvd
    with pytest.raises(ValueError, match=message):
        tfo_hvd.configure(**options)


def test_a_rewrite_applies_in_place_with_new_nodes_waiting_on_existing_ops():
    """What the graph-mode wrapper does with Caramel's output: a new node with a data input
    and a control input on ops that exist already (a bucket issued after the inputs of the
    one before)."""
    import tensorflow as tf
    from tfoverlap.integrations.live_graph import apply_rewrite
    graph = tf.Graph()
    with graph.as_default():
        first = tf.constant(1.0, name="first")
        second = tf.add(first, 1.0, name="second")
        tf.identity(second, name="out")
    before = graph.as_graph_def()
    after = tf.compat.v1.GraphDef()
    after.CopyFrom(before)
    bucket = after.node.add(name="bucket", op="Identity", input=["second", "^first"])
    bucket.attr["T"].type = tf.float32.as_datatype_enum
    out = next(n for n in after.node if n.name == "out")
    out.input[:] = ["bucket"]
    assert apply_rewrite(graph, before, after) == 1
    assert [op.name for op in graph.get_operation_by_name("bucket").control_inputs] == ["first"]
    assert graph.get_operation_by_name("out").inputs[0].op.name == "bucket"
    with tf.compat.v1.Session(graph=graph) as session:
        assert session.run("out:0") == 2.0
