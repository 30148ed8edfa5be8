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
