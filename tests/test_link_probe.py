"""The PS link probe that runs when a TfOverlap session starts: it never makes a session
wait for what plain TensorFlow would not, it remembers what it could not measure, and it
rejects figures that no link can have."""
import textwrap
import time

import pytest
import tensorflow as tf

import tfoverlap
from tfoverlap.costs.host import link_failures, measured_links
from tfoverlap.integrations import link_probe
from tfoverlap.options import parse_options
from tfoverlap.planning.tictac import link_figures
from tfoverlap.testbed.cluster import LocalCluster


def test_equal_times_are_rejected_not_taken_as_terabytes_per_second():
    with pytest.raises(link_probe.ImplausibleLink, match="no longer"):
        link_probe.link_from_timings(4 * 2 ** 20, smaller_s=0.002, larger_s=0.002)
    with pytest.raises(link_probe.ImplausibleLink, match="Gbit/s, more than"):
        link_probe.link_from_timings(4 * 2 ** 20, smaller_s=0.002, larger_s=0.00201)


def test_the_probes_own_work_is_not_counted_as_transfer_time():
    # 4 MiB more: 10 ms longer, of which 4 ms the same work took on the worker alone
    bandwidth = link_probe.link_from_timings(4 * 2 ** 20, smaller_s=0.011, larger_s=0.021,
                                             local_smaller_s=0.004, local_larger_s=0.008)
    assert bandwidth == pytest.approx(4 * 2 ** 20 / 0.006)
    # all of the extra time was the work: nothing left for the link
    with pytest.raises(link_probe.ImplausibleLink):
        link_probe.link_from_timings(4 * 2 ** 20, 0.011, 0.015, 0.004, 0.0081)


def test_the_fastest_round_is_the_links_rate_when_other_workers_probe_at_once():
    """Four rounds of a 4 MiB difference: in three another worker's probe shared the link
    (twice the time), in one it did not; the link's own rate is that round's."""
    extra = 4 * 2 ** 20
    alone, shared = 0.010, 0.020
    rounds = [(0.011, 0.011 + shared + 0.002, 0.004, 0.006)] * 3 + [
        (0.011, 0.011 + alone + 0.002, 0.004, 0.006)]
    assert link_probe.link_from_rounds(extra, rounds) == pytest.approx(extra / alone)
    with pytest.raises(link_probe.ImplausibleLink):
        link_probe.link_from_rounds(extra, [(0.011, 0.011, 0.004, 0.006)] * 3)


@pytest.mark.slow
def test_a_probe_that_cannot_measure_is_remembered_and_the_plan_says_why(monkeypatch):
    """A graph on a PS task that never started: the probe gives up within its time, the
    next session start does not probe again, and TicTac's link line says why it assumed."""
    from tfoverlap.costs import host
    monkeypatch.setattr(host, "_links", {})           # what earlier tests measured
    monkeypatch.setattr(host, "_link_failures", {})
    with LocalCluster(num_ps=1, num_workers=1) as cluster:
        cluster.spec["ps"].append(f"127.0.0.1:{_unused_port()}")    # ps task 1: never up
        cluster.start_worker_in_process(0)
        graph = tf.Graph()
        with graph.as_default():
            with tf.device("/job:ps/task:1"):
                value = tf.Variable(1.0)
            with tf.device("/job:worker/task:0"):
                tf.identity(value)
        config = tfoverlap.session_config(schedule="tic")
        began = time.monotonic()
        link_probe._measure_for_session(cluster.target(), graph, config, seconds=2.0)
        assert time.monotonic() - began < 2.0 + 1.0
        dead = "/job:ps/replica:0/task:1/device:CPU:0"
        assert link_failures()[dead].startswith("probe timed out")
        assert dead not in measured_links()
        began = time.monotonic()
        link_probe._measure_for_session(cluster.target(), graph, config, seconds=2.0)
        assert time.monotonic() - began < 0.5
    bandwidth, _, source = link_figures(parse_options({"ps_devices": "/job:ps/task:1"}),
                                        {"/job:ps/task:1"})
    assert source.startswith("assumed; probe timed out")


def _unused_port() -> int:
    import socket
    with socket.socket() as probe:
        probe.bind(("127.0.0.1", 0))
        return probe.getsockname()[1]


_FILTERED_WORKER = textwrap.dedent("""
    import json, sys, time
    import tensorflow as tf
    import tfoverlap
    from tfoverlap.testbed.models import chain_model
    spec, variant = json.loads(sys.argv[1]), sys.argv[2]
    config = tf.compat.v1.ConfigProto(device_filters=["/job:ps", "/job:worker/task:0"])
    server = tf.distribute.Server(tf.train.ClusterSpec(spec), job_name="worker",
                                  task_index=0, config=config, start=True)
    if variant == "tfoverlap":
        config = tfoverlap.session_config(config, schedule="tic")
    model = chain_model(4, width=64, batch=8)
    began = time.monotonic()
    with tf.compat.v1.Session(server.target, graph=model.graph, config=config) as session:
        session.run(model.init)
        for _ in range(3):
            session.run(model.fetch)
    print("seconds", time.monotonic() - began)
""")


