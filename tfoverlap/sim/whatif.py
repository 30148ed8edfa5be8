"""The what-if entry: predict an iteration of a PS or Horovod graph under each algorithm."""
from __future__ import annotations

from tfoverlap.graph.devices import DeviceMatcher
from tfoverlap.costs.profile import Profile
from tfoverlap.graph.model import GraphModel
from tfoverlap.planning.caramel import ALLREDUCE_OP
from tfoverlap.sim.allreduce import ALLREDUCE_ALGORITHMS, predict_allreduce
from tfoverlap.sim.ps import PS_ALGORITHMS, predict_ps
from tfoverlap.sim.scenario import Prediction, Scenario, SimulationError

__all__ = ["Scenario", "Prediction", "SimulationError", "ALGORITHMS", "predict",
           "prune_to_fetches"]

ALGORITHMS = PS_ALGORITHMS


def prune_to_fetches(graph_def, fetches):
    """The part of ``graph_def`` that running ``fetches`` (node names) executes."""
    model = GraphModel.from_graph_def(graph_def)
    roots = []
    for name in fetches:
        node = model.index.get(name.split(":")[0].lstrip("^"))
        if node is None:
            raise SimulationError(f"fetch {name!r} is not a node of the graph")
        roots.append(node)
    keep = set(roots)
    stack = list(roots)
    while stack:
        for pred in model.predecessors(stack.pop()):
            if pred not in keep:
                keep.add(pred)
                stack.append(pred)
    pruned = type(graph_def)()
    pruned.versions.CopyFrom(graph_def.versions)
    pruned.library.CopyFrom(graph_def.library)
    pruned.node.extend(node for i, node in enumerate(graph_def.node) if i in keep)
    return pruned


def predict(graph_def, scenario: Scenario, algorithms=ALGORITHMS, profile: Profile | None = None,
            profile_path: str = "", fetches=()) -> list[Prediction]:
    """Predicted iteration time, comm, comp and bounds of each algorithm.

    ``fetches``: simulate only what running these nodes executes (default: the whole graph).
    """
    scenario.validate()
    if fetches:
        graph_def = prune_to_fetches(graph_def, fetches)
    if any(node.op == ALLREDUCE_OP for node in graph_def.node) and not any(
            DeviceMatcher(scenario.ps_devices)(node.device) for node in graph_def.node):
        unknown = [a for a in algorithms if a not in ALLREDUCE_ALGORITHMS]
        if unknown:
            raise SimulationError(f"{unknown[0]!r} does not apply to AllReduce (Horovod) "
                                  f"graphs; choose from {ALLREDUCE_ALGORITHMS}")
        return [predict_allreduce(graph_def, scenario, a, profile) for a in algorithms]
    unknown = [a for a in algorithms if a not in ALGORITHMS]
    if unknown:
        raise SimulationError(f"{unknown[0]!r} does not apply to parameter-server graphs; "
                              f"choose from {ALGORITHMS}")
    return predict_ps(graph_def, scenario, algorithms, profile, profile_path)
