"""Real local clusters: PS tasks as separate tf.distribute.Server processes on 127.0.0.1.

The worker server runs in the test process, so Grappler (and TfOverlap) runs in its master
here; the order is checked on the RecvTensor events the worker traced, step by step.
"""
import threading

import numpy as np
import pytest
import tensorflow as tf

import tfoverlap
from tfoverlap.testbed.cluster import LocalCluster
from tfoverlap.testbed.models import chain_model
from tfoverlap.costs.trace import observed_transfer_order

from helpers import SERIAL, latest_report_with_transfers, traced_run

STEPS = 20

pytestmark = pytest.mark.slow     # every test here starts PS tasks as processes


def kendall_tau(order, reference):
    position = {name: i for i, name in enumerate(order)}
    ranks = [position[name] for name in reference if name in position]
    concordant = discordant = 0
    for i in range(len(ranks)):
        for j in range(i + 1, len(ranks)):
            if ranks[i] < ranks[j]:
                concordant += 1
            else:
                discordant += 1
    return (concordant - discordant) / max(1, concordant + discordant)


def forward_order(model):
    """Source node of each layer's transfer, first layer first (as the worker sees them)."""
    names = []
    for layer in range(len(model.variables)):
        matmul = model.graph.get_operation_by_name("MatMul" + (f"_{layer}" if layer else ""))
        names.append(matmul.inputs[1].op.name)
    return names


def observed_orders(session, model, steps=STEPS, fetch=None):
    orders = []
    for _ in range(steps):
        _, metadata = traced_run(session, fetch if fetch is not None else model.loss)
        orders.append(observed_transfer_order(metadata))
    return orders


@pytest.fixture(scope="module")
def one_ps_cluster():
    with LocalCluster(num_ps=1, num_workers=1) as cluster:
        cluster.start_worker_in_process(0)
        yield cluster


@pytest.mark.parametrize("use_resource", [True, False], ids=["resource", "ref"])
def test_tic_order_is_observed_on_every_step(one_ps_cluster, use_resource):
    model = chain_model(16, width=256, batch=32, use_resource=use_resource)
    expected = forward_order(model)
    config = tfoverlap.session_config(schedule="tic", **SERIAL)
    with tf.compat.v1.Session(one_ps_cluster.target(), graph=model.graph, config=config) as s:
        s.run(model.init)
        s.run(model.loss)
        orders = observed_orders(s, model)
    assert all(len(order) == 16 for order in orders), orders[0]
    assert len({tuple(order) for order in orders}) == 1
    assert np.mean([kendall_tau(order, expected) for order in orders]) >= 0.95
    assert orders[0] == expected


def test_without_the_flag_the_order_changes_between_steps(one_ps_cluster):
    model = chain_model(16, width=256, batch=32)
    with tf.compat.v1.Session(one_ps_cluster.target(), graph=model.graph) as s:
        s.run(model.init)
        s.run(model.loss)
        orders = observed_orders(s, model)
    assert len({tuple(order) for order in orders}) > 1


def test_two_ps_tasks():
    with LocalCluster(num_ps=2, num_workers=1) as cluster:
        cluster.start_worker_in_process(0)
        model = chain_model(16, width=256, batch=32, num_ps=2)
        config = tfoverlap.session_config(schedule="tic", **SERIAL)
        with tf.compat.v1.Session(cluster.target(), graph=model.graph, config=config) as s:
            s.run(model.init)
            s.run(model.loss)
            orders = observed_orders(s, model)
    # Each PS task's link has its own window: the transfers from one task arrive in the
    # planned order every step, while the two links run side by side.
    task_of = {name: model.graph.get_operation_by_name(name).inputs[0].op.device
               for name in forward_order(model)}     # the read's variable's device
    tasks = sorted(set(task_of.values()))
    assert len(tasks) == 2
    for task in tasks:
        expected = [name for name in forward_order(model) if task_of[name] == task]
        assert len(expected) == 8
        for order in orders:
            assert [name for name in order if task_of.get(name) == task] == expected


