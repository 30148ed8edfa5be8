"""TicTac's plan for a parameter-server graph: the transfers, their order, and the gates.

Per destination (worker) device: find the transfers, compute TIC or TAC's order
(:mod:`tfoverlap.schedulers.tictac`), then pick for the transfer at position k+window a
worker-side *gate* of the transfer at position k: an op on the worker that consumes that
transfer and needs no transfer ordered after it. The gate runs only once transfer k has
arrived, so at most ``window`` ordered transfers are outstanding; since each gate needs
only earlier transfers, the edges can never close a cycle.
"""
from __future__ import annotations

from tfoverlap.costs.network import estimate_transfer_seconds
from tfoverlap.costs.profile import ProfileError, load_profile
from tfoverlap.graph.devices import DeviceMatcher
from tfoverlap.graph.frames import ControlFlow, analysed
from tfoverlap.graph.model import GraphModel, output_dtype, tensor_bytes
from tfoverlap.graph.transfers import Transfer, find_transfers
from tfoverlap.log import warn_once
from tfoverlap.options import Options
from tfoverlap.rewriters.control_edges import ARRIVAL_ATTR, ARRIVAL_PREFIX, ArrivalNode
from tfoverlap.schedulers.tictac import group_dependency_sets, tac_order, tic_order

__all__ = ["plan_transfer_order", "dependency_bits"]


def dependency_bits(model: GraphModel, topological: list[int], transfers: list[Transfer],
                    at_source: bool = False) -> list[int]:
    """For every node, the bitset of transfers it needs, directly or transitively (with
    ``at_source``: the transfers whose source it follows, arrived or not)."""
    direct = [0] * model.num_nodes
    for index, transfer in enumerate(transfers):
        for consumer in ((transfer.source,) if at_source else transfer.consumers):
            direct[consumer] |= 1 << index
    bits = [0] * model.num_nodes
    for node in topological:
        value = direct[node]
        for pred in model.predecessors(node):
            value |= bits[pred]
        bits[node] = value
    return bits


class _Costs:
    """Transfer and compute times for TAC: the profile first, estimates for the rest."""

    def __init__(self, graph_def, model: GraphModel, options: Options):
        self.options = options
        self.profile = load_profile(self.options.profile) if self.options.profile else None
        self.graph_def, self.model = graph_def, model
        self.estimated_transfers = 0
        self.estimated_ops = 0

    def check_matches(self, transfers: list[Transfer]) -> None:
        if self.profile is None:
            return
        names = [self.model.names[t.source] for t in transfers]
        known = sum(name in self.profile.transfer_seconds for name in names)
        if known * 2 < len(names):
            raise ProfileError(
                f"profile {self.options.profile!r} does not match this graph: only {known} "
                f"of its {len(names)} transfers (e.g. {names[0]!r}) are in the profile; "
                "profile this model again")

    def transfer_seconds(self, transfer: Transfer) -> float:
        name = self.model.names[transfer.source]
        if self.profile is not None and name in self.profile.transfer_seconds:
            return self.profile.transfer_seconds[name]
        self.estimated_transfers += 1
        size = sum(tensor_bytes(self.graph_def, self.model, transfer.source, slot) or 0
                   for slot in transfer.slots) or None
        return estimate_transfer_seconds(size, self.options.bandwidth)

    def op_seconds(self, node: int) -> float:
        if self.profile is not None and self.model.names[node] in self.profile.op_seconds:
            return self.profile.op_seconds[self.model.names[node]]
        self.estimated_ops += 1
        return 0.0

    def note_estimates(self) -> None:
        if not (self.estimated_transfers or self.estimated_ops):
            return
        source = (f"profile {self.options.profile!r}" if self.profile is not None
                  else "no profile given")
        message = (f"tfoverlap: TAC {source}: estimated {self.estimated_transfers} transfer "
                   f"times from size/bandwidth and {self.estimated_ops} op times as zero")
        warn_once(message)


def _orderable(transfers: list[Transfer], flow: ControlFlow, model: GraphModel):
    """(the transfers an order may hold, {reason: [source names]} of the others).

    A transfer is ordered only if its PS-side source is a plain node (root frame, live in
    every step, not a Switch): its arrival (or any plain consumer) can then gate the next
    transfer, and the source can wait for a gate, without an edge that crosses a while
    loop or waits on a dead op.
    """
    kept, left_out = [], {}
    for transfer in transfers:
        if flow.is_plain(transfer.source):
            kept.append(transfer)
        else:
            reason = flow.why_not_plain(transfer.source)
            left_out.setdefault(reason, []).append(model.names[transfer.source])
    return kept, left_out


