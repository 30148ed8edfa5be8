"""The tfoverlap command and the what-if simulation it runs."""
import json
import os
import re
import subprocess
import sys

import pytest
import tensorflow as tf

from tfoverlap import cli
from tfoverlap.costs.profile import Profile, save_profile
from tfoverlap.sim.whatif import Scenario, SimulationError, predict
from tfoverlap.testbed.models import chain_model
from tests.helpers import local_config, traced_run

KERNEL_BYTES = 64 * 64 * 4
LAYERS = 4


@pytest.fixture(scope="module")
def chain():
    model = chain_model(LAYERS, width=64, batch=8, num_ps=1)
    return model.graph.as_graph_def(), model.loss.op.name


@pytest.fixture
def files(tmp_path, chain):
    graph_def, _ = chain
    paths = {"pb": tmp_path / "chain.pb", "pbtxt": tmp_path / "chain.pbtxt",
             "profile": tmp_path / "profile.json"}
    paths["pb"].write_bytes(graph_def.SerializeToString())
    paths["pbtxt"].write_text(str(graph_def))
    reads = ["MatMul/ReadVariableOp"] + [f"MatMul_{k}/ReadVariableOp" for k in range(1, LAYERS)]
    save_profile(Profile(
        op_seconds={("MatMul" if k == 0 else f"MatMul_{k}"): 0.01 for k in range(LAYERS)},
        transfer_seconds={read: 0.02 for read in reads},
        transfer_bytes={read: KERNEL_BYTES for read in reads}, steps=1), str(paths["profile"]))
    return {key: str(value) for key, value in paths.items()}


def run(capsys, *argv):
    code = cli.main([str(a) for a in argv])
    out, err = capsys.readouterr()
    return code, out, err


# ------------------------------------------------------------------ the simulation itself
def test_simulated_chain_matches_the_hand_computed_iteration(chain, files):
    graph_def, loss = chain
    from tfoverlap.costs.profile import load_profile
    # 20 ms per kernel on the link, 10 ms per layer of compute, one worker.
    scenario = Scenario(workers=1, bandwidth=KERNEL_BYTES / 0.02, latency=0.0, threads=2)
    by_name = {p.algorithm: p for p in predict(
        graph_def, scenario, profile=load_profile(files["profile"]),
        profile_path=files["profile"], fetches=[loss])}
    tic = by_name["tic"]
    # Transfers back to back (4 x 20 ms); the last layer computes after the last arrives.
    assert tic.iteration == pytest.approx(4 * 0.02 + 0.01)
    assert tic.comm == pytest.approx(0.08) and tic.comp == pytest.approx(0.04)
    assert tic.efficiency == pytest.approx(0.75)
    assert by_name["default"].iteration >= tic.iteration - 1e-9
    assert by_name["tac"].iteration == pytest.approx(tic.iteration)
    # Twice the workers on one PS: each gets half the PS link.
    doubled = predict(graph_def, Scenario(workers=2, bandwidth=KERNEL_BYTES / 0.02, latency=0.0),
                      ["tic"], profile=load_profile(files["profile"]), fetches=[loss])[0]
    assert doubled.iteration == pytest.approx(8 * 0.02 + 0.01)


def test_simulation_refuses_what_it_cannot_simulate(chain, files, tmp_path):
    graph_def, _ = chain
    local = chain_model(2, width=8, batch=2, ps_devices=["/job:worker/task:0"])
    with pytest.raises(SimulationError, match="no node on a PS device"):
        predict(local.graph.as_graph_def(), Scenario())
    with pytest.raises(SimulationError, match="workers must be >= 1"):
        predict(graph_def, Scenario(workers=0))
    other = tmp_path / "other.json"
    save_profile(Profile(op_seconds={"x": 1.0}, transfer_seconds={"y/read": 1.0}), str(other))
    from tfoverlap.costs.profile import load_profile
    with pytest.raises(SimulationError, match="does not match this graph"):
        predict(graph_def, Scenario(), profile=load_profile(str(other)))