def test_two_workers_each_observe_the_order():
    with LocalCluster(num_ps=1, num_workers=2) as cluster:
        for task in range(2):
            cluster.start_worker_in_process(task)
        results = {}

        def work(task):
            model = chain_model(16, width=256, batch=32, worker_device=f"/job:worker/task:{task}")
            config = tfoverlap.session_config(schedule="tic", **SERIAL)
            with tf.compat.v1.Session(cluster.target(task), graph=model.graph,
                                      config=config) as s:
                if task == 0:
                    s.run(model.init)
                else:
                    while not all(s.run(tf.compat.v1.is_variable_initialized(v))
                                  for v in model.variables):
                        pass
                s.run(model.loss)
                results[task] = (observed_orders(s, model, steps=10), forward_order(model))

        threads = [threading.Thread(target=work, args=(task,)) for task in range(2)]
        for thread in threads:
            thread.start()
        for thread in threads:
            thread.join(timeout=300)
    assert set(results) == {0, 1}
    for orders, expected in results.values():
        assert all(order == expected for order in orders)


def test_training_losses_are_equal_with_and_without_the_flag():
    losses = {}
    for schedule in ("off", "tic", "tac"):
        with LocalCluster(num_ps=1, num_workers=1) as cluster:
            cluster.start_worker_in_process(0)
            model = chain_model(8, width=64, batch=16, training=True, seed=3)
            config = (tf.compat.v1.ConfigProto() if schedule == "off"
                      else tfoverlap.session_config(schedule=schedule, **SERIAL))
            with tf.compat.v1.Session(cluster.target(), graph=model.graph, config=config) as s:
                s.run(model.init)
                losses[schedule] = [s.run([model.loss, model.train_op])[0] for _ in range(10)]
    assert losses["off"][0] > losses["off"][-1], "the model should learn"
    np.testing.assert_array_equal(losses["off"], losses["tic"])
    np.testing.assert_array_equal(losses["off"], losses["tac"])


def test_release_groups_arrive_group_by_group(one_ps_cluster):
    """Credit of two kernels, one group in flight: every transfer of group j + 1 arrives
    after every transfer of group j, each group gated by one IdentityN of the one before."""
    from tfoverlap.costs.trace import recv_events
    model = chain_model(16, width=256, batch=32)
    kernel = 256 * 256 * 4
    config = tfoverlap.session_config(schedule="tic", credit=2.5 * kernel, window=1, force=True)
    with tf.compat.v1.Session(one_ps_cluster.target(), graph=model.graph, config=config) as s:
        s.run(model.init)
        s.run(model.loss)
        arrivals = []
        for _ in range(5):
            _, metadata = traced_run(s, model.loss)
            arrivals.append({e.source: e.start_micros + e.duration_micros
                             for e in recv_events(metadata)
                             if e.bytes > 0 and "/job:worker/" in e.destination_device})
    _, entry = latest_report_with_transfers()
    (planned,) = entry.summary["order"].values()
    (sizes,) = entry.summary["release_groups"].values()
    assert sizes == [2] * 8 and entry.summary["gates"] == 7
    groups = [planned[k:k + 2] for k in range(0, 16, 2)]
    for arrived in arrivals:
        assert set(arrived) == set(planned)
        for earlier, later in zip(groups, groups[1:]):
            assert max(arrived[a] for a in earlier) < min(arrived[b] for b in later), (
                earlier, later, arrived)


def test_a_session_measures_its_ps_link_once_and_the_pass_plans_with_it(one_ps_cluster):
    """A TfOverlap session on a grpc target, bandwidth not given: the link to the PS task
    is measured before the session starts (once per process), and the plan says so."""
    from tfoverlap.costs.host import measured_links
    from tfoverlap.integrations import link_probe
    model = chain_model(4, width=64, batch=8)
    config = tfoverlap.session_config(schedule="tic", force=True, credit=0)
    with tf.compat.v1.Session(one_ps_cluster.target(), graph=model.graph, config=config) as s:
        s.run(model.init)
        s.run(model.loss)
    links = {d: v for d, v in measured_links().items()
             if d.startswith("/job:ps/replica:0/task:0")}
    assert len(links) == 1
    ((bandwidth, round_trip),) = links.values()
    assert bandwidth > 1e7 and round_trip > 0
    _, entry = latest_report_with_transfers()
    assert entry.summary["link"].endswith("(measured)")
    # A config that gives the bandwidth, or does not switch TfOverlap on, measures nothing.
    given = tfoverlap.session_config(schedule="tic", bandwidth="10Gbit")
    assert link_probe._wants_measurement(given) is None
    assert link_probe._wants_measurement(tf.compat.v1.ConfigProto()) is None
    assert link_probe._wants_measurement(config) == ["/job:ps"]
