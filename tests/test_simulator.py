"""The discrete-event simulator on tiny literal problems, and its bounds on random ones."""
import numpy as np
import pytest
from hypothesis import given, settings, strategies as st

from tfoverlap.costs.network import ring_allreduce_seconds
from tfoverlap.sim.engine import (COLLECTIVE, COMPUTE, TRANSFER, Problem, lower_bound,
                                 serial_sum, simulate)


def problem(tasks, edges=(), threads=(1,), channels=((0, 1),), bandwidth=100.0,
            latency=0.0, priority=None):
    """tasks: [(kind, resource, work)]; two hosts by default, one channel 0 -> 1."""
    successors = [[] for _ in tasks]
    for before, after in edges:
        successors[before].append(after)
    hosts = 1 + max([h for channel in channels for h in channel] + [0])
    return Problem(kind=np.array([t[0] for t in tasks], np.int8),
                   resource=np.array([t[1] for t in tasks]),
                   work=np.array([t[2] for t in tasks], float), successors=successors,
                   priority=np.array(priority if priority is not None else range(len(tasks)),
                                     float),
                   threads=list(threads), channels=list(channels),
                   egress=np.full(hosts, bandwidth), ingress=np.full(hosts, bandwidth),
                   latency=latency)


def test_compute_chain_and_parallel_threads():
    chain = problem([(COMPUTE, 0, 1.0), (COMPUTE, 0, 2.0)], edges=[(0, 1)])
    assert simulate(chain).makespan == pytest.approx(3.0)
    parallel = problem([(COMPUTE, 0, 1.0), (COMPUTE, 0, 2.0)], threads=(2,))
    assert simulate(parallel).makespan == pytest.approx(2.0)
    one_thread = problem([(COMPUTE, 0, 1.0), (COMPUTE, 0, 2.0)], threads=(1,))
    assert simulate(one_thread).makespan == pytest.approx(3.0)


def test_transfers_on_one_channel_go_one_at_a_time_in_priority_order():
    tasks = [(TRANSFER, 0, 100.0), (TRANSFER, 0, 300.0)]
    schedule = simulate(problem(tasks, priority=[1, 0], latency=0.5))
    assert schedule.start[1] == 0.0 and schedule.end[1] == pytest.approx(3.5)
    assert schedule.start[0] == pytest.approx(3.5) and schedule.end[0] == pytest.approx(5.0)


def test_large_transfers_interleave_in_chunks():
    tasks = [(TRANSFER, 0, 300.0), (TRANSFER, 0, 100.0)]
    whole = simulate(problem(tasks))
    assert list(whole.end) == pytest.approx([3.0, 4.0])
    chunked = problem(tasks)
    chunked.chunk_bytes = 100.0
    schedule = simulate(chunked)
    assert list(schedule.end) == pytest.approx([4.0, 2.0])
    assert list(schedule.start) == pytest.approx([0.0, 1.0])


def test_transfers_into_one_host_share_its_link():
    # Hosts 0 and 1 both send 100 bytes to host 2 over their own channels.
    tasks = [(TRANSFER, 0, 100.0), (TRANSFER, 1, 100.0)]
    schedule = simulate(problem(tasks, channels=((0, 2), (1, 2))))
    assert list(schedule.end) == pytest.approx([2.0, 2.0])
    # A transfer that starts later gets the full link once the first is done.
    tasks = [(TRANSFER, 0, 100.0), (TRANSFER, 1, 300.0)]
    schedule = simulate(problem(tasks, channels=((0, 2), (1, 2))))
    assert list(schedule.end) == pytest.approx([2.0, 4.0])


def test_compute_waits_for_its_transfer_and_collectives_serialize():
    tasks = [(TRANSFER, 0, 200.0), (COMPUTE, 0, 1.0), (COLLECTIVE, 0, 0.5),
             (COLLECTIVE, 0, 0.25)]
    schedule = simulate(problem(tasks, edges=[(0, 1), (1, 2), (1, 3)]))
    assert schedule.start[1] == pytest.approx(2.0)
    assert schedule.makespan == pytest.approx(3.75)
    assert ring_allreduce_seconds(1e6, 4, 1e6, 1e-3) == pytest.approx(1.5 + 0.006)
    assert ring_allreduce_seconds(1e6, 1, 1e6, 1e-3) == 0.0