# ------------------------------------------------------------------ subcommands
@pytest.mark.parametrize("kind", ["pb", "pbtxt"])
def test_inspect_lists_parameters_transfers_and_critical_path(capsys, files, kind):
    code, out, _ = run(capsys, "inspect", files[kind], "--profile", files["profile"])
    assert code == 0
    assert f"parameters: {LAYERS} variables, {LAYERS * KERNEL_BYTES / 1e6:.2f} MB" in out
    assert f"to /job:worker/task:0: {LAYERS} transfers" in out
    assert "critical path: 40.0 ms of profiled compute" in out
    assert "horovod ops: none" in out


def test_inspect_reads_metagraphs_and_saved_models(capsys, chain, tmp_path):
    from tensorflow.core.protobuf import meta_graph_pb2, saved_model_pb2
    graph_def, _ = chain
    meta = meta_graph_pb2.MetaGraphDef()
    meta.graph_def.CopyFrom(graph_def)
    (tmp_path / "model.meta").write_bytes(meta.SerializeToString())
    saved = saved_model_pb2.SavedModel()
    saved.meta_graphs.add().CopyFrom(meta)
    (tmp_path / "saved").mkdir()
    (tmp_path / "saved" / "saved_model.pb").write_bytes(saved.SerializeToString())
    for path in (tmp_path / "model.meta", tmp_path / "saved"):
        code, out, _ = run(capsys, "inspect", path)
        assert code == 0 and f"parameters: {LAYERS} variables" in out


def test_schedule_prints_the_order_and_the_constraints(capsys, files):
    code, out, _ = run(capsys, "schedule", files["pb"], "--algo", "tic", "--json",
                       "--credit", 0, "--window", 1)
    assert code == 0
    plan = json.loads(out)
    rows = plan["orders"]["/job:worker/task:0"]
    order = [row["transfer"] for row in rows]
    assert order == ["MatMul/ReadVariableOp"] + [f"MatMul_{k}/ReadVariableOp"
                                                 for k in range(1, LAYERS)]
    assert [row["group"] for row in rows] == list(range(LAYERS))
    assert len(plan["constraints"]) == LAYERS - 1
    assert {c["before"] for c in plan["constraints"]} == set(order[1:])
    # A credit of two kernels: pairs, the second pair released by the first's arrival.
    kernel = rows[0]["bytes"]
    code, out, _ = run(capsys, "schedule", files["pb"], "--algo", "tic", "--json",
                       "--credit", 2 * kernel, "--window", 1)
    plan = json.loads(out)
    assert [row["group"] for row in plan["orders"]["/job:worker/task:0"]] == [0, 0, 1, 1]
    assert {c["before"] for c in plan["constraints"]} == set(order[2:])
    (gate,) = plan["gate_nodes"]
    assert gate["consumes"] == order[:2]
    code, out, _ = run(capsys, "schedule", files["pb"], "--algo", "tac", "--profile",
                       files["profile"])
    assert code == 0 and "TAC order of the 4 transfers" in out and "->" in out


def test_simulate_and_sweep(capsys, files, tmp_path, chain):
    _, loss = chain
    code, out, _ = run(capsys, "simulate", files["pb"], "--profile", files["profile"],
                       "--fetch", loss, "--workers", 1, "--bandwidth", "1Gbit")
    assert code == 0
    assert [line.split()[0] for line in out.splitlines()[2:]] == ["default", "tic", "tac"]
    plot = tmp_path / "sweep.png"
    code, out, _ = run(capsys, "simulate", files["pb"], "--profile", files["profile"],
                       "--sweep", "workers=1,8,64", "--plot", plot, "--algo", "default,tic")
    assert code == 0
    rows = out.splitlines()[1:4]
    assert [row.split()[0] for row in rows] == ["1", "8", "64"]
    times = [float(row.split()[2]) for row in rows]
    assert times == sorted(times)   # more workers share the PS link: slower
    assert plot.stat().st_size > 5_000


def test_simulate_the_colocated_layout(capsys, files):
    """A PS task on every worker's host: the step is shorter than with the same PS tasks on
    hosts of their own (each worker reaches its own shard off the link), and more PS tasks
    than hosts are refused by name."""
    def step(*extra):
        code, out, err = run(capsys, "simulate", files["pb"], "--profile", files["profile"],
                             "--workers", 4, "--ps", 4, "--algo", "default",
                             "--bandwidth", "20Mbit", *extra)
        assert code == 0, err
        return float(out.splitlines()[2].split()[1])
    assert step("--layout", "colocated") < step()
    code, _, err = run(capsys, "simulate", files["pb"], "--workers", 2, "--ps", 4,
                       "--layout", "colocated")
    assert code != 0 and "4 PS tasks need as many workers" in err
    code, _, err = run(capsys, "simulate", files["pb"], "--layout", "shared")
    assert code != 0 and "unknown layout 'shared'" in err


