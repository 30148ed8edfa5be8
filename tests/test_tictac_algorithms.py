"""TIC and TAC on plain data: hand-made DAGs, brute force, a naive reference, properties."""
import itertools
import math
import random

import numpy as np
import pytest
from hypothesis import given, settings, strategies as st

from tfoverlap.schedulers.tictac import (group_dependency_sets, release_groups,
                                         release_groups_per_link, tac_order, tic_order,
                                         transfer_priorities)


def bits(*transfers):
    value = 0
    for t in transfers:
        value |= 1 << t
    return value


def chain_dependencies(num_layers):
    """Op k of a chain needs transfers 0..k."""
    return [bits(*range(k + 1)) for k in range(num_layers)]


def test_tic_orders_a_chain_front_to_back():
    sets = group_dependency_sets(chain_dependencies(6), None, 6)
    assert tic_order(sets) == [0, 1, 2, 3, 4, 5]


def test_tic_chain_order_ignores_transfer_numbering():
    # The chain's layers are numbered backwards: layer k needs transfer 5-k and earlier.
    deps = [bits(*[5 - j for j in range(k + 1)]) for k in range(6)]
    sets = group_dependency_sets(deps, None, 6)
    assert tic_order(sets) == [5, 4, 3, 2, 1, 0]


def test_tic_m_plus_of_parallel_branches_and_joins():
    # Branch A: ops need {0}, {0,1}; branch B: {2}; the join needs everything.
    deps = [bits(0), bits(0, 1), bits(2), bits(0, 1, 2)]
    min_plus, completing_set, min_any = transfer_priorities(
        group_dependency_sets(deps, None, 3))
    assert list(min_plus) == [2, 2, 3]
    assert completing_set[0] == completing_set[1] != completing_set[2]
    assert list(min_any) == [1, 2, 1]
    # 0 first (M+ 2, one op needs only it), then 1 (M+ 2), then 2 (M+ 3).
    assert tic_order(group_dependency_sets(deps, None, 3)) == [0, 1, 2]


def test_tic_keeps_the_kernels_of_a_parallel_branch_together():
    # TicTac's par model: branch b needs kernel 2b, then kernels 2b and 2b+1. Every
    # kernel has M+ 2; the branches' first layers must not all go before any second layer.
    num_branches = 4
    deps = []
    for branch in range(num_branches):
        deps += [bits(2 * branch), bits(2 * branch, 2 * branch + 1)]
    order = tic_order(group_dependency_sets(deps, None, 2 * num_branches))
    assert order == list(range(2 * num_branches))


def test_tic_respects_precedence_between_transfers():
    # Transfer 0's source depends on transfer 1 (bit 1), although 0 has better priority.
    deps = [bits(0), bits(0, 1), bits(1, 2)]
    order = tic_order(group_dependency_sets(deps, None, 3), source_dependencies=[bits(1), 0, 0])
    assert order.index(1) < order.index(0)


def flow_shop_makespan(order, transfer_times, compute_times):
    """One link sends transfers in order; op r (needing only transfer r) then computes."""
    link = compute = 0.0
    for r in order:
        link += transfer_times[r]
        compute = max(compute, link) + compute_times[r]
    return compute


@pytest.mark.parametrize("seed", range(25))
def test_tac_is_optimal_on_flow_shop_instances(seed):
    """When each op needs one transfer, TAC is Johnson's rule: optimal among all orders."""
    rng = random.Random(seed)
    num = rng.randint(2, 6)
    transfer_times = [rng.choice([1, 2, 3, 5, 8]) * 1.0 for _ in range(num)]
    compute_times = [rng.choice([1, 2, 3, 5, 8]) * 1.0 for _ in range(num)]
    sets = group_dependency_sets([bits(r) for r in range(num)], compute_times, num)
    order = tac_order(sets, transfer_times)
    best = min(flow_shop_makespan(p, transfer_times, compute_times)
               for p in itertools.permutations(range(num)))
    assert flow_shop_makespan(order, transfer_times, compute_times) == best


def naive_tac_order(op_dependencies, op_times, transfer_times, tiebreak):
    """TAC straight from the definition: recompute P, M, M+ over all ops for every pick."""
    outstanding = set(range(len(transfer_times)))
    order = []
    while outstanding:
        unblocked = {r: 0.0 for r in outstanding}
        min_plus = {r: math.inf for r in outstanding}
        for deps, seconds in zip(op_dependencies, op_times):
            waiting = [r for r in outstanding if deps >> r & 1]
            if len(waiting) == 1:
                unblocked[waiting[0]] += seconds
            elif len(waiting) > 1:
                cost = sum(transfer_times[r] for r in waiting)
                for r in waiting:
                    min_plus[r] = min(min_plus[r], cost)

        def key(r):
            if transfer_times[r] < unblocked[r]:
                return (0, transfer_times[r], min_plus[r], tiebreak[r], r)
            return (1, -unblocked[r], min_plus[r], tiebreak[r], r)
        picked = min(outstanding, key=key)
        order.append(picked)
        outstanding.remove(picked)
    return order