def test_cycles_and_bad_numbers_are_refused():
    with pytest.raises(ValueError, match="cycle"):
        simulate(problem([(COMPUTE, 0, 1.0), (COMPUTE, 0, 1.0)], edges=[(0, 1), (1, 0)]))
    with pytest.raises(ValueError, match="non-negative"):
        simulate(problem([(COMPUTE, 0, -1.0)]))


@st.composite
def random_problems(draw):
    num_tasks = draw(st.integers(1, 25))
    num_hosts = draw(st.integers(2, 4))
    channels = [(s, d) for s in range(num_hosts) for d in range(num_hosts) if s != d]
    tasks = []
    for _ in range(num_tasks):
        kind = draw(st.sampled_from([COMPUTE, COMPUTE, TRANSFER, COLLECTIVE]))
        resource = draw(st.integers(0, (len(channels) if kind == TRANSFER else num_hosts) - 1))
        tasks.append((kind, resource, draw(st.floats(0.0, 5.0))))
    edges = [(a, b) for a in range(num_tasks) for b in range(a + 1, num_tasks)
             if draw(st.booleans()) and draw(st.booleans())]
    threads = [draw(st.integers(1, 3)) for _ in range(num_hosts)]
    priority = draw(st.permutations(range(num_tasks)))
    random_problem = problem(tasks, edges, threads, channels,
                             bandwidth=draw(st.floats(0.5, 4.0)),
                             latency=draw(st.floats(0.0, 0.1)), priority=priority)
    random_problem.chunk_bytes = draw(st.sampled_from([float("inf"), 0.5, 2.0]))
    return random_problem


@settings(max_examples=200, deadline=None)
@given(random_problems())
def test_simulated_time_lies_between_the_bounds(task_problem):
    makespan = simulate(task_problem).makespan
    assert lower_bound(task_problem) <= makespan * (1 + 1e-9) + 1e-9
    assert makespan <= serial_sum(task_problem) * (1 + 1e-9) + 1e-9


# ------------------------------------------------------------------ parameter-server graphs
LAYERS, WIDTH = 16, 512
KERNEL_BYTES = WIDTH * WIDTH * 4
LINK = 125e6          # 1 Gbit/s


@pytest.fixture(scope="module")
def chain_training():
    """TicTac's seq model, training, every kernel on one PS task: (graph_def, train op)."""
    from tfoverlap.testbed.models import chain_model
    model = chain_model(num_layers=LAYERS, width=WIDTH, num_ps=1, training=True)
    return model.graph.as_graph_def(), model.train_op.name


def chain_profile(graph_def, matmul_seconds: float):
    """Every MatMul (forward and gradient) takes ``matmul_seconds``; every kernel read
    moves KERNEL_BYTES."""
    from tfoverlap.costs.profile import Profile
    return Profile(op_seconds={n.name: matmul_seconds for n in graph_def.node if n.op == "MatMul"},
                   transfer_seconds={},
                   transfer_bytes={n.name: KERNEL_BYTES for n in graph_def.node
                                   if n.op == "ReadVariableOp"})


@pytest.mark.parametrize("workers", [4, 8])
def test_spread_variables_give_tictac_a_window_per_ps_task(chain_training, workers):
    from tfoverlap.sim.whatif import Scenario, predict
    graph_def, train = chain_training
    profile = chain_profile(graph_def, 0.008)
    scenario = Scenario(workers=workers, bandwidth=LINK, latency=0.0, ps_tasks=8)
    default, tic = predict(graph_def, scenario, ["default", "tic"], profile=profile,
                           fetches=[train])
    # The plan sees the kernels on 8 PS tasks, so each PS link keeps its own window of
    # release groups busy (one window over all eight links starved them: 1.5-2.5x slower).
    assert tic.iteration <= default.iteration * 1.03