def test_trace_and_plot_a_traced_step(capsys, tmp_path):
    graph = tf.Graph()
    with graph.as_default():
        with tf.device("/device:CPU:1"):
            weight = tf.compat.v1.get_variable("w", [32, 32], use_resource=True)
        with tf.device("/device:CPU:0"):
            out = tf.reduce_sum(tf.matmul(tf.ones([4, 32]), weight))
        init = tf.compat.v1.global_variables_initializer()
    with tf.compat.v1.Session(graph=graph, config=local_config()) as session:
        session.run(init)
        _, metadata = traced_run(session, out)
    path = tmp_path / "step.runmeta"
    path.write_bytes(metadata.SerializeToString())
    trace_path = tmp_path / "trace.json"
    code, out_text, _ = run(capsys, "trace", path, "--out", trace_path)
    assert code == 0
    events = json.loads(trace_path.read_text())["traceEvents"]
    assert any(e.get("name") == "MatMul" and e["ph"] == "X" for e in events)
    devices = {e["args"]["name"] for e in events if e.get("name") == "process_name"}
    assert any("CPU:0" in d for d in devices) and any("CPU:1" in d for d in devices)
    png = tmp_path / "step.png"
    code, _, _ = run(capsys, "plot", path, path, "--device", "/device:CPU:0", "--out", png)
    assert code == 0 and png.stat().st_size > 5_000


# ------------------------------------------------------------------ bad input
def test_bad_input_is_one_line_and_exit_code_2(capsys, files, tmp_path, chain):
    graph_def, _ = chain
    truncated = tmp_path / "truncated.pb"
    truncated.write_bytes(open(files["pb"], "rb").read()[:-37])
    garbage = tmp_path / "garbage.pb"
    garbage.write_bytes(os.urandom(4096))
    empty = tmp_path / "empty.pb"
    empty.write_bytes(b"")
    no_parameters = tmp_path / "local.pb"
    no_parameters.write_bytes(chain_model(2, width=8, batch=2, ps_devices=["/job:worker/task:0"])
                              .graph.as_graph_def().SerializeToString())
    other_profile = tmp_path / "other.json"
    save_profile(Profile(op_seconds={"x": 1.0}, transfer_seconds={"y/read": 1.0}),
                 str(other_profile))
    corrupt_profile = tmp_path / "corrupt.json"
    corrupt_profile.write_text("{not json")
    cases = [
        ("inspect", truncated), ("inspect", garbage), ("inspect", empty),
        ("inspect", tmp_path / "missing.pb"), ("inspect", tmp_path),
        ("schedule", no_parameters), ("simulate", no_parameters),
        ("simulate", files["pb"], "--profile", other_profile),
        ("schedule", files["pb"], "--algo", "tac", "--profile", corrupt_profile),
        ("simulate", files["pb"], "--bandwidth=-3Gbit"),
        ("simulate", files["pb"], "--workers", 0),
        ("simulate", files["pb"], "--sweep", "workers=8,zero"),
        ("simulate", files["pb"], "--algo", "magic"),
        ("trace", files["pb"]),
        ("schedule", files["pb"], "--window", -1), ("schedule", files["pb"], "--window", 0),
        ("inspect", files["pb"], "--ps-devices", "ps"),
        ("plot", files["pb"], "--device", "worker0"),
    ]
    for case in cases:
        code, out, err = run(capsys, *case)
        assert code == 2, case
        lines = err.strip().splitlines()
        assert len(lines) == 1 and lines[0].startswith("tfoverlap: error: "), (case, err)
        assert "Traceback" not in err
    with pytest.raises(SystemExit) as exit_info:
        cli.main(["simulate", files["pb"], "--workers", "many"])
    assert exit_info.value.code == 2
    assert len(capsys.readouterr().err.strip().splitlines()) == 1