def random_layered_dag(rng, num_transfers, num_ops):
    """Dependency sets of a random DAG: each op needs a few transfers plus its parents' sets."""
    deps = []
    for op in range(num_ops):
        value = 0
        for _ in range(rng.randint(0, 2)):
            value |= 1 << rng.randrange(num_transfers)
        for parent in rng.sample(range(op), min(op, rng.randint(0, 2))):
            value |= deps[parent]
        deps.append(value)
    return deps


@pytest.mark.parametrize("seed", range(10))
def test_tac_matches_naive_recomputation_on_medium_graphs(seed):
    rng = random.Random(seed)
    num_transfers, num_ops = 40, 300
    deps = random_layered_dag(rng, num_transfers, num_ops)
    op_times = [rng.choice([0.0, 0.5, 1.0, 2.0, 4.0]) for _ in deps]
    transfer_times = [rng.choice([0.5, 1.0, 2.0, 3.0]) for _ in range(num_transfers)]
    tiebreak = list(range(num_transfers))
    sets = group_dependency_sets(deps, op_times, num_transfers)
    assert tac_order(sets, transfer_times, tiebreak=tiebreak) == naive_tac_order(
        deps, op_times, transfer_times, tiebreak)


@settings(max_examples=60, deadline=None)
@given(st.integers(1, 30), st.integers(0, 80), st.integers(0, 10_000), st.booleans())
def test_orders_are_permutations_that_respect_precedence(num_transfers, num_ops, seed, use_tac):
    rng = random.Random(seed)
    deps = random_layered_dag(rng, num_transfers, num_ops)
    # Random precedences that form a DAG: a transfer may only wait for lower-numbered ones.
    precedence = [bits(*rng.sample(range(t), min(t, rng.randint(0, 1))))
                  for t in range(num_transfers)]
    times = [rng.random() for _ in deps]
    sets = group_dependency_sets(deps, times, num_transfers)
    order = (tac_order(sets, [rng.random() + 0.1 for _ in range(num_transfers)], precedence)
             if use_tac else tic_order(sets, precedence))
    assert sorted(order) == list(range(num_transfers))
    position = {t: i for i, t in enumerate(order)}
    for t, blockers in enumerate(precedence):
        for b in range(num_transfers):
            if blockers >> b & 1:
                assert position[b] < position[t]


def test_precedence_cycle_is_reported():
    sets = group_dependency_sets([bits(0, 1)], None, 2)
    with pytest.raises(ValueError, match="cycle"):
        tic_order(sets, [bits(1), bits(0)])


def test_grouping_merges_equal_sets_and_drops_free_ops():
    sets = group_dependency_sets([bits(0), 0, bits(0), bits(1)], [1.0, 5.0, 2.0, 4.0], 2)
    rows = {tuple(row): c for row, c in zip(sets.matrix.tolist(), sets.compute.tolist())}
    assert rows == {(True, False): 3.0, (False, True): 4.0}
    assert np.asarray(sets.matrix).dtype == bool


def test_release_groups_fill_up_to_the_credit_and_a_large_transfer_goes_alone():
    assert release_groups([1, 1, 5, 1, 1, 1], credit=3) == [[0, 1], [2], [3, 4, 5]]
    assert release_groups([4, 4, 4], credit=8) == [[0, 1], [2]]
    assert release_groups([1, 2, 3], credit=0) == [[0], [1], [2]]
    assert release_groups([], credit=5) == []
    with pytest.raises(ValueError, match="credit must be non-negative"):
        release_groups([1], credit=-1)


def test_release_groups_per_link_cut_each_links_part_of_the_order():
    sizes = [1, 1, 5, 1, 1, 1]
    links = ["a", "b", "a", "a", "b", "b"]
    assert release_groups_per_link(sizes, links, credit=2) == [
        ("a", [[0], [2], [3]]), ("b", [[1, 4], [5]])]
    assert release_groups_per_link(sizes, ["a"] * 6, credit=3) == [
        ("a", release_groups(sizes, credit=3))]
    with pytest.raises(ValueError, match="one entry per transfer"):
        release_groups_per_link([1, 2], ["a"], credit=1)


@settings(max_examples=50, deadline=None)
@given(st.lists(st.integers(0, 100), max_size=30), st.integers(0, 150))
def test_release_groups_cover_the_order_once_and_respect_the_credit(sizes, credit):
    groups = release_groups(sizes, credit)
    assert [p for group in groups for p in group] == list(range(len(sizes)))
    for group, following in zip(groups, groups[1:]):
        assert len(group) == 1 or sum(sizes[p] for p in group) <= credit
        # The next transfer did not fit (else it would have joined).
        assert credit == 0 or sum(sizes[p] for p in group) + sizes[following[0]] > credit
    if credit == 0:
        assert len(groups) == len(sizes)
