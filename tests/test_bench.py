"""A small end-to-end run of the PS benchmark: tiny model, two workers, a shaped link."""
import json
import math
import os
import statistics
import time

import pytest

from tests.helpers import GLOO_TIMEOUT_ENV
from tfoverlap.bench import ps, report
from tfoverlap.testbed.network import leftovers


def _chain_reads(num_layers):
    """The PS-side reads of the chain's kernels, first layer first (the MatMuls' reads)."""
    return ["MatMul/ReadVariableOp"] + [f"MatMul_{k}/ReadVariableOp"
                                        for k in range(1, num_layers)]


@pytest.mark.skipif(os.geteuid() != 0, reason="the shaped link needs root (namespaces, tc)")
@pytest.mark.slow
def test_small_benchmark_end_to_end(tmp_path):
    config = ps.Configuration("seq8", training=False, batch=256, bandwidth=125e6,
                              num_ps=1, num_workers=2, width=512)
    # tic_serial: every transfer waits for the one before, so the order shows exactly.
    # Each traced step is the second of its block (trace_after=1).
    before_us = time.time() * 1e6
    result = ps.run_configuration(config, ("default", "tic_serial"), rounds=1, steps=2, traces=2,
                                  workdir=str(tmp_path / "work"), timeout=300, trace_after=1)
    after_us = time.time() * 1e6
    assert leftovers() == []
    assert result["network"].startswith("3 network namespaces")
    assert (tmp_path / "work" / "ps0.log").exists()    # the PS task's stderr is kept
    assert result["passes"]["tic_serial"]["transfers"] == 8
    assert result["passes"]["tic_serial"]["ordering_edges"] == 7
    rows = ps.summarize(result)
    assert [row["variant"] for row in rows] == ["default", "tic_serial"]
    for row in rows:
        assert row["steps"] == 2 * 2  # steps x workers
        assert row["median_s"] > 0 and row["comm_s"] > 0 and row["comp_s"] > 0
        assert not math.isnan(row["efficiency"])
    tic = rows[1]
    # Blocks of 2 steps: the second step of each worker's block, against the default's.
    second = {name: statistics.median(times[1::2]) for name, times in result["times"].items()}
    assert tic["later_speedup"] == pytest.approx(second["default"] / second["tic_serial"])
    assert tic["later_s"] == pytest.approx(second["tic_serial"])
    # The enforced order holds on both workers in every traced step, in layer order.
    assert tic["distinct_orders"] == 1 and tic["top_order_share"] == 1.0
    for traced in result["traces"]["tic_serial"]:
        for answer in traced:
            assert answer["order"] == _chain_reads(8)
            # When the traced step started, on the clock the workers share.
            assert before_us < answer["started_us"] < after_us
    # The transfers moved 8 kernels of 512x512 floats into worker 0 in the traced step.
    transfers = result["traces"]["tic_serial"][0][0]["transfers"]
    assert sum(t[3] for t in transfers) == pytest.approx(8 * 512 * 512 * 4, rel=0.05)
    table = report.markdown_table(rows)
    assert "| seq8 | inference | 256 | 1Gbit | tic_serial |" in table
    report.write_result_rows(rows, str(tmp_path / "rows.json"))
    written = json.loads((tmp_path / "rows.json").read_text())
    assert [r["variant"] for r in written] == ["default", "tic_serial"]
    assert set(written[1]) >= {"model", "mode", "workers", "link", "variant", "iteration_s",
                               "speedup", "ci_low", "ci_high"}
    assert written[1]["link"] == "1Gbit" and written[1]["workers"] == 2
    # One round: its ratio is the speed-up itself.
    assert written[1]["round_low"] == written[1]["round_high"] == pytest.approx(
        written[1]["speedup"])
    report.write_csv(rows, str(tmp_path / "results.csv"))
    report.plot_speedups(rows, str(tmp_path / "speedups.png"))
    report.plot_timelines({"default": result["traces"]["default"][0][0],
                           "tic": result["traces"]["tic_serial"][0][0]}, "seq8",
                          str(tmp_path / "timeline.png"))
    assert (tmp_path / "results.csv").read_text().count("\n") == 3
    assert (tmp_path / "timeline.png").stat().st_size > 10_000


@pytest.fixture(scope="module")
def colocated_emulated_run(tmp_path_factory):
    """One PS job for two tests: a colocated layout on emulated V100s with a fixed
    dilation (each a configuration of its own before; the one run checks both)."""
    if os.geteuid() != 0:
        pytest.skip("the shaped link needs root (namespaces, tc)")
    config = ps.Configuration("seq8", training=True, batch=64, bandwidth=1.25e9, num_ps=2,
                              num_workers=2, layout="colocated", width=256, emulate="v100",
                              dilation=10)
    result = ps.run_configuration(config, ("default", "tic"), rounds=1, steps=2, traces=1,
                                  workdir=str(tmp_path_factory.mktemp("colocated") / "work"),
                                  timeout=300)
    assert leftovers() == []
    return result


@pytest.mark.slow
def test_a_colocated_benchmark_runs_a_ps_task_on_every_workers_host(colocated_emulated_run):
    result = colocated_emulated_run
    assert result["network"].startswith("2 network namespaces")
    # Every worker reads all 8 kernels, 4 from its own host's PS task and 4 over the link.
    assert result["passes"]["tic"]["transfers"] == 8
    memory = result["memory"]
    assert len(memory["ps_started"]) == len(memory["ps_initialized"]) == 2
    assert len(memory["ps"]) == len(memory["worker"]) == 2
    assert min(memory["ps"] + memory["worker"]) > 50e6
    rows = ps.summarize(result)
    assert [(row["layout"], row["ps"], row["workers"]) for row in rows] == [
        ("colocated", 2, 2)] * 2