def test_the_console_script_is_the_same_code(files):
    result = subprocess.run([sys.executable, "-m", "tfoverlap.cli", "inspect", "/nonexistent.pb"],
                            capture_output=True, text=True, timeout=120)
    assert result.returncode == 2
    assert result.stderr.strip().splitlines()[-1] == (
        "tfoverlap: error: cannot read /nonexistent.pb: No such file or directory")
    assert "Traceback" not in result.stderr


def test_the_installed_command_prints_only_its_error(files):
    command = os.path.join(os.path.dirname(sys.executable), "tfoverlap")
    env = {k: v for k, v in os.environ.items() if k != "TF_CPP_MIN_LOG_LEVEL"}
    result = subprocess.run([command, "simulate", files["pb"], "--workers", "0"],
                            capture_output=True, text=True, timeout=120, env=env)
    assert result.returncode == 2
    assert result.stderr.strip().splitlines() == ["tfoverlap: error: workers must be >= 1, got 0"]


def test_spreading_variables_over_more_ps_tasks(capsys, files):
    code, out, _ = run(capsys, "simulate", files["pb"], "--profile", files["profile"],
                       "--sweep", "ps=1,2,4", "--algo", "default", "--workers", 4,
                       "--bandwidth", "100Mbit")
    assert code == 0
    times = [float(row.split()[1]) for row in out.splitlines()[1:4]]
    assert times[0] > times[1] > times[2]


_HOROVOD_GRAPH = """
import sys
import horovod.tensorflow as hvd
import tensorflow as tf
hvd.init()
graph = tf.Graph()
with graph.as_default():
    weight = tf.compat.v1.get_variable("w", [256, 256], use_resource=True)
    loss = tf.reduce_sum(tf.matmul(tf.ones([8, 256]), weight))
    (gradient,) = tf.gradients(loss, [weight])
    reduced = hvd.allreduce(gradient, op=hvd.Sum)
    train = weight.assign_sub(0.01 * reduced)
with open(sys.argv[1], "wb") as stream:
    stream.write(graph.as_graph_def().SerializeToString())
"""


def test_allreduce_graphs_use_the_ring_model(capsys, horovod_graphs):
    path = horovod_graphs.paths["cli_one_allreduce"]
    code, out, _ = run(capsys, "inspect", path)
    assert code == 0 and "HorovodAllreduce x1" in out
    code, out, _ = run(capsys, "simulate", path, "--algo", "default", "--workers", 4,
                       "--bandwidth", "1Gbit", "--latency-us", 0)
    assert code == 0
    comm = float(out.splitlines()[2].split()[2])
    assert comm == pytest.approx(2 * 3 / 4 * 256 * 256 * 4 / 125e6, abs=5e-5)  # 4 decimals
    code, _, err = run(capsys, "simulate", path, "--algo", "tic")
    assert code == 2 and "does not apply to AllReduce" in err
    code, out, _ = run(capsys, "simulate", path, "--algo", "default,caramel", "--workers", 4)
    assert code == 0 and [line.split()[0] for line in out.splitlines()[2:]] == [
        "default", "caramel"]
    code, out, _ = run(capsys, "schedule", path, "--algo", "caramel", "--json")
    assert code == 0
    buckets = json.loads(out)["buckets"]
    assert sum(b["bytes"] for b in buckets) == 256 * 256 * 4


_HOROVOD_CHAIN = """
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
    train = tf.group(*[w.assign_sub(0.01 * hvd.allreduce(g, op=hvd.Sum))
                       for w, g in zip(weights, gradients)])
with open(sys.argv[1], "wb") as stream:
    stream.write(graph.as_graph_def().SerializeToString())
"""

#: Built together with the other modules' graphs (conftest's horovod_graphs fixture).
HOROVOD_GRAPHS = {"cli_one_allreduce": _HOROVOD_GRAPH, "cli_chain": _HOROVOD_CHAIN}


def test_caramel_plan_is_never_worse_than_horovods_fusion_in_the_simulation(capsys, tmp_path,
                                                                             horovod_graphs):
    path = horovod_graphs.paths["cli_chain"]
    graph_def = cli.load_graph(str(path))
    profile_path = tmp_path / "profile.json"
    save_profile(Profile(op_seconds={node.name: 0.002 for node in graph_def.node},
                         transfer_seconds={}), str(profile_path))
    for bandwidth in ("100Mbit", "1Gbit", "10Gbit"):
        code, out, _ = run(capsys, "simulate", path, "--profile", profile_path, "--algo",
                           "default,caramel", "--workers", 4, "--bandwidth", bandwidth,
                           "--latency-us", 500)
        assert code == 0
        default, caramel = (float(line.split()[1]) for line in out.splitlines()[2:4])
        assert caramel <= default * (1 + 1e-9), (bandwidth, default, caramel)