@pytest.mark.slow
def test_a_worker_that_filters_its_devices_starts_while_another_worker_is_down(tmp_path):
    """1 PS, 2 workers, worker 1 never started; worker 0 filters its devices (TensorFlow's
    advice for PS jobs). Plain TensorFlow trains; with TfOverlap it trains too, within a
    few seconds of plain TensorFlow's time."""
    import json
    import subprocess
    import sys
    with LocalCluster(num_ps=1, num_workers=2) as cluster:
        seconds = {}
        for variant in ("plain", "tfoverlap"):
            result = subprocess.run(
                [sys.executable, "-c", _FILTERED_WORKER, json.dumps(cluster.spec), variant],
                capture_output=True, text=True, timeout=90)
            assert result.returncode == 0, result.stderr[-2000:]
            seconds[variant] = float(result.stdout.split("seconds")[-1])
    assert seconds["tfoverlap"] < seconds["plain"] + link_probe.PROBE_SECONDS, seconds


def test_a_link_the_probe_could_not_measure_is_not_taken_as_fast_as_one_it_did(monkeypatch):
    """A PS task on the worker's own host measured at loopback speed, the others out of
    time: the plan takes no more than the assumed 1 Gbit/s, and says why."""
    from tfoverlap.costs import host
    monkeypatch.setattr(host, "_links", {})
    monkeypatch.setattr(host, "_link_failures", {})
    host.record_link("/job:ps/replica:0/task:0/device:CPU:0", 1e9, 1e-4)      # 8 Gbit/s
    host.record_link_failure("/job:ps/replica:0/task:1/device:CPU:0", "probe timed out")
    bandwidth, _, source = link_figures(parse_options({}), {"/job:ps/task:0", "/job:ps/task:1"})
    assert bandwidth == 125e6
    assert source.startswith("measured for 1 of 2 PS tasks") and "timed out" in source
    bandwidth, _, source = link_figures(parse_options({}), {"/job:ps/task:0"})
    assert (bandwidth, source) == (1e9, "measured")


def test_workers_that_start_together_probe_different_ps_tasks_first():
    """8 workers, 8 PS tasks: in each turn of the probe every PS task is probed by one
    worker, not all eight by worker 0's first; each worker's own index comes last, and
    task 10 sorts after task 2."""
    tasks = [f"/job:ps/replica:0/task:{index}" for index in range(8)]
    orders = [link_probe.probe_order(list(reversed(tasks)), worker) for worker in range(8)]
    for turn in range(8):
        assert sorted(order[turn] for order in orders) == tasks
    assert [order[-1] for order in orders] == tasks
    many = [f"/job:ps/replica:0/task:{index}" for index in (10, 2, 1)]
    assert link_probe.probe_order(many, None) == [many[2], many[1], many[0]]
    assert link_probe.probe_order(many, 1) == [many[0], many[2], many[1]]


def test_the_ps_task_on_the_workers_own_host_is_not_probed(monkeypatch):
    """TF_CONFIG puts PS task 1 on worker 1's host: its bytes never cross the host's link,
    so the probe leaves it out and measures the others from task 2 on."""
    import json
    from tfoverlap.costs import host
    monkeypatch.setattr(host, "_links", {})
    monkeypatch.setattr(host, "_link_failures", {})
    monkeypatch.setenv("TF_CONFIG", json.dumps({
        "cluster": {"worker": [f"10.7.0.{i}:2222" for i in range(3)],
                    "ps": [f"10.7.0.{i}:2223" for i in range(3)]},
        "task": {"type": "worker", "index": 1}}))
    asked = []

    def measured(target, tasks, worker_device, config, deadline, on_result):
        asked.extend(tasks)
        for task in tasks:
            on_result(task, (1e9, 1e-4))
    monkeypatch.setattr(link_probe, "measure_ps_links", measured)
    tasks = [f"/job:ps/replica:0/task:{index}" for index in range(3)]
    graph = tf.Graph()
    with graph.as_default():
        values = []
        for task in tasks:
            with tf.device(task):
                values.append(tf.Variable(1.0))
        with tf.device("/job:worker/replica:0/task:1"):
            tf.add_n(values)
    link_probe._measure_for_session("grpc://10.7.0.1:2222", graph,
                                    tfoverlap.session_config(schedule="tic"), seconds=2.0)
    assert asked == [tasks[2], tasks[0]]
    assert sorted(host.measured_links()) == [link_probe._link_device(t) for t in asked[::-1]]


@pytest.mark.slow
def test_many_ps_tasks_share_the_probes_time():
    """Three PS tasks and rounds enough to take the whole time for the first: each task
    gets its part, so every link is measured and the probe ends in time."""
    with LocalCluster(num_ps=3, num_workers=1) as cluster:
        cluster.start_worker_in_process(0)
        tasks = [f"/job:ps/replica:0/task:{index}" for index in range(3)]
        began = time.monotonic()
        results = link_probe.measure_ps_links(
            cluster.target(), tasks, "/job:worker/replica:0/task:0/device:CPU:0",
            deadline=began + 6.0, probe_bytes=4 * 2 ** 20, repeats=1000)
        took = time.monotonic() - began
    assert took < 6.0 + 1.0
    assert all(isinstance(results[task], tuple) for task in tasks), results


def test_a_dilated_testbed_gives_the_probe_dilated_time():
    """The testbed slows its links by the dilation option, so the probe's time grows with
    it; without the option, or with a bad one (the pass reports it), it is the plain time."""
    dilated = tfoverlap.session_config(schedule="tic", dilation=100)
    assert link_probe.probe_seconds(dilated) == 100 * link_probe.PROBE_SECONDS
    assert link_probe.probe_seconds(tfoverlap.session_config(schedule="tic")) == \
        link_probe.PROBE_SECONDS
    dilated.graph_options.rewrite_options.custom_optimizers[0].parameter_map[
        "dilation"].f = 0.5
    assert link_probe.probe_seconds(dilated) == link_probe.PROBE_SECONDS
    assert link_probe.probe_seconds(None, 2.0) == 2.0