def test_bad_benchmark_options_are_one_line_errors(capsys):
    assert ps.main(["--models", "resnet9000"]) == 2
    assert ps.main(["--models", "seq32:sideways"]) == 2
    assert ps.main(["--bandwidth=-3Gbit"]) == 2
    assert ps.main(["--workers", "0"]) == 2
    assert ps.main(["--ps", "2", "--variants", "default,tf_recv_scheduling"]) == 2
    assert ps.main(["--emulate", "v100", "--variants", "default,replay"]) == 2
    assert ps.main(["--emulate", "t1000"]) == 2
    assert ps.main(["--trace-after", "-1"]) == 2
    assert ps.main(["--until-ci", "1.5"]) == 2
    from tfoverlap.bench import ps_strategy
    assert ps_strategy.main(["--models", "resnet50", "--variants", "default,tac"]) == 2
    assert ps_strategy.main(["--models", "seq32"]) == 2
    errors = capsys.readouterr().err.strip().splitlines()
    assert len(errors) == 11 and all(line.startswith("tfoverlap bench: ") for line in errors)
    assert "--trace-after must be >= 0" in errors[7]
    assert "--until-ci must be in [0, 1)" in errors[8]
    assert "TAC needs a profile" in errors[9] and "not seq32" in errors[10]


def test_the_colocated_layout_takes_a_ps_task_per_worker(capsys):
    assert ps.main(["--layout", "stacked"]) == 2
    assert ps.main(["--layout", "colocated", "--workers", "3", "--ps", "2"]) == 2
    # --ps defaults to the worker count: 4 PS tasks, which tf_recv_scheduling cannot take.
    assert ps.main(["--layout", "colocated", "--workers", "4"]) == 2
    errors = capsys.readouterr().err.strip().splitlines()
    assert "unknown layout 'stacked'" in errors[0]
    assert "as many PS tasks as workers, got 2 PS tasks and 3 workers" in errors[1]
    assert "more than one PS task" in errors[2]


def test_memory_summary_sets_the_ps_tasks_growth_against_the_parameters():
    memory = {"ps_started": [400e6, 400e6], "ps_initialized": [420e6, 430e6],
              "ps": [460e6, 450e6], "worker": [900e6, 950e6]}
    line = ps.memory_summary(memory, parameter_bytes=102e6)
    assert ("2 PS tasks 910 MB (450-460 each), 50 MB more than at start-up once "
            "initialized, 110 MB after the warm-up (parameters: 102 MB); 2 workers 1,850 MB "
            "(900-950 each); all 2,760 MB") in line


class _Variable:
    """What ddp_groups reads of a tf.Variable."""

    def __init__(self, name: str, elements: int):
        import tensorflow as tf
        self.name, self.shape, self.dtype = name, tf.TensorShape([elements]), tf.float32


