"""Finding parameter transfers in a placed graph, structurally.

A transfer is a tensor produced on a parameter-server device and consumed on another
(worker) device: after partitioning it becomes a _Send/_Recv pair. Transfers are grouped
by (source node, destination device): TensorFlow sends one copy of a tensor per
destination device, and ordering acts on the source node.
"""
from __future__ import annotations

import dataclasses
from typing import Callable, Collection

from tfoverlap.graph.model import RESOURCE_HANDLE_OPS, GraphModel

__all__ = ["Transfer", "find_transfers"]

@dataclasses.dataclass(frozen=True)
class Transfer:
    """One parameter transfer.

    source:     node id on the PS device whose output(s) travel.
    slots:      which outputs of ``source`` travel to ``destination``.
    destination: the consuming device.
    consumers:  node ids on ``destination`` that read it directly.
    """

    source: int
    slots: tuple[int, ...]
    destination: str
    consumers: tuple[int, ...]


def find_transfers(model: GraphModel, devices: list[str],
                   is_ps_device: Callable[[str], bool],
                   ignore: Collection[int] = ()) -> list[Transfer]:
    """All PS-to-worker data edges, grouped by (source, destination device), in node order.

    ``devices`` are the nodes' devices as placed (see GraphModel.colocated_devices). A
    consumer counts if its device is not a PS device (an unplaced consumer, device "",
    counts as a worker: offline graphs are often placed only on the PS side). Consumers in
    ``ignore`` are not counted.
    """
    found: dict[tuple[int, str], tuple[dict, dict]] = {}
    for consumer in range(model.num_nodes):
        consumer_device = devices[consumer]
        if consumer in ignore or is_ps_device(consumer_device):
            continue
        for source, slot in model.data_inputs[consumer]:
            if model.ops[source] in RESOURCE_HANDLE_OPS or not is_ps_device(devices[source]):
                continue
            slots, consumers = found.setdefault((source, consumer_device), ({}, {}))
            slots[slot] = None
            consumers[consumer] = None
    return [Transfer(source=source, slots=tuple(sorted(slots)), destination=device,
                     consumers=tuple(consumers))
            for (source, device), (slots, consumers) in sorted(found.items())]