def test_the_default_drifts_apart_where_a_ps_link_is_saturated(chain_training):
    from tfoverlap.sim.scenario import ALONE, DRIFTED, LOCK_STEP
    from tfoverlap.sim.whatif import Scenario, predict
    graph_def, train = chain_training
    pulls = LAYERS * KERNEL_BYTES / LINK      # one worker's pulls alone, as many pushes
    # No compute: four workers on one PS task keep each direction busier than one
    # worker's own step.
    default, tic = predict(graph_def, Scenario(workers=4, bandwidth=LINK, latency=0.0),
                           ["default", "tic"], fetches=[train])
    assert (default.phase, tic.phase) == (DRIFTED, LOCK_STEP)
    # Lock step: all four pull at a quarter of the link, then all four push.
    assert tic.iteration == pytest.approx(8 * pulls, rel=1e-3)
    # Drifted: the other three load each direction with 3 x pulls per step T on average,
    # the rest carries this worker's pulls and then its pushes: T = 2 pulls B / (B - 3
    # pulls B / T), so T = 5 pulls, and no shorter than 4 pulls (the busier direction).
    assert default.iteration == pytest.approx(5 * pulls, rel=2e-3)
    assert default.lower >= 4 * pulls * (1 - 1e-9)
    # Compute longer than the link's load per step: the default stays in lock step.
    busy = chain_profile(graph_def, 0.1)
    default, tic = predict(graph_def, Scenario(workers=4, bandwidth=LINK, latency=0.0),
                           ["default", "tic"], profile=busy, fetches=[train])
    assert (default.phase, tic.phase) == (LOCK_STEP, LOCK_STEP)
    alone = predict(graph_def, Scenario(workers=1, bandwidth=LINK, latency=0.0), ["default"],
                    fetches=[train])[0]
    assert alone.phase == ALONE and alone.iteration == pytest.approx(2 * pulls, rel=1e-3)


def test_simulate_prints_the_phases_and_the_best_variant(chain_training, tmp_path, capsys):
    from tfoverlap import cli
    from tfoverlap.costs.profile import save_profile
    graph_def, train = chain_training
    graph_path, profile_path = tmp_path / "chain.pb", tmp_path / "profile.json"
    graph_path.write_bytes(graph_def.SerializeToString())
    save_profile(chain_profile(graph_def, 0.008), str(profile_path))
    common = [str(graph_path), "--fetch", train, "--workers", "4", "--bandwidth", "1Gbit",
              "--latency-us", "0", "--algo", "default,tic"]
    assert cli.main(["simulate"] + common) == 0
    rows = capsys.readouterr().out.splitlines()
    assert rows[1].split()[-1] == "workers"
    assert [row.split()[0] for row in rows[2:]] == ["default", "tic"]
    assert [row.split(maxsplit=7)[-1] for row in rows[2:]] == ["drifted", "lock step"]
    assert cli.main(["simulate"] + common + ["--profile", str(profile_path),
                                             "--sweep", "ps=1,8"]) == 0
    rows = capsys.readouterr().out.splitlines()[1:3]
    for row, phases in zip(rows, ["drifted, lock step", "lock step, lock step"]):
        value, default, tic, gain, best, rest = row.split(maxsplit=5)
        times = {"default": float(default), "tic": float(tic)}
        assert best == min(times, key=times.get)
        assert float(gain.rstrip("x")) == pytest.approx(times["default"] / times[best], abs=0.01)
        assert rest == phases
    assert rows[1].split()[4] == "tic"     # 8 PS tasks: ordering hides the pulls


# ------------------------------------------------------------------ the colocated layout
def chain_scenario(workers, ps_tasks, layout):
    from tfoverlap.sim.whatif import Scenario
    return Scenario(workers=workers, bandwidth=LINK, latency=0.0, ps_tasks=ps_tasks,
                    layout=layout)


def test_a_colocated_worker_reaches_its_own_hosts_ps_task_off_the_link(chain_training):
    from tfoverlap.sim.scenario import ALONE
    from tfoverlap.sim.whatif import predict
    graph_def, train = chain_training
    kernel = KERNEL_BYTES / LINK
    profile = chain_profile(graph_def, 0.008)
    # One host: the worker and its PS task; nothing crosses a link.
    alone = predict(graph_def, chain_scenario(1, 1, "colocated"), ["default", "tic"],
                    profile=profile, fetches=[train])
    for prediction in alone:
        assert prediction.phase == ALONE and prediction.comm == pytest.approx(0.0, abs=1e-12)
        assert prediction.iteration == pytest.approx(prediction.comp)
    dedicated = predict(graph_def, chain_scenario(1, 1, "dedicated"), ["default"],
                        fetches=[train])[0]
    assert dedicated.iteration == pytest.approx(2 * LAYERS * kernel, rel=1e-3)
    # Two hosts, a PS task each: worker 0 moves only the other host's half of the kernels
    # over its link (full duplex: pulls, then pushes), at the whole link, no one else
    # pulling that shard over it.
    two = predict(graph_def, chain_scenario(2, 2, "colocated"), ["default", "tic"],
                  fetches=[train])
    for prediction in two:
        assert prediction.iteration == pytest.approx(LAYERS * kernel, rel=1e-3)
    two_dedicated = predict(graph_def, chain_scenario(2, 2, "dedicated"), ["tic"],
                            fetches=[train])[0]
    assert two_dedicated.iteration == pytest.approx(2 * LAYERS * kernel, rel=1e-3)


