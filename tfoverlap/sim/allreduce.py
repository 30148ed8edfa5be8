"""What-if simulation of a Horovod graph: its AllReduce buckets on the ring model.

The buckets of Horovod's own fusion (``default``) or of Caramel's plan (``caramel``) are
reduced one after another, each ``2(n-1)/n * bytes / bandwidth + 2(n-1) * latency``.
``decoupled`` reduce-scatters Caramel's buckets under the backward pass and all-gathers
them under the next forward pass (:mod:`tfoverlap.planning.decoupled`), each half that.
"""
from __future__ import annotations

from tfoverlap.planning.caramel import bucket_problem, plan_allreduce
from tfoverlap.planning.decoupled import plan_decoupled
from tfoverlap.sim.engine import Problem, lower_bound, serial_sum, simulate
from tfoverlap.sim.scenario import Prediction, Scenario

__all__ = ["ALLREDUCE_ALGORITHMS", "predict_allreduce"]

ALLREDUCE_ALGORITHMS = ("default", "caramel", "decoupled")


def predict_allreduce(graph_def, scenario: Scenario, algorithm: str, profile) -> Prediction:
    """One iteration of a Horovod graph: the plan's buckets reduced one after another on
    Horovod's background thread, each a ring AllReduce over ``workers`` ranks."""
    op_seconds = profile.op_seconds if profile else {}
    network = (scenario.workers, scenario.bandwidth, scenario.latency)
    if algorithm == "decoupled":
        decoupled = plan_decoupled(graph_def, *network, op_seconds, scenario.threads)
        collectives = 2 * len(decoupled.buckets)

        def run(compute_scale: float = 1.0, collective_scale: float = 1.0) -> Problem:
            return decoupled.problem(op_seconds, scenario.workers, scenario.threads,
                                     compute_scale, collective_scale)
    else:
        plan = plan_allreduce(graph_def, algorithm, *network, op_seconds, scenario.threads)
        collectives = len(plan.buckets)

        def run(compute_scale: float = 1.0, collective_scale: float = 1.0) -> Problem:
            return bucket_problem(plan, op_seconds, *network, scenario.threads,
                                  compute_scale, collective_scale)

    problem = run()
    return Prediction(algorithm=algorithm, iteration=simulate(problem).makespan,
                      comm=simulate(run(compute_scale=0.0)).makespan,
                      comp=simulate(run(collective_scale=0.0)).makespan,
                      lower=lower_bound(problem), upper=serial_sum(problem),
                      transfers=collectives)
