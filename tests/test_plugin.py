"""The TfOverlap Grappler plugin in real sessions: it runs, its order is observed, it fails open."""
import logging
import textwrap

import pytest
import tensorflow as tf

import tfoverlap
from tfoverlap.passes import pipeline
from tfoverlap.passes.base import PassResult
from tfoverlap.integrations.grappler import library_path
from tfoverlap.testbed.models import chain_model

from helpers import (LOCAL_PS, SERIAL, latest_report_with_transfers, local_config,
                     observed_local_order, run_python, traced_run)


def local_chain(**kwargs):
    return chain_model(num_layers=8, width=128, batch=32, ps_devices=[LOCAL_PS],
                       worker_device="/device:CPU:0", **kwargs)


@pytest.mark.parametrize("use_resource", [True, False], ids=["resource", "ref"])
def test_session_with_flag_observes_the_planned_order(use_resource):
    model = local_chain(use_resource=use_resource)
    config = local_config(schedule="tic", **SERIAL)
    with tf.compat.v1.Session(graph=model.graph, config=config) as sess:
        sess.run(model.init)
        observed = []
        for _ in range(5):
            _, metadata = traced_run(sess, model.loss)
            _, entry = latest_report_with_transfers()
            (planned,) = entry.summary["order"].values()
            observed.append(observed_local_order(metadata, planned))
    assert entry.summary["transfers"] == 8
    assert entry.summary["ordering_edges"] == 7
    assert all(order == planned for order in observed), (planned, observed)
    # TIC on a chain: the first layer's parameter first.
    first_layer_read = model.graph.get_operation_by_name(
        "MatMul").inputs[1].op.name
    assert planned[0] == first_layer_read


def test_flag_does_not_change_results():
    model = local_chain()
    values = []
    for config in (local_config(), local_config(schedule="tic", **SERIAL),
                   local_config(schedule="tac", **SERIAL)):
        with tf.compat.v1.Session(graph=model.graph, config=config) as sess:
            sess.run(model.init)
            values.append(sess.run(model.loss))
    assert values[0] == values[1] == values[2]


def broken_pass(graph_def, context):
    raise RuntimeError("broken on purpose")


def cycle_pass(graph_def, context):
    graph_def_with_cycle = type(graph_def)()
    graph_def_with_cycle.CopyFrom(graph_def)
    first, second = graph_def_with_cycle.node[-1], graph_def_with_cycle.node[-2]
    first.input.append("^" + second.name)
    second.input.append("^" + first.name)
    return PassResult(graph_def_with_cycle, modified=True)


@pytest.mark.parametrize("bad_pass, reason", [(broken_pass, "broken on purpose"),
                                              (cycle_pass, "cycle")])
def test_failing_pass_warns_and_leaves_the_graph(monkeypatch, caplog, bad_pass, reason):
    monkeypatch.setattr(pipeline, "select_passes", lambda options: [("bad", bad_pass)])
    model = local_chain()
    with tf.compat.v1.Session(graph=model.graph, config=local_config()) as sess:
        sess.run(model.init)
        expected = sess.run(model.loss)
    caplog.set_level(logging.WARNING, logger="tfoverlap")
    with tf.compat.v1.Session(graph=model.graph, config=local_config(schedule="tic")) as sess:
        sess.run(model.init)
        assert sess.run(model.loss) == expected
    warnings = [r.getMessage() for r in caplog.records if r.name == "tfoverlap"]
    assert any("pass 'bad' failed" in w and reason in w for w in warnings), warnings
    assert tfoverlap.recent_reports()[-1].reverted


