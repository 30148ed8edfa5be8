"""The switch: configs, options validation, rewriter text."""

import pytest
import tensorflow as tf
from google.protobuf import text_format
from tensorflow.core.protobuf import rewriter_config_pb2

import tfoverlap
from tfoverlap.options import parse_bandwidth, parse_options


def test_session_config_adds_the_optimizer_with_options_and_copies_the_input():
    base = tf.compat.v1.ConfigProto(inter_op_parallelism_threads=3)
    config = tfoverlap.session_config(base, schedule="tac", window=2, bandwidth="1Gbit")
    assert base.graph_options.rewrite_options.custom_optimizers == []
    assert config.inter_op_parallelism_threads == 3
    (optimizer,) = config.graph_options.rewrite_options.custom_optimizers
    assert optimizer.name == "TfOverlap"
    assert optimizer.parameter_map["schedule"].s == b"tac"
    assert optimizer.parameter_map["window"].i == 2
    assert optimizer.parameter_map["bandwidth"].f == pytest.approx(1.25e8)


def test_session_config_replaces_an_earlier_tfoverlap_entry():
    first = tfoverlap.session_config(schedule="tic")
    second = tfoverlap.session_config(first, schedule="none")
    names = [c.name for c in second.graph_options.rewrite_options.custom_optimizers]
    assert names == ["TfOverlap"]
    assert second.graph_options.rewrite_options.custom_optimizers[0].parameter_map[
        "schedule"].s == b"none"


def test_rewriter_config_text_parses_back():
    text = tfoverlap.rewriter_config_text(schedule="tic", window=3)
    config = text_format.Parse(text, rewriter_config_pb2.RewriterConfig())
    assert config.custom_optimizers[0].name == "TfOverlap"
    assert config.custom_optimizers[0].parameter_map["window"].i == 3


@pytest.mark.parametrize("options, message", [
    ({"schedul": "tic"}, "unknown tfoverlap option 'schedul'"),
    ({"schedule": "fastest"}, "option 'schedule' must be one of"),
    ({"window": 0}, "option 'window' must be at least 1"),
    ({"workers": -1}, "option 'workers' must be 0 \\(ask TF_CONFIG\\) or more"),
    ({"gate": "sometimes"}, "option 'gate' must be one of"),
    ({"layout": "stacked"}, "option 'layout' must be one of"),
    ({"window": "two"}, "option 'window' must be an integer"),
    ({"window": 1.5}, "option 'window' must be an integer"),
    ({"bandwidth": -5}, "bandwidth must be positive"),
    ({"bandwidth": "10 furlongs"}, "bandwidth '10 furlongs' is not understood"),
    ({"strict": "maybe"}, "option 'strict' must be true or false"),
    ({"ps_devices": "ps"}, "is not a device spec"),
    ({"threads": -1}, "option 'threads' must be 0"),
    ({"cycle_ms": -2}, "option 'cycle_ms' must be non-negative"),
    ({"profile": "/nonexistent/profile.json"}, "does not exist"),
    ({"decouple": "sometimes"}, "option 'decouple' must be true, false or auto"),
    ({"cross_step": 2}, "option 'cross_step' must be true, false or auto"),
])
def test_bad_options_are_value_errors_naming_the_problem(options, message):
    with pytest.raises(ValueError, match=message):
        tfoverlap.session_config(**options)
    with pytest.raises(ValueError, match=message):
        tfoverlap.rewriter_config_text(**options)


@pytest.mark.parametrize("content, message", [
    ('{"format": "tfoverlap-profile", "version": 1, "op_sec', "corrupt or truncated"),
    ("[1, 2]", "not a tfoverlap profile"),
    ('{"format": "tfoverlap-profile", "version": 99}', "has version 99"),
    ('{"format": "tfoverlap-profile", "version": 1, "op_seconds": {"a": -1},'
     ' "transfer_seconds": {}, "transfer_bytes": {}}', "is not a non-negative number"),
    ('{"format": "tfoverlap-profile", "version": 1, "op_seconds": {}, "transfer_seconds": {},'
     ' "transfer_bytes": {}, "steps": [5]}', "steps = \\[5\\] is not a number of steps"),
    ('{"format": "tfoverlap-profile", "version": 1, "op_seconds": {}, "transfer_seconds": {},'
     ' "transfer_bytes": {}, "metadata": 3}', "'metadata' is not a table"),
])
def test_bad_profile_files_fail_at_config_time(tmp_path, content, message):
    path = tmp_path / "profile.json"
    path.write_text(content)
    with pytest.raises(ValueError, match=message):
        tfoverlap.session_config(schedule="tac", profile=str(path))


def test_parameter_map_values_of_any_kind_parse():
    options = parse_options({"window": "4", "strict": 1, "schedule": "TAC"})
    assert (options.window, options.strict, options.schedule) == (4, True, "tac")


@pytest.mark.parametrize("text, rate", [("100Mbit", 12.5e6), ("10Gbit", 1.25e9),
                                        ("125MB", 125e6), (2e6, 2e6), ("1e3", 1e3)])
def test_bandwidth_units(text, rate):
    assert parse_bandwidth(text) == pytest.approx(rate)


def test_grappler_sees_an_invalid_option_written_by_hand_and_keeps_the_graph(caplog):
    """A RewriterConfig written by hand bypasses session_config's validation."""
    config = tf.compat.v1.ConfigProto()
    optimizer = config.graph_options.rewrite_options.custom_optimizers.add(name="TfOverlap")
    optimizer.parameter_map["window"].i = 0
    graph = tf.Graph()
    with graph.as_default():
        out = tf.reduce_sum(tf.ones([3, 3]) * 2.0)
    caplog.set_level("WARNING", logger="tfoverlap")
    with tf.compat.v1.Session(graph=graph, config=config) as sess:
        assert sess.run(out) == 18.0
    assert any("option 'window' must be at least 1" in r.getMessage() for r in caplog.records)


def test_devices_match_field_by_field_everywhere():
    """task:1 is not task:10, in option specs and in traced device names alike."""
    from tensorflow.core.framework import step_stats_pb2
    from tfoverlap.costs.trace import op_durations
    from tfoverlap.graph.devices import DeviceMatcher
    matches = DeviceMatcher("/job:worker/task:1")
    assert matches("/job:worker/replica:0/task:1/device:CPU:0")
    assert not matches("/job:worker/replica:0/task:10/device:CPU:0")
    assert matches("/job:worker/replica:0/task:1/device:GPU:0/stream:all")
    stats = step_stats_pb2.StepStats()
    for task, name in ((1, "mine"), (10, "other")):
        device = stats.dev_stats.add(device=f"/job:worker/replica:0/task:{task}/device:CPU:0")
        device.node_stats.add(node_name=name, op_start_rel_micros=0, op_end_rel_micros=5)
    assert op_durations(stats, "/job:worker/task:1") == {"mine": 5}


@pytest.mark.parametrize("value, parsed", [("auto", "auto"), ("AUTO", "auto"), (True, True),
                                           ("false", False), (0, False)])
def test_the_horovod_modes_take_true_false_or_auto(value, parsed):
    from tfoverlap.options import parse_options
    assert parse_options({"decouple": value}).decouple == parsed
    assert parse_options({"cross_step": value}).cross_step == parsed
    tfoverlap.session_config(decouple=value, cross_step=value)     # the plugin takes them