def test_schedule_shows_the_cross_step_plan_in_next_forward_order(capsys, horovod_graphs):
    """``--algo cross_step``: what cross-step overlap would defer, chunk by chunk in the
    order it is reduced (the next forward pass's need order), each gradient with the ops
    that wait for it, and the step each candidate plan was predicted at."""
    path = horovod_graphs.paths["cli_chain"]
    code, out, _ = run(capsys, "schedule", path, "--algo", "cross_step", "--workers", 8,
                       "--bandwidth", "10Gbit", "--json")
    assert code == 0
    plan = json.loads(out)
    assert plan["order"] in plan["candidates_s"] and "in-step" in plan["candidates_s"]
    assert plan["predicted_step_s"] == min(
        step for name, step in plan["candidates_s"].items() if name != "in-step")
    deferred = [row for chunk in plan["chunks"] for row in chunk]
    assert 0 < len(deferred) < 6
    assert [row["need_s"] for row in deferred] == sorted(row["need_s"] for row in deferred)
    for row in deferred:      # the layer's own forward MatMul waits for its reduction
        layer = row["allreduce"].split("gradients_")[1].split("_grad")[0]
        assert layer in row["waiting"], row
    code, out, _ = run(capsys, "schedule", path, "--algo", "cross_step", "--workers", 8,
                       "--bandwidth", "10Gbit")
    assert code == 0 and "reduced at the next step's start in this order" in out


def test_the_cross_step_search_script_starts_from_the_plans_choice_and_keeps_need_order(
        capsys, horovod_graphs):
    """scripts/cross_step_search.py: it simulates the plan's own choice to the step the plan
    predicted, and the best set it finds is no slower, in need order, and not every
    gradient (a step keeps something of its own to reduce)."""
    import importlib.util
    spec = importlib.util.spec_from_file_location(
        "cross_step_search", os.path.join(os.path.dirname(os.path.dirname(
            os.path.abspath(__file__))), "scripts", "cross_step_search.py"))
    script = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(script)
    path = horovod_graphs.paths["cli_chain"]
    assert script.main(["--graph", str(path), "--workers", "8", "--bandwidth", "10Gbit",
                        "--threads", "1", "--json"]) == 0
    found = json.loads(capsys.readouterr().out)
    assert found["order"] and found["chosen"], found
    assert found["chosen_s"] == pytest.approx(found["candidates_s"][found["order"]])
    assert found["evaluated"] > 0 and found["best_s"] <= found["chosen_s"]
    graph_def = cli.load_graph(str(path))
    reductions = [node.name for node in graph_def.node if node.op == "HorovodAllreduce"]
    best = [name for chunk in found["best"] for name in chunk]
    assert 0 < len(best) < len(reductions) and set(best) <= set(reductions)
    # The chain's forward pass reads w0 first: need order is the layers' order.
    layers = [int(re.search(r"gradients_MatMul(?:_(\d+))?_grad", name).group(1) or 0)
              for name in best]
    assert layers == sorted(layers), best
    assert script.chunkings([7, 8, 9], 2, 8) == [[[7, 8, 9]], [[7], [8, 9]], [[7, 8], [9]]]


