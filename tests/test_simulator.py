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