def plan_transfer_order(graph_def, options: Options):
    """What the TicTac pass enforces, without the rewrite (the CLI's ``schedule`` shows it).

    Returns (model, the transfers it orders, {destination: [transfer index in order]},
    [(gate name, source name)] edges, [ArrivalNode] new gate nodes, notes dict). Transfers
    inside control flow are left out of the order (``notes["transfers_left_out"]``).
    """
    model, flow = analysed(graph_def)
    is_ps = DeviceMatcher(options.ps_devices)
    devices = model.colocated_devices()
    # Arrival gates an earlier run left (Grappler preserves them) are not the model's ops.
    earlier_gates = {v for v in range(model.num_nodes) if ARRIVAL_ATTR in graph_def.node[v].attr}
    found = sorted(find_transfers(model, devices, is_ps, ignore=earlier_gates),
                   key=lambda t: (t.destination, t.source))
    if not found:
        return model, [], {}, [], [], {}
    destinations_of_source: dict[int, set[str]] = {}
    for transfer in found:
        destinations_of_source.setdefault(transfer.source, set()).add(transfer.destination)
    transfers, left_out = _orderable(found, flow, model)
    notes: dict = {}
    if left_out:
        notes["transfers_left_out"] = left_out
    if not transfers:
        return model, [], {}, [], [], notes
    topological = model.topological_order()
    position = [0] * model.num_nodes
    for rank, node in enumerate(topological):
        position[node] = rank
    bits = dependency_bits(model, topological, transfers)
    # A source downstream of another source (a PS-side chain) must be ordered after it:
    # gating the upstream one on the downstream one's arrival would close a cycle.
    upstream_sources = dependency_bits(model, topological, transfers, at_source=True)
    costs = _Costs(graph_def, model, options) if options.schedule == "tac" else None
    if costs is not None:
        costs.check_matches(transfers)

    orders: dict[str, list[int]] = {}
    edges: list[tuple[str, str]] = []
    arrivals: list[ArrivalNode] = []
    shared_sources = 0
    start = 0
    while start < len(transfers):
        destination = transfers[start].destination
        stop = start
        while stop < len(transfers) and transfers[stop].destination == destination:
            stop += 1
        local = transfers[start:stop]
        mask = (1 << (stop - start)) - 1

        def local_bits(node: int, start=start, mask=mask) -> int:
            return (bits[node] >> start) & mask

        def after_sources(node: int, start=start, mask=mask) -> int:
            return (upstream_sources[node] >> start) & mask

        ops = [v for v in range(model.num_nodes)
               if devices[v] == destination and v not in earlier_gates]
        op_bits = [local_bits(v) for v in ops]
        source_bits = [local_bits(t.source) | after_sources(t.source) for t in local]
        tiebreak = [min(position[c] for c in t.consumers) for t in local]
        if costs is None:
            sets = group_dependency_sets(op_bits, None, len(local))
            order = tic_order(sets, source_bits, tiebreak)
        else:
            sets = group_dependency_sets(op_bits, [costs.op_seconds(v) for v in ops], len(local))
            order = tac_order(sets, [costs.transfer_seconds(t) for t in local], source_bits,
                              tiebreak)
        orders[destination] = [start + t for t in order]

        # Gates: the earliest consumer of transfer order[k] that is a plain node and follows
        # no source ordered later, by any path (gate="consumer"), else an arrival node of it.
        allowed = 0
        gate_so_far: list[str | None] = []
        for k, t in enumerate(order):
            allowed |= 1 << t
            gate = None
            if options.gate == "consumer":
                valid = [c for c in local[t].consumers
                         if after_sources(c) & ~allowed == 0 and flow.is_plain(c)]
                if valid:
                    gate = model.names[min(valid, key=position.__getitem__)]
            source = graph_def.node[local[t].source]
            dtype = output_dtype(source)
            if gate is None and dtype is not None and k + options.window < len(order):
                slot = local[t].slots[0]
                arrival = ArrivalNode(
                    name=f"{ARRIVAL_PREFIX}{len(orders) - 1}/{source.name}",
                    tensor=source.name if slot == 0 else f"{source.name}:{slot}",
                    device=destination, dtype=dtype)
                arrivals.append(arrival)
                gate = arrival.name
            gate_so_far.append(gate if gate is not None else
                               (gate_so_far[-1] if gate_so_far else None))
        for k in range(options.window, len(order)):
            gate = gate_so_far[k - options.window]
            target = local[order[k]].source
            if gate is None:
                continue
            if len(destinations_of_source[target]) > 1:
                shared_sources += 1
                continue
            edges.append((gate, model.names[target]))
        start = stop

    if shared_sources:
        notes["sources_feeding_several_workers_not_gated"] = shared_sources
    if costs is not None:
        costs.note_estimates()
        notes["estimated_transfer_times"] = costs.estimated_transfers
        notes["estimated_op_times"] = costs.estimated_ops
    return model, transfers, orders, edges, arrivals, notes