@pytest.mark.parametrize("workers", [4, 8])
def test_colocated_ps_links_are_shared_by_every_worker_but_their_hosts_own(chain_training,
                                                                          workers):
    from tfoverlap.sim.scenario import DRIFTED, LOCK_STEP
    from tfoverlap.sim.whatif import predict
    graph_def, train = chain_training
    kernel = KERNEL_BYTES / LINK
    shard = LAYERS // workers                 # kernels per PS task
    colocated = predict(graph_def, chain_scenario(workers, workers, "colocated"),
                        ["default", "tic"], fetches=[train])
    dedicated = predict(graph_def, chain_scenario(workers, workers, "dedicated"),
                        ["default", "tic"], fetches=[train])
    # Training on the colocated layout: ordered workers drift as the default's do, and
    # take the default's step (what the testbed measured at 4 and 8 hosts).
    assert colocated[1].phase == DRIFTED
    assert colocated[1].iteration == colocated[0].iteration
    assert colocated[1].transfers == dedicated[1].transfers     # the order is still planned
    for co, de in zip(colocated, dedicated):
        assert co.phase in (LOCK_STEP, DRIFTED) and de.phase == LOCK_STEP
        # Lock step, no compute: every other PS task's shard at 1/(workers - 1) of its
        # link, pulls then pushes: (workers - 1)/workers of the dedicated layout's step,
        # where workers share each PS link and the worker's own link carries everything.
        assert co.iteration == pytest.approx(2 * (workers - 1) * shard * kernel, rel=1e-3)
        assert de.iteration == pytest.approx(2 * LAYERS * kernel, rel=1e-3)