def test_strict_mode_raises_offline_and_reports_an_error_to_grappler():
    model = local_chain()
    graph_def = model.graph.as_graph_def()
    with pytest.raises(tfoverlap.PassFailure, match="broken on purpose"):
        import tfoverlap.passes.pipeline as pipeline
        original = pipeline.select_passes
        pipeline.select_passes = lambda options: [("bad", broken_pass)]
        try:
            tfoverlap.optimize(graph_def, strict=True)
        finally:
            pipeline.select_passes = original
    # In a session, strict mode turns the failure into an error status of the optimizer,
    # which TensorFlow reports (it keeps the unoptimized graph: training still runs).
    result = run_python(textwrap.dedent("""
        import tensorflow as tf, tfoverlap
        from tfoverlap.passes import pipeline as passes
        def broken(graph_def, context):
            raise RuntimeError("broken on purpose")
        passes.select_passes = lambda options: [("bad", broken)]
        graph = tf.Graph()
        with graph.as_default():
            out = tf.reduce_sum(tf.ones([4, 4]) * 3.0)
        config = tfoverlap.session_config(strict=True)
        with tf.compat.v1.Session(graph=graph, config=config) as sess:
            print("value", sess.run(out))
    """))
    assert result.returncode == 0, result.stderr[-2000:]
    assert "value 48.0" in result.stdout
    assert "TfOverlap failed: INTERNAL: tfoverlap pass 'bad' failed: RuntimeError: broken on " \
        "purpose" in result.stderr


def test_an_unwritable_report_dir_is_a_warning_and_the_rewrite_stands(tmp_path, caplog):
    blocked = tmp_path / "a-file-not-a-directory"
    blocked.write_text("")
    model = local_chain()
    caplog.set_level(logging.WARNING, logger="tfoverlap")
    config = local_config(schedule="tic", report_dir=str(blocked / "reports"), **SERIAL)
    with tf.compat.v1.Session(graph=model.graph, config=config) as sess:
        sess.run(model.init)
        sess.run(model.loss)
    _, entry = latest_report_with_transfers()
    assert entry.summary["ordering_edges"] == 7
    assert any(r.modified for r in tfoverlap.recent_reports()[-2:])   # Grappler's 2 rounds
    warnings = [r.getMessage() for r in caplog.records if r.name == "tfoverlap"]
    assert any("cannot write reports" in w and "the rewrite stands" in w for w in warnings)


def test_loading_twice_and_a_second_copy_do_not_abort(tmp_path):
    copy = tmp_path / "copy_of_plugin.so"
    copy.write_bytes(open(library_path(), "rb").read())
    result = run_python(textwrap.dedent(f"""
        import tensorflow as tf, tfoverlap
        tfoverlap.load(); tfoverlap.load()
        tf.load_library({library_path()!r})
        tf.load_library({str(copy)!r})
        print("still alive", tfoverlap.session_config(schedule="tic").graph_options
              .rewrite_options.custom_optimizers[0].name)
    """))
    assert result.returncode == 0, result.stderr[-2000:]
    assert "still alive TfOverlap" in result.stdout


def test_tf_function_path_runs_the_pass_and_orders_reads():
    result = run_python(textwrap.dedent("""
        import tensorflow as tf
        cpu = tf.config.list_physical_devices("CPU")[0]
        tf.config.set_logical_device_configuration(
            cpu, [tf.config.LogicalDeviceConfiguration()] * 2)
        import tfoverlap
        from tensorflow.python.eager import context
        with tf.device("/device:CPU:1"):
            kernels = [tf.Variable(tf.random.stateless_normal([64, 64], seed=[i, 0]) * 0.1)
                       for i in range(6)]

        @tf.function
        def forward(x):
            for kernel in kernels:
                with tf.device("/device:CPU:0"):
                    x = tf.nn.relu(tf.matmul(x, kernel))
            return tf.reduce_sum(x)

        x = tf.ones([8, 64])
        with tfoverlap.tf_function_options(schedule="tic", ps_devices="/device:CPU:1",
                                           credit=0, window=1, force=True):
            value = forward(x).numpy()
        reports = [r for r in tfoverlap.recent_reports()
                   if any(p.summary.get("transfers") for p in r.passes)]
        summary = reports[-1].passes[0].summary
        print("transfers", summary["transfers"], "edges", summary["ordering_edges"])
        plain = tf.function(forward.python_function)(x).numpy()
        print("equal", value == plain)
    """))
    assert result.returncode == 0, result.stderr[-3000:]
    assert "transfers 6 edges 5" in result.stdout, result.stdout + result.stderr[-3000:]
    assert "equal True" in result.stdout