def test_ddp_baseline_buckets_like_pytorch_ddp():
    from tfoverlap.bench.allreduce_worker import MIB, ddp_groups
    # 4-byte floats: 0.5 MiB, 0.75 MiB, then 10 MiB tensors.
    sizes = [MIB // 8, 3 * MIB // 16] + [10 * MIB // 4] * 6
    variables = [_Variable(f"v{i}", n) for i, n in enumerate(sizes)]
    groups = [[v.name for v in group] for group in ddp_groups(variables)]
    # Reverse order; the first bucket closes at 1 MiB, the others at 25 MiB.
    assert groups == [["v7"], ["v6", "v5", "v4"], ["v3", "v2", "v1", "v0"]]


@pytest.mark.parametrize("argv, message", [
    (["--models", "alexnet"], "unknown model"),
    (["--models", "seq32"], "unknown model"),
    (["--bandwidths", "fast"], "not understood"),
    (["--rounds", "0"], "must be >= 1"),
    (["--api", "keras", "--variants", "horovod,caramel_forced"], "--variants must include"),
])
def test_bad_horovod_benchmark_options_are_one_line_errors(capsys, argv, message):
    from tfoverlap.bench import allreduce
    assert allreduce.main(argv + ["--out", "/nonexistent/never-written"]) == 2
    err = capsys.readouterr().err
    assert message in err and len(err.strip().splitlines()) == 1


@pytest.mark.slow
def test_horovod_benchmark_worker_end_to_end(tmp_path):
    """One round of the Horovod benchmark's worker on 2 Gloo ranks (loopback): every
    variant is timed, rank 0 reports what Caramel planned, and its traced steps line up
    with Horovod's timeline into a breakdown; a decoupled step's gradients are its
    reduce-scatters, drawn as such."""
    import json
    import sys
    from tfoverlap.bench.allreduce import traced_breakdowns
    from tfoverlap.costs.horovod_timeline import read_timeline
    from tfoverlap.testbed.horovod_launch import run_horovod
    from tfoverlap.testbed.network import EmulatedNetwork
    timeline = str(tmp_path / "timeline.json")
    # The transformer, not a smaller model: with ResNet-20 (30-40 s less) the caramel
    # variant's in-step bound exceeded its step in 2 of 6 runs on a busy host (146 ms
    # against a step of 88 ms once: its ring was busy before the first gradient it
    # recorded). 4 of its 12 layers at batch 8 (the worker's model otherwise the
    # benchmark's): a third of the graph to build (the job takes half the time), steps as
    # long as the 12 layers' at batch 2 (350-550 ms against 330-670 ms on a busy host) and
    # more of the ring idle after the first gradient (a median of 145-195 ms against
    # 80 ms; 8 runs of each variant against 4).
    worker = ("import functools, sys\n"
              "from tfoverlap.testbed import models\n"
              "models.transformer_model = functools.partial(models.transformer_model,"
              " layers=4)\n"
              "from tfoverlap.bench import allreduce_worker\n"
              "raise SystemExit(allreduce_worker.main(sys.argv[1:]))\n")
    with EmulatedNetwork(2, loopback=True) as network:
        result = run_horovod(network, 2, [
            sys.executable, "-c", worker, "--model", "transformer",
            "--batch", "8", "--variants", "horovod,caramel,caramel_decoupled", "--rounds", "1",
            "--steps", "1",
            "--warmup", "1", "--trace-timeline", timeline, "--traced-steps", "2"],
            controller="gloo", timeout=400,
            env={"HOROVOD_TIMELINE": "DYNAMIC", **GLOO_TIMEOUT_ENV})
    assert result.returncode == 0, [output[-3000:] for output in result.outputs]
    record = json.loads(next(line for line in result.outputs[0].splitlines()
                             if line.startswith("{")))
    variants = {"horovod", "caramel", "caramel_decoupled"}
    assert set(record["times"]) == variants
    assert all(len(times) == 1 for times in record["times"].values())
    assert record["tensors"] == 1 + 4 * 16 + 2      # the 4-layer transformer's
    # The step's plan holds every gradient but those deferred to the next step (cross-step
    # overlap is on by default where the plan predicts a gain).
    planned = record["caramel"]["caramel"]
    deferred = planned.get("cross_step", {}).get("deferred", 0)
    assert planned["allreduces"] + deferred == record["tensors"], planned
    breakdowns, figures = traced_breakdowns(record["traced"], timeline)
    assert set(breakdowns) == set(figures) == variants
    assert len(record["caramel"]["caramel_decoupled"]["decouple"]["buckets"]) >= 1
    with open(timeline) as stream:
        records = read_timeline(stream.read())
    for variant, part in breakdowns.items():
        steps = record["traced"][variant]
        assert len(steps) == 2 and all(len(s["ready"]) >= 1 for s in steps)
        assert part["step"] == pytest.approx(part["until_last_gradient"] + part["tail"])
        assert part["tail"] == pytest.approx(part["tail_ring"] + part["tail_wait"]
                                             + part["after_last_reduction"], abs=1e-9)
        assert part["requests"] >= 1 and 0 < part["ring"] <= part["step"]
        if variant == "horovod" or variant == "caramel" and not deferred:
            # A step that reduces only its own gradients cannot beat the in-step bound; a
            # cross-step one can (the previous step's reductions run before its first
            # gradient), which is what deferral is for, and so can a decoupled one (the
            # previous step's all-gathers).
            assert part["in_step_bound"] <= part["step"] * (1 + 1e-9)
        # The clocks line up: every tensor of the model (but a deferred one) is reduced
        # inside the figure's step, after its gradient reached Horovod and before the
        # step ended.
        figure = figures[variant]
        assert figure["compute"]
        reduced = {name for name, begin, length, *_ in figure["transfers"]
                   if begin >= 0 and begin + length <= figure["seconds"] * 1e6 + 100}
        operations = {operation for *_, operation in figure["transfers"]}
        if variant == "horovod":
            assert len(reduced) == record["tensors"], variant
            assert operations == {"ALLREDUCE"}
        elif variant == "caramel":   # deferred reductions may run under the next step
            assert len(reduced) >= planned["allreduces"], variant
        else:   # each bucket reduce-scattered in the step; the gathers follow it
            decoupled = record["caramel"][variant]["decouple"]
            assert "REDUCESCATTER" in operations and operations <= {
                "ALLREDUCE", "REDUCESCATTER", "ALLGATHER"}, operations
            assert sum(records[name].operation == "REDUCESCATTER"
                       for name in reduced) >= len(decoupled["buckets"]), decoupled
        assert reduced <= set(records)
    report.plot_timelines(figures, "transformer", str(tmp_path / "steps.png"))
    assert (tmp_path / "steps.png").stat().st_size > 10_000


# The Keras benchmark's worker, with its model swapped for a small CNN (the worker's
# code does not depend on the model; building MobileNetV2 four times took 2 minutes of
# the job): model.fit (every kind of variant), then the tape loop, in one Horovod job.
_KERAS_WORKER_JOBS = """
import sys
import tensorflow as tf
from tfoverlap.bench import keras_worker


def small_cnn(args):
    tf.keras.utils.set_random_seed(args.seed)
    layers = tf.keras.layers
    return tf.keras.Sequential([
        layers.Conv2D(8, 3, padding="same", use_bias=False,
                      input_shape=(args.image_size, args.image_size, 3)),
        layers.BatchNormalization(), layers.ReLU(),
        layers.Conv2D(16, 3, strides=2, padding="same", activation="relu"),
        layers.GlobalAveragePooling2D(), layers.Dense(1000)])   # the dataset's classes


keras_worker._model = small_cnn
common = ["--model", "small_cnn", "--batch", "2", "--image-size", "16", "--rounds", "2",
          "--calls", "1", "--steps-per-execution", "2", "--warmup", "1"]
for extra in (["--variants", "horovod,ddp25,caramel,compute_only"],
              ["--loop", "tape", "--variants", "horovod,caramel"]):
    code = keras_worker.main(common + extra)
    if code:
        raise SystemExit(code)
"""


@pytest.fixture(scope="module")
def keras_worker_records():
    """Rank 0's records of the Keras job and the tape-loop job, by API."""
    import sys
    from tfoverlap.testbed.horovod_launch import run_horovod
    from tfoverlap.testbed.network import EmulatedNetwork
    with EmulatedNetwork(2, loopback=True) as network:
        result = run_horovod(network, 2, [sys.executable, "-c", _KERAS_WORKER_JOBS],
                             controller="gloo", timeout=500, env=GLOO_TIMEOUT_ENV)
    assert result.returncode == 0, [output[-3000:] for output in result.outputs]
    records = [json.loads(line) for line in result.outputs[0].splitlines()
               if line.startswith("{")]
    assert [record["api"] for record in records] == ["keras", "tape"]
    return {record["api"]: record for record in records}


@pytest.mark.slow
def test_keras_benchmark_worker_end_to_end(keras_worker_records):
    """One Keras job of the Horovod benchmark on 2 Gloo ranks (loopback): every variant's
    model.fit is timed, call by call, per step; rank 0 reports what cross-step overlap
    decided; the rows are Keras rows, with per-round ratios."""
    from tfoverlap.bench.allreduce import summarize
    record = keras_worker_records["keras"]
    assert record["api"] == "keras" and record["steps_per_execution"] == 2
    assert set(record["times"]) == {"horovod", "ddp25", "caramel", "compute_only"}
    assert all(len(times) == 2 and min(times) > 0 for times in record["times"].values())
    decision = record["caramel"]["caramel"]["cross_step"]
    assert decision["mode"] == "auto" and "deferred" in decision, decision
    assert decision["deferred"] or decision["reason"], decision
    rows = {row["variant"]: row for row in summarize({
        **record, "bandwidth": None, "emulate": "", "dilation": 1.0,
        "steps_per_block": 1})}
    assert set(rows) == {"horovod", "ddp25", "caramel"}
    assert all(row["api"] == "keras" and row["steps_per_execution"] == 2
               for row in rows.values())
    assert rows["caramel"]["round_low"] <= rows["caramel"]["round_high"]


@pytest.mark.slow
def test_tape_loop_benchmark_worker_end_to_end(keras_worker_records):
    """--loop tape: each variant is a tf.function of DistributedGradientTape steps in a
    tf.range loop (Horovod's tape, tfoverlap.horovod's), timed call by call, per step;
    rank 0 reports what cross-step overlap decided for the tape; the rows are tape rows."""
    from tfoverlap.bench.allreduce import summarize
    record = keras_worker_records["tape"]
    assert record["api"] == "tape" and record["steps_per_execution"] == 2
    assert set(record["times"]) == {"horovod", "caramel"}
    assert all(len(times) == 2 and min(times) > 0 for times in record["times"].values())
    decision = record["caramel"]["caramel"]["cross_step"]
    assert decision["api"] == "tape" and decision["mode"] == "auto", decision
    assert decision["deferred"] or decision["reason"], decision
    rows = {row["variant"]: row for row in summarize({
        **record, "bandwidth": None, "emulate": "", "dilation": 1.0, "steps_per_block": 1})}
    assert set(rows) == {"horovod", "caramel"}
    assert all(row["api"] == "tape" and row["steps_per_execution"] == 2
               for row in rows.values())


def test_the_keras_worker_builds_a_keras_application_that_returns_logits():
    """What the jobs above swap out: a named Keras application at the asked image size,
    1,000 logits (the loss is told from_logits), seeded."""
    import argparse
    import numpy as np
    from tfoverlap.bench.keras_worker import _model
    args = argparse.Namespace(model="mobilenet_v2", seed=0, batch=2, image_size=32)
    first, second = _model(args), _model(args)
    assert first.name.startswith("mobilenetv2")
    assert first.input_shape == (None, 32, 32, 3) and first.output_shape == (None, 1000)
    assert first.layers[-1].activation.__name__ == "linear"
    np.testing.assert_array_equal(first.get_weights()[0], second.get_weights()[0])


def test_keras_transformer_is_the_graph_mode_transformer():
    """Keras rows and graph-mode rows of the transformer time the same network: the same
    variables and shapes (Keras lists a layer's norms after its feed-forward layers)."""
    import argparse
    from tfoverlap.bench.keras_worker import _dataset, _model
    from tfoverlap.testbed.models import transformer_model
    args = argparse.Namespace(model="transformer", seed=0, batch=2, image_size=224)
    keras_shapes = sorted(tuple(v.shape) for v in _model(args).trainable_variables)
    graph_model = transformer_model(batch=2, worker_device="/cpu:0")
    assert keras_shapes == sorted(tuple(v.shape) for v in graph_model.variables)
    assert len(keras_shapes) == 1 + 12 * 16 + 2
    tokens, labels = next(iter(_dataset(args)))
    assert tokens.shape == (2, 128) and tokens.dtype.name == "int32" and labels.shape == (2,)


def test_keras_rows_merge_apart_from_graph_mode_rows(tmp_path):
    """A Keras row and a graph-mode row of the same model, link and variant are two
    configurations in the docs file."""
    def row(median, **extra):
        return {"model": "m", "mode": "training", "workers": 8, "link": "25Gbit",
                "variant": "caramel", "median_s": median, "speedup": 1.0, "ci_low": 0.9,
                "ci_high": 1.1, **extra}
    path = str(tmp_path / "horovod.json")
    report.write_result_rows([row(1.0)], path)      # written before rows named their API
    report.write_result_rows([row(2.0, api="keras", steps_per_execution=4, drain_ms=3.0)],
                             path, merge=True, command="keras")
    rows = json.loads(open(path).read())
    assert [(r["api"], r["iteration_s"]) for r in rows] == [("graph", 1.0), ("keras", 2.0)]
    assert rows[1]["steps_per_execution"] == 4 and rows[1]["drain_ms"] == 3.0
    assert [(r["emulated"], r["dilation"]) for r in rows] == [("", 1.0), ("", 1.0)]
    # A graph-mode row of the same configuration replaces the one without its API.
    report.write_result_rows([row(3.0, api="graph")], path, merge=True, command="graph")
    rows = json.loads(open(path).read())
    assert [(r["api"], r["iteration_s"]) for r in rows] == [("keras", 2.0), ("graph", 3.0)]


def test_result_rows_merge_into_the_docs_file(tmp_path):
    def row(variant, link, median):
        return {"model": "m", "mode": "inference", "workers": 2, "link": link,
                "variant": variant, "median_s": median, "speedup": 1.0, "ci_low": 0.9,
                "ci_high": 1.1, "batch": 4}
    path = str(tmp_path / "ps.json")
    report.write_result_rows([row("default", "loopback", 1.0), row("tic", "loopback", 2.0)],
                             path, merge=True, command="first")
    report.write_result_rows([row("tic", "loopback", 3.0), row("tic", "1Gbit", 4.0)], path,
                             merge=True, command="second")
    rows = json.loads(open(path).read())
    assert [(r["variant"], r["link"], r["iteration_s"], r["command"]) for r in rows] == [
        ("default", "loopback", 1.0, "first"), ("tic", "loopback", 3.0, "second"),
        ("tic", "1Gbit", 4.0, "second")]
    assert set(rows[0]) == set(report.RESULT_FIELDS) | {"batch", "command", "date", "api",
                                                        "emulated", "dilation"}
    # Two PS tasks are another configuration than one, at the same link.
    two_ps = {**row("tic", "1Gbit", 5.0), "ps": 2}
    report.write_result_rows([two_ps], path, merge=True, command="third")
    rows = json.loads(open(path).read())
    assert [(r["iteration_s"], r.get("ps")) for r in rows if r["link"] == "1Gbit"] == [
        (4.0, None), (5.0, 2)]


def test_ps_rows_of_the_two_layouts_merge_as_two_configurations(tmp_path):
    def row(layout, median):
        return {"model": "m", "mode": "training", "workers": 4, "link": "25Gbit",
                "variant": "tic", "median_s": median, "speedup": 1.0, "ci_low": 0.9,
                "ci_high": 1.1, "ps": 4, **({"layout": layout} if layout else {})}
    path = str(tmp_path / "ps.json")
    report.write_result_rows([row(None, 1.0)], path)       # written before layouts existed
    report.write_result_rows([row("colocated", 2.0)], path, merge=True, command="colocated")
    report.write_result_rows([row("dedicated", 3.0)], path, merge=True, command="dedicated")
    rows = json.loads(open(path).read())
    assert [(r["layout"], r["iteration_s"]) for r in rows] == [("colocated", 2.0),
                                                                ("dedicated", 3.0)]


def test_horovod_rows_carry_the_step_caramel_predicted_for_each_variant(tmp_path):
    """Each row is next to what Caramel's simulation predicted for it, in the rows' time
    unit: the plan's step where Caramel planned, Horovod's fusion where it stepped aside
    and for Horovod's defaults, nothing where nothing predicts (DDP buckets)."""
    from tfoverlap.bench import allreduce
    times = {"horovod": [0.4, 0.4, 0.4], "ddp25": [0.5] * 3, "caramel": [0.4] * 3,
             "caramel_forced": [0.3] * 3, "compute_only": [0.2] * 3, "comm_only": [0.3] * 3}
    result = {"model": "m", "batch": 4, "bandwidth": 1e9, "ranks": 8, "dilation": 2.0,
              "emulate": "v100", "host_busy": 0.4, "times": times, "cpu": {},
              "tensors": 3, "parameter_bytes": 1e6, "caramel": {
                  "caramel": {"declined": "no gain", "predicted_step_s": 0.5,
                              "predicted_horovod_step_s": 0.6},
                  "caramel_forced": {"buckets": 2, "predicted_step_s": 0.5,
                                     "predicted_horovod_step_s": 0.6}}}
    rows = {row["variant"]: row for row in allreduce.summarize(result)}
    assert rows["horovod"]["predicted_s"] == pytest.approx(0.3)       # 0.6 s / K
    assert rows["caramel"]["predicted_s"] == pytest.approx(0.3)       # stepped aside
    assert rows["caramel_forced"]["predicted_s"] == pytest.approx(0.25)
    assert rows["caramel_forced"]["prediction_error"] == pytest.approx(0.25 / 0.15 - 1)
    assert "predicted_s" not in rows["ddp25"]
    table = allreduce.markdown_table(list(rows.values()))
    assert "0.250 (+67%)" in table and "| n/a |" in table
    path = str(tmp_path / "rows.json")
    report.write_result_rows(list(rows.values()), path)
    written = {row["variant"]: row for row in json.loads(open(path).read())}
    assert written["caramel_forced"]["predicted_s"] == pytest.approx(0.25)
    # A run without comm_only and compute_only (too large to hold their graphs too): the
    # ratios still come, comm/comp is unknown, and the file says null (standard JSON).
    for name in ("compute_only", "comm_only"):
        del times[name]
    rows = {row["variant"]: row for row in allreduce.summarize(result)}
    assert rows["caramel_forced"]["speedup"] == pytest.approx(0.4 / 0.3)
    assert math.isnan(rows["horovod"]["comm_over_comp"])
    report.write_result_rows(list(rows.values()), path)
    text = open(path).read()
    assert "NaN" not in text and json.loads(text)[0]["comm_over_comp"] is None


def test_a_caramel_row_that_changed_nothing_says_it_stepped_aside():
    """A Keras or tape row with nothing deferred, or a graph row whose in-step buckets
    declined and nothing deferred, ran Horovod's own schedule: the row says so and why; a
    row that deferred did not step aside."""
    from tfoverlap.bench import allreduce
    times = {"horovod": [0.4] * 3, "horovod_again": [0.4] * 3, "caramel": [0.4] * 3}
    keras = {"model": "m", "batch": 4, "bandwidth": 1e9, "ranks": 4, "times": times,
             "cpu": {}, "tensors": 3, "parameter_bytes": 1e6, "api": "keras",
             "steps_per_execution": 4, "caramel": {"caramel": {"cross_step": {
                 "deferred": 0, "reason": "deferring would take the step from 80 to 79 ms "
                                          "(+1.0%), below min_gain 3.0%"}}}}
    rows = {row["variant"]: row for row in allreduce.summarize(keras)}
    assert rows["caramel"]["stepped_aside"] == "predicted +1.0%, below min_gain 3.0%"
    assert "stepped_aside" not in rows["horovod_again"]
    assert "caramel (stepped aside: predicted +1.0%" in allreduce.markdown_table(
        list(rows.values()))
    keras["caramel"]["caramel"]["cross_step"] = {"deferred": 12, "deferred_bytes": 2e6,
                                                 "order": "next-forward need",
                                                 "chunks": [8, 4], "predicted_step_ms": 700}
    rows = {row["variant"]: row for row in allreduce.summarize(keras)}
    assert "stepped_aside" not in rows["caramel"]
    assert allreduce.what_it_did(rows["caramel"]) == (
        "deferred 12 gradients (2.0 MB) under the next step's forward pass (next-forward "
        "need, 2 requests); step predicted 700.0 ms, measured 400.0 ms")
    graph = {**keras, "api": None, "caramel": {"caramel": {
        "declined": "Horovod's own fusion is as fast", "predicted_horovod_step_s": 0.5}}}
    rows = {row["variant"]: row for row in allreduce.summarize(graph)}
    assert rows["caramel"]["stepped_aside"] == "Horovod's own fusion is as fast"


def test_a_ps_run_measures_until_its_intervals_are_narrow_or_its_budget_is_spent():
    """--until-ci: rounds go on after --rounds while a speed-up's interval is wider than
    asked, and stop when it is narrow enough or the time budget is spent, saying which."""
    from tfoverlap.bench import ps

    class Workers:
        """Two workers whose steps take fixed times, with noise in the first rounds."""
        def __init__(self, noisy_rounds):
            self.calls, self.noisy_rounds = 0, noisy_rounds

        def ask(self, command):
            self.calls += 1
            round_index = (self.calls - 1) // 2
            base = 1.0 if command["variant"] == "default" else 0.8
            spread = 0.3 if round_index < self.noisy_rounds else 0.0
            return [{"times": [base - spread, base + spread], "cpu": [0.1, 0.1]}
                    for _ in range(2)]

    narrow = ps.measure_rounds(Workers(noisy_rounds=3), ("default", "tic"), 2, 2, "m", 1.0,
                               until_ci=0.05, budget_s=60)
    assert narrow["precision"]["reached"] and narrow["precision"]["rounds"] > 2
    assert narrow["precision"]["widest"] <= 0.05
    assert ps.widest_interval(narrow["times"]) == narrow["precision"]["widest"]
    spent = ps.measure_rounds(Workers(noisy_rounds=10 ** 6), ("default", "tic"), 2, 2, "m",
                              1.0, until_ci=0.05, budget_s=0)
    assert not spent["precision"]["reached"] and spent["precision"]["rounds"] == 2
    plain = ps.measure_rounds(Workers(noisy_rounds=10 ** 6), ("default", "tic"), 2, 2, "m",
                              1.0)
    assert "precision" not in plain and len(plain["times"]["tic"]) == 8


@pytest.mark.slow
def test_an_emulated_ps_job_of_two_workers_trains_and_reports_in_emulated_time(
        colocated_emulated_run):
    """Emulated V100s with a fixed dilation: every variant (the computation-only reference
    too) runs emulated kernels, the link is shaped to 1/K of its emulated rate, and the
    rows are in emulated seconds, with the workers' CPU share and the host's busy share.
    (The colocated run above: the emulation does not depend on the layout.)"""
    result = colocated_emulated_run
    assert result["dilation"] == 10 and "1 Gbit/s tbf" in result["network"]
    rows = ps.summarize(result)
    for row, wall in zip(rows, (result["times"]["default"], result["times"]["tic"])):
        assert row["emulated"] == "v100" and row["dilation"] == 10
        assert row["median_s"] == pytest.approx(sorted(wall)[len(wall) // 2] / 10, rel=0.5)
        assert 0 < row["worker_cpu_share"] < 1 and 0 < row["host_busy"] <= 1
        assert row["link"] == "10Gbit"


@pytest.mark.slow
def test_an_emulated_horovod_job_of_two_ranks_trains_with_emulated_kernels():
    """Two Gloo ranks on emulated V100s: Horovod's own and Caramel's graphs both run, rank
    0 reports CPU per step and the host's busy share."""
    import sys
    from tfoverlap.testbed.horovod_launch import run_horovod
    from tfoverlap.testbed.network import EmulatedNetwork
    # The CIFAR ResNet at depth 8 (one block a stage), not 20: half the graph to build,
    # and no less room between a step's CPU and its wall time (5 ms of CPU against 21 ms).
    worker = ("import sys\n"
              "from tfoverlap.testbed import models\n"
              "models.CIFAR_MODELS = (*models.CIFAR_MODELS, 'resnet8')\n"
              "from tfoverlap.bench import allreduce_worker\n"
              "raise SystemExit(allreduce_worker.main(sys.argv[1:]))\n")
    with EmulatedNetwork(2, loopback=True) as network:
        result = run_horovod(network, 2, [
            sys.executable, "-c", worker, "--model", "resnet8",
            "--batch", "32", "--variants", "horovod,caramel_forced,compute_only",
            "--rounds", "1", "--steps", "2", "--warmup", "1", "--emulate", "v100",
            # Kernels long enough that the CPU a step costs stays well below its wall
            # time on a busy host (ResNet-20's compute_only: 16 ms of CPU against 49 ms;
            # at 10, 7 ms against 14 ms, and once 16 ms of CPU).
            "--dilation", "40"], controller="gloo", timeout=400)
    assert result.returncode == 0, [output[-3000:] for output in result.outputs]
    record = json.loads(next(line for line in result.outputs[0].splitlines()
                             if line.startswith("{")))
    assert record["model"] == "resnet8" and record["tensors"] == 29     # ResNet-20: 65
    assert set(record["times"]) == {"horovod", "caramel_forced", "compute_only"}
    assert record["caramel"]["caramel_forced"]["buckets"] >= 1
    for variant, times in record["times"].items():
        assert len(times) == 2 and len(record["cpu"][variant]) == 2
        # Emulated kernels wait without the CPU: well below the step's wall time.
        assert sorted(record["cpu"][variant])[0] < times[0], variant
    assert 0 < record["host_busy"] <= 1


def test_dilation_grows_until_the_host_is_calm_enough():
    from tfoverlap.bench.dilation import next_dilation, parse_dilation
    assert next_dilation(4, 0.5) is None
    assert next_dilation(4, 0.95) == 16          # saturated: fourfold
    assert next_dilation(10, 0.9) == 20          # 10 x 0.9 / 0.45
    assert next_dilation(400, 0.99) is None      # the ceiling
    assert parse_dilation("auto", "v100") is None and parse_dilation("auto", "") == 1.0
    assert parse_dilation("12", "a100") == 12.0
    for text in ("0.5", "fast", "inf"):
        with pytest.raises(ValueError, match="--dilation"):
            parse_dilation(text, "v100")
    with pytest.raises(ValueError, match="neither a device model"):
        parse_dilation("auto", "tpu9")


def test_a_spinning_thread_is_moved_to_the_idle_class_and_sleeping_ones_are_not():
    """What the traced Horovod job does about Horovod's spinning timeline writer."""
    import os
    import threading
    import time
    from tfoverlap.bench.allreduce_worker import calm_timeline_writer
    stop, ids = threading.Event(), {}

    def spin():
        ids["spinner"] = threading.get_native_id()
        while not stop.is_set():
            pass

    def sleep():
        ids["sleeper"] = threading.get_native_id()
        stop.wait()

    threads = [threading.Thread(target=spin), threading.Thread(target=sleep)]
    for thread in threads:
        thread.start()
    try:
        time.sleep(0.1)
        assert calm_timeline_writer(window_seconds=0.5) == 1
        assert os.sched_getscheduler(ids["spinner"]) == os.SCHED_IDLE
        assert os.sched_getscheduler(ids["sleeper"]) == os.SCHED_OTHER
    finally:
        stop.set()
        for thread in threads:
            thread.join()


def test_emulated_timelines_are_drawn_in_emulated_time_under_the_emulated_link(
        tmp_path):
    """Dilation 4: a 10Gbit link shaped to 2.5 Gbit/s and a step of 2,187 ms of host time
    are drawn as the table gives them, a 10Gbit link and a step of 547 emulated ms."""
    config = ps.Configuration("resnet50", training=True, batch=64, bandwidth=1.25e9,
                              num_workers=4, emulate="v100", dilation=None)
    step = {"seconds": 2.187, "compute": [["conv", 187_000, 2_000_000]],
            "transfers": [["kernel", 0, 187_000, 1 << 20]]}
    result = {"dilation": 4.0, "traces": {"default": [[step]], "tic": [[step]]},
              "network": "5 network namespaces on one bridge, 2.5 Gbit/s tbf per link, "
                         "both directions"}
    figure = ps.plot_step_timelines(config, result, str(tmp_path / "timeline.png"))
    title = figure.get_suptitle()
    assert "emulated v100, 10Gbit links" in title and "dilation 4" in title
    panels = figure.get_axes()
    assert [panel.get_title(loc="left") for panel in panels] == [
        "default: step 547 ms", "tic: step 547 ms"]
    assert "dilation 4" in panels[-1].get_xlabel()
    low, high = panels[-1].get_xlim()
    assert low <= 0 and 2187 / 4 <= high < 2187 / 4 * 1.1
    assert (tmp_path / "timeline.png").stat().st_size > 10_000


def test_csv_rows_may_carry_fields_the_first_row_lacks(tmp_path):
    """A variant that deferred gradients says so in its row; the CSV keeps every field."""
    import csv
    from tfoverlap.bench.report import write_csv
    path = tmp_path / "rows.csv"
    write_csv([{"variant": "horovod", "median_s": 1.0},
               {"variant": "caramel", "median_s": 0.9, "deferred_gradients": 152}], str(path))
    with open(path) as stream:
        rows = list(csv.DictReader(stream))
    assert rows[0]["deferred_gradients"] == "" and rows[1]["deferred_gradients"] == "152"


#: what a stand-in coordinator does: die of a signal, exit with an error, answer ready
_SEGFAULT = "import os, signal; os.kill(os.getpid(), signal.SIGSEGV)"
_EXIT_1 = "raise SystemExit(1)"
_READY = "READY"


class _LauncherOfStandIns:
    """A network whose launcher host runs, instead of the coordinator, the i-th of
    ``programs`` at its i-th start."""

    def __init__(self, *programs):
        self.programs, self.starts = programs, 0

    def spawn_launcher(self, argv, **popen_kwargs):
        import subprocess
        import sys
        from tfoverlap.bench.ps_worker import ANSWER
        program = self.programs[self.starts]
        self.starts += 1
        if program == _READY:
            program = f"print({ANSWER + json.dumps({'ready': True, 'start': self.starts})!r})"
        return subprocess.Popen([sys.executable, "-c", program], **popen_kwargs)


def test_a_coordinator_killed_while_it_starts_is_started_once_more(tmp_path, capsys):
    """A coordinator that a signal killed during start-up (TensorFlow's, once, in CI) is
    started again, with a line saying so; one that is killed again, or that exits with an
    error code of its own, stops the run with its log named."""
    from tfoverlap.bench.ps_strategy import _start_coordinator
    from tfoverlap.testbed.network import NetworkError
    network = _LauncherOfStandIns(_SEGFAULT, _READY)
    _, _, ready = _start_coordinator(network, {}, str(tmp_path), timeout=60)
    assert ready == {"ready": True, "start": 2} and network.starts == 2
    assert "died of signal 11 while it started" in capsys.readouterr().err
    with pytest.raises(NetworkError, match="chief.2.log"):
        _start_coordinator(_LauncherOfStandIns(_SEGFAULT, _SEGFAULT), {}, str(tmp_path), 60)
    network = _LauncherOfStandIns(_EXIT_1, _READY)
    with pytest.raises(NetworkError, match="chief.log.*exited with code 1"):
        _start_coordinator(network, {}, str(tmp_path), 60)
    assert network.starts == 1


@pytest.mark.slow
def test_a_ps_strategy_benchmark_sees_the_planned_order_on_the_ps_tasks(tmp_path):
    """The TF2 job (loopback): a coordinator schedules a Keras model's step on 2 workers
    with their variables on 2 PS tasks, every variant in turns; the profiler captures on
    the PS tasks show TensorFlow's own read order far from TicTac's plan, and the serial
    plan (every read gated on the one before) followed exactly in every traced step."""
    from tfoverlap.bench import ps_strategy
    config = ps.Configuration("mobilenet_v2", training=True, batch=8, bandwidth=None,
                              num_ps=2, num_workers=2, layout="colocated", image_size=32)
    # One traced step per variant: each capture of a PS task takes 2-3 s more
    # than its steps, and one step per PS task already shows the default far from the plan
    # (concordance 0.36-0.69 a step; 0.46-0.55 over both tasks in 3 runs).
    result = ps_strategy.run_configuration(config, ("default", "tic_serial"), rounds=2,
                                           steps=1, traces=1, workdir=str(tmp_path / "work"),
                                           timeout=300, loopback=True)
    passes = result["passes"]["tic_serial"]
    assert passes["transfers"] > 100 and passes["ordering_edges"] > 0.95 * passes["transfers"]
    assert result["passes"]["default"]["transfers"] == 0      # no TfOverlap ordering there
    (planned,) = result["planned"]["tic_serial"].values()
    held = {task: {name for step in steps for name in step}
            for task, steps in result["traces"]["tic_serial"]["orders"].items()}
    # Each PS task reads its own variables, the two together every read that was planned.
    assert sorted(held) == ["ps0", "ps1"] and not held["ps0"] & held["ps1"]
    assert held["ps0"] | held["ps1"] == set(planned)
    rows = ps_strategy.summarize(result)
    assert [(row["variant"], row["api"], row["traced_steps"]) for row in rows] == [
        ("default", "ps_strategy", 1), ("tic_serial", "ps_strategy", 1)]
    assert rows[1]["order_concordance"] == 1.0
    assert rows[0]["order_concordance"] < 0.9
    for row in rows:
        assert row["steps"] == 2 and row["median_s"] > 0
        assert row["comm_s"] > 0 and row["comp_s"] > 0
    memory = result["memory"]
    assert len(memory["ps"]) == len(memory["worker"]) == 2
    table = report.markdown_table(rows)
    assert "| tic_serial |" in table and "1.00 of pairs as planned" in table


def test_order_concordance_counts_read_pairs_in_the_planned_order():
    from tfoverlap.bench.ps_strategy import order_concordance
    planned = ["a", "b", "c", "d"]
    assert order_concordance({"ps0": [["a", "c"], ["c", "a"]], "ps1": [["b", "d"]]},
                             planned) == 1.0
    assert order_concordance({"ps0": [["d", "c", "b", "a"]]}, planned) == 0.0
    assert order_concordance({"ps0": [["b", "a", "c", "d"]]}, planned) == pytest.approx(5 / 6)
    assert math.isnan(order_concordance({"ps0": []}, planned))