def test_a_colocated_host_link_carries_its_workers_and_its_shards_traffic(chain_training):
    from tfoverlap.sim import ps
    from tfoverlap.sim.whatif import prune_to_fetches
    graph_def, train = chain_training
    workers = 4
    spread = ps.spread_variables(prune_to_fetches(graph_def, [train]), "/job:ps", workers)
    scenario = chain_scenario(workers, 0, "colocated")
    graph = ps._PsGraph(spread, scenario, chain_profile(spread, 0.0))
    own = graph.ps_tasks.index("ps:0")
    assert graph.own == own and not graph.channels.count((own, graph.worker_host))
    shard = (LAYERS // workers) * KERNEL_BYTES
    assert graph.pull_bytes == pytest.approx([shard] * workers)
    assert graph.push_bytes == pytest.approx([shard] * workers)
    # No step is shorter than one host direction's bytes of both kinds: leaving a host,
    # its shard to the 3 other workers and its worker's 3 shards pushed to the others.
    assert ps._shortest_step(graph, scenario) == pytest.approx(6 * shard / LINK)
    step = 10 * shard / LINK
    links = ps._drifted_links(graph, scenario, step)
    remote = [k for k in range(workers) if k != own]
    # Another PS task's host: the 2 other workers pulling its shard, and its own worker's
    # pushes of 3 shards, leave it; that worker's pulls of 3 shards and the 2 other
    # workers' pushes enter it.
    assert links.egress[remote] == pytest.approx([LINK - (2 + 3) * shard / step] * 3)
    assert links.ingress[remote] == pytest.approx([LINK - (2 + 3) * shard / step] * 3)
    # The simulated worker's own host: the 3 others pull its shard out of it and push
    # their gradients into it, beside its own transfers.
    assert links.egress[graph.worker_host] == pytest.approx(LINK - 3 * shard / step)
    assert links.ingress[graph.worker_host] == pytest.approx(LINK - 3 * shard / step)
    dedicated = ps._drifted_links(graph, chain_scenario(workers, 0, "dedicated"), step)
    assert dedicated.egress[graph.worker_host] == LINK


def test_the_colocated_default_drifts_where_a_host_direction_is_saturated(chain_training):
    """Four workers, two of them beside a PS task: each shard's host sends it to three
    workers and its own worker's pushes, more than a worker's own step; the default
    drifts, and no step is shorter than that direction's bytes."""
    from tfoverlap.sim.scenario import DRIFTED
    from tfoverlap.sim.whatif import predict
    graph_def, train = chain_training
    kernel = KERNEL_BYTES / LINK
    default, tic = predict(graph_def, chain_scenario(4, 2, "colocated"), ["default", "tic"],
                           fetches=[train])
    # Ordered workers drift too (training, colocated) and take the default's step.
    assert (default.phase, tic.phase) == (DRIFTED, DRIFTED)
    busiest = (3 + 1) * (LAYERS // 2) * kernel
    assert default.lower >= busiest * (1 - 1e-9)
    assert busiest * (1 - 1e-9) <= default.iteration == tic.iteration


def test_the_contention_model_counts_a_colocated_hosts_two_kinds_of_traffic():
    from tfoverlap.costs.contention import predict_steps
    mb = 1e6
    per_task = {f"ps:{k}": 25 * mb for k in range(4)}
    colocated = predict_steps(per_task, per_task, workers=4, bandwidth=100 * mb,
                              forward_seconds=0.5, backward_seconds=1.0, own_task="ps:0")
    # Each phase: 3 x 25 MB leave every host (its shard) and enter it (its worker's
    # pulls); per step each direction carries both kinds, 150 MB.
    assert colocated.pull_seconds == colocated.push_seconds == pytest.approx(0.75)
    assert colocated.link_seconds == pytest.approx(1.5) and not colocated.saturated
    assert colocated.default == pytest.approx(0.75 + 0.5 + 1.0)
    # In lock step ordering would save the forward pass (0.75 + 1.0), but ordered workers
    # in colocated training drift as the default's do: ordering gains nothing.
    assert colocated.ordered_drifts and colocated.ordered == colocated.default
    assert colocated.gain == 0.0 and "drift apart too" in colocated.describe()
    # Inference pushes nothing: the ordered workers stay in step.
    inference = predict_steps(per_task, {}, workers=4, bandwidth=100 * mb,
                              forward_seconds=1.0, backward_seconds=0.0, own_task="ps:0")
    assert not inference.ordered_drifts
    assert inference.ordered == pytest.approx(1.0) and inference.gain > 0
    dedicated = predict_steps(per_task, per_task, workers=4, bandwidth=100 * mb,
                              forward_seconds=0.5, backward_seconds=1.0)
    assert dedicated.ordered == pytest.approx(2.0)
    # All the bytes on one PS task, beside worker 0: the other three workers' pulls and
    # pushes cross its host's link, and worker 0's none.
    alone = predict_steps({"ps:0": 100 * mb}, {"ps:0": 100 * mb}, workers=4,
                          bandwidth=100 * mb, forward_seconds=0.1, backward_seconds=0.2,
                          own_task="ps:0")
    assert alone.alone_seconds == pytest.approx(0.3)
    assert alone.saturated and alone.default_drift >= 3.0 * (1 - 1e-9)


def test_a_colocated_scenario_needs_a_worker_beside_every_ps_task(chain_training):
    from tfoverlap.sim.whatif import Scenario, SimulationError, predict
    graph_def, train = chain_training
    with pytest.raises(SimulationError, match="unknown layout"):
        predict(graph_def, Scenario(layout="shared"), fetches=[train])
    with pytest.raises(SimulationError, match="colocated layout"):
        predict(graph_def, chain_scenario(2, 4, "colocated"), fetches=[train])
    from tfoverlap.sim import ps
    spread = ps.spread_variables(graph_def, "/job:ps", 4)
    with pytest.raises(SimulationError, match="colocated layout"):
        predict(spread, chain_scenario(2, 0, "colocated"), fetches=[train])


def test_validation_compares_a_declined_pass_with_the_default():
    import importlib.util
    import os
    path = os.path.join(os.path.dirname(os.path.dirname(os.path.abspath(__file__))),
                        "scripts", "validate_simulator.py")
    spec = importlib.util.spec_from_file_location("validate_simulator", path)
    script = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(script)
    assert script.simulated_as("tic", {"ordering_edges": 21, "declined": ""}) == "tic"
    assert script.simulated_as("tic", {"ordering_edges": "0", "declined": "below"}) == "default"
    assert script.simulated_as("tac", {"ordering_edges": 0}) == "default"
    assert script.simulated_as("default_again", {}) == "default"
    assert script.simulated_as("tic", {}) == "tic"
    # Two workers' blocks of 2 steps: the first steps (9, 8) apart from the later (1, 3).
    assert script.block_steps([9.0, 1.0, 8.0, 3.0], [[5.0, 5.5]], 1.0) == "8.500 / 2.000"
    assert script.block_steps([1.0, 2.0], [[1.0, 2.0]], 1.0) == "1.500"