def test_schedule_names_the_transfers_it_leaves_to_control_flow(capsys, tmp_path):
    from tensorflow.python.ops import control_flow_util
    import tensorflow as tf
    enabled = control_flow_util.ENABLE_CONTROL_FLOW_V2
    control_flow_util.ENABLE_CONTROL_FLOW_V2 = False
    try:
        graph = tf.Graph()
        with graph.as_default():
            with tf.device("/job:ps/task:0"):
                kept = tf.compat.v1.get_variable("kept", [4, 4], use_resource=True)
                branch = tf.compat.v1.get_variable("branch", [4, 4], use_resource=True)
            with tf.device("/job:worker/task:0"):
                pred = tf.compat.v1.placeholder(tf.bool, [])
                h = tf.matmul(tf.ones([2, 4]), kept)
                h = tf.matmul(h, tf.ones([4, 4]), name="second")
                tf.cond(pred, lambda: tf.matmul(h, branch), lambda: h, name="head")
    finally:
        control_flow_util.ENABLE_CONTROL_FLOW_V2 = enabled
    path = tmp_path / "cond.pb"
    path.write_bytes(graph.as_graph_def().SerializeToString())
    code, out, err = run(capsys, "schedule", path, "--algo", "tic")
    assert code == 0, err
    assert "TIC order of the 1 transfers" in out
    assert "left out of the order, in a cond branch: 1 transfers (e.g. head/" in out
    code, _, err = run(capsys, "schedule", path, "--algo", "tic", "--ps-devices",
                       "/job:ps/task:0/device:GPU:0")
    assert code == 2 and len(err.strip().splitlines()) == 1


def _traced_horovod_step(path, origin):
    """Rank 0's RunMetadata of a step from origin to origin + 1000 µs: gradients handed
    to Horovod at 200 and 700 µs, Caramel's plan check at 5 µs."""
    from tensorflow.core.protobuf import config_pb2
    metadata = config_pb2.RunMetadata()
    device = metadata.step_stats.dev_stats.add(device="/job:localhost/replica:0/task:0/"
                                                      "device:CPU:0")
    for name, op, start, length in (
            ("conv", "Conv2D", 0, 150), ("tfoverlap/caramel/plan_check/max",
                                         "HorovodAllreduce", 5, 40),
            ("grad_a/allreduce", "HorovodAllreduce", 200, 200),
            ("tfoverlap/caramel/bucket_1", "HorovodGroupedAllreduce", 700, 200),
            ("update", "AssignSubVariableOp", 950, 50)):
        device.node_stats.add(node_name=name, all_start_micros=origin + start,
                              op_start_rel_micros=0, op_end_rel_micros=length,
                              all_end_rel_micros=length, timeline_label=f"{name} = {op}(x)")
    path.write_bytes(metadata.SerializeToString())
    return str(path)


def test_breakdown_splits_a_traced_horovod_step(tmp_path, capsys):
    from helpers import horovod_timeline_text
    origin = 1_700_000_000_000_000
    step = _traced_horovod_step(tmp_path / "step.pb", origin)
    timeline = tmp_path / "timeline.json"
    timeline.write_text(horovod_timeline_text({
        "tfoverlap/caramel/plan_check/max": [("ALLREDUCE", 10, 40)],
        "grad_a/allreduce": [("NEGOTIATE_ALLREDUCE", 200, 230), ("ALLREDUCE", 240, 400)],
        "tfoverlap/caramel/bucket_1_0of1": [("NEGOTIATE_ALLREDUCE", 700, 760),
                                            ("ALLREDUCE", 800, 900)]}, origin))
    assert cli.main(["breakdown", step, "--horovod-timeline", str(timeline)]) == 0
    out = capsys.readouterr().out
    assert "step 1.00 ms" in out
    # The plan check is not a gradient: the first one reached Horovod at 200 µs.
    assert "until the last gradient      0.70 ms   (first gradient at 0.20 ms)" in out
    for label, value in (("reductions running", "0.10"), ("nothing reducing", "0.10"),
                         ("after the last reduction", "0.10")):
        line = next(line for line in out.splitlines() if label in line)
        assert line.split()[-2] == value, line
    assert "in 3 fused requests" in out


def test_breakdown_names_a_timeline_of_another_run_or_a_corrupt_one(tmp_path, capsys):
    from helpers import horovod_timeline_text
    origin = 1_700_000_000_000_000
    step = _traced_horovod_step(tmp_path / "step.pb", origin)
    other = tmp_path / "other.json"
    other.write_text(horovod_timeline_text({"grad_a/allreduce": [("ALLREDUCE", 240, 400)]},
                                           origin + 10_000_000))
    corrupt = tmp_path / "corrupt.json"
    corrupt.write_text("[{not json")
    for path, message in ((other, "no reduction inside the traced step"),
                          (corrupt, "not a Horovod timeline")):
        assert cli.main(["breakdown", step, "--horovod-timeline", str(path)]) == 2
        err = capsys.readouterr().err
        assert message in err and str(path) in err and len(err.strip().splitlines()) == 1
