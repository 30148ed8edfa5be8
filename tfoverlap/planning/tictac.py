"""TicTac's plan for a parameter-server graph: the transfers, their order, and the gates.

Per destination (worker) device: find the transfers, compute TIC or TAC's order
(:mod:`tfoverlap.schedulers.tictac`), cut each PS task's part of the order into *release
groups* of about ``credit`` bytes, and pick for its group j+window a worker-side *gate* of
its group j (each PS task's link has its own window): an op on
the worker that runs once every transfer of group j has arrived (an Identity, or an
IdentityN over the group) and needs no transfer ordered later. Every PS-side source of
group j+window waits for that gate. Each gate costs one control message per PS task and
step, so tiny tensors share one; while group j+1 is in flight the gate of group j
releases group j+2 (window 2), so the link does not idle across the gate's round trip.
Since each gate needs only earlier transfers, the edges can never close a cycle.
"""
from __future__ import annotations

import collections
import dataclasses
import hashlib

from tfoverlap.costs.contention import StepPrediction, predict_steps_for_compute
from tfoverlap.costs.host import (cluster_workers, colocated_ps_task, host_flops, link_failures,
                                 measured_links)
from tfoverlap.costs.network import estimate_transfer_seconds
from tfoverlap.costs.profile import ProfileError, load_profile
from tfoverlap.costs.static import static_costs
from tfoverlap.graph.devices import DeviceMatcher, parse_device_spec, task_of
from tfoverlap.graph.frames import ControlFlow, analysed
from tfoverlap.graph.model import GraphModel, edge_bytes, output_dtype, tensor_bytes
from tfoverlap.planning.emulation import emulated_op_seconds
from tfoverlap.graph.transfers import Transfer, find_transfers
from tfoverlap.log import warn_once
from tfoverlap.options import DEFAULT_BANDWIDTH, Options
from tfoverlap.rewriters.control_edges import ARRIVAL_ATTR, ARRIVAL_PREFIX, ArrivalNode
from tfoverlap.schedulers.tictac import (group_dependency_sets, release_groups_per_link,
                                         tac_order, tic_order)

__all__ = ["TransferPlan", "plan_transfer_order", "dependency_bits", "link_figures",
           "credit_bytes", "GainEstimate", "estimate_gain", "MOST_GATES_PER_STEP",
           "DECISION_MARGIN"]

#: credit="auto" makes groups large enough that a step pays at most about this many gates.
MOST_GATES_PER_STEP = 32


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

    def __init__(self, graph_def, model: GraphModel, options: Options, bandwidth: float):
        self.options, self.bandwidth = options, bandwidth
        self.profile = load_profile(self.options.profile) if self.options.profile else None
        self.graph_def, self.model = graph_def, model
        self.estimated_transfers = 0
        self.estimated_ops = 0
        self.unprofiled: collections.Counter[str] = collections.Counter()   # op type -> ops

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
        return estimate_transfer_seconds(size, self.bandwidth)

    def op_seconds(self, node: int) -> float:
        if self.profile is not None and self.model.names[node] in self.profile.op_seconds:
            return self.profile.op_seconds[self.model.names[node]]
        self.estimated_ops += 1
        if self.profile is not None:
            self.unprofiled[self.model.ops[node]] += 1
        return 0.0

    def note_estimates(self) -> None:
        if not (self.estimated_transfers or self.estimated_ops):
            return
        if self.profile is None:
            warn_once(f"tfoverlap: TAC without a profile: {self.estimated_transfers} transfer "
                      f"times from size/bandwidth, {self.estimated_ops} op times taken as zero")
            return
        kinds = ", ".join(f"{count} {op}" for op, count in self.unprofiled.most_common(5))
        if len(self.unprofiled) > 5:
            kinds += ", ..."
        message = (f"tfoverlap: TAC profile {self.options.profile!r}: {self.estimated_ops} ops "
                   f"have no time in it ({kinds}) and count as zero: they did not run under "
                   "their names in the profiled steps (not needed by the fetches, or removed, "
                   "folded or fused by TensorFlow's optimizers: a fused op's time is under "
                   "the name it kept, e.g. a Conv2D's under its BiasAdd)")
        if self.estimated_transfers:
            message += (f"; {self.estimated_transfers} transfer times estimated from "
                        "size/bandwidth")
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


@dataclasses.dataclass
class TransferPlan:
    """What the TicTac pass enforces (the CLI's ``schedule`` and the simulator show it).

    orders:   destination -> transfer indices in order.
    groups:   destination -> release groups, each a list of transfer indices.
    credit:   destination -> the credit its groups were cut with (bytes).
    edges:    (gate name, PS-side source name): the source waits for the gate.
    arrivals: new gate nodes the edges name.
    notes:    what the report should say (transfers left out, estimates used ...).
    link:     the PS link planned with: bytes/s, round trip seconds, where they came from.
    """

    model: GraphModel
    transfers: list[Transfer]
    orders: dict[str, list[int]] = dataclasses.field(default_factory=dict)
    groups: dict[str, list[list[int]]] = dataclasses.field(default_factory=dict)
    credit: dict[str, float] = dataclasses.field(default_factory=dict)
    edges: list[tuple[str, str]] = dataclasses.field(default_factory=list)
    arrivals: list[ArrivalNode] = dataclasses.field(default_factory=list)
    notes: dict = dataclasses.field(default_factory=dict)
    sizes: list[float] = dataclasses.field(default_factory=list)    # bytes per transfer
    link: tuple[float, float, str] = (DEFAULT_BANDWIDTH, 1e-3, "assumed")


def link_figures(options: Options, ps_devices: set[str]) -> tuple[float, float, str]:
    """(bytes/s, round trip s, where from) of the link to the PS tasks in ``ps_devices``:
    the bandwidth option if given; else the slowest link this process measured to one of
    them, and 1 Gbit/s assumed for those it could not measure (say why, where it tried):
    a link the probe could not measure in its time may be the slow one, and the one it did
    may be a PS task on the worker's own host."""
    if options.bandwidth:
        return options.bandwidth, options.round_trip, "given"

    def ours(device):
        return any(DeviceMatcher(spec)(device) for spec in ps_devices if spec)
    measured = [figures for device, figures in measured_links().items() if ours(device)]
    failures = [reason for device, reason in sorted(link_failures().items()) if ours(device)]
    if measured and not failures:
        return min(b for b, _ in measured), max(r for _, r in measured), "measured"
    if measured:
        return (min([b for b, _ in measured] + [DEFAULT_BANDWIDTH]),
                max(r for _, r in measured),
                f"measured for {len(measured)} of {len(measured) + len(failures)} PS tasks, "
                f"assumed for the others; {failures[0]}")
    return (DEFAULT_BANDWIDTH, options.round_trip,
            "assumed" + (f"; {failures[0]}" if failures else ""))


def credit_bytes(options: Options, ordered_bytes: float, bandwidth: float,
                 round_trip: float) -> float:
    """The credit of one destination: the option, or for "auto" the link's bandwidth x
    round trip and at least 1/MOST_GATES_PER_STEP of the bytes it orders."""
    if options.credit != "auto":
        return float(options.credit)
    return max(bandwidth * round_trip, ordered_bytes / MOST_GATES_PER_STEP)


def _transfer_sizes(graph_def, model: GraphModel, transfers: list[Transfer]) -> list[float]:
    """Bytes of each transfer; an unknown size counts as the mean of the known ones."""
    sizes = []
    for transfer in transfers:
        parts = [tensor_bytes(graph_def, model, transfer.source, slot) for slot in transfer.slots]
        sizes.append(None if any(p is None for p in parts) else float(sum(parts)))
    known = [s for s in sizes if s is not None]
    fill = sum(known) / len(known) if known else 0.0
    return [fill if s is None else s for s in sizes]


def _arrival_node(graph_def, destination_index: int, destination: str,
                  members: list[Transfer]) -> ArrivalNode | None:
    """The gate that runs once the transfers of ``members`` have arrived (those whose dtype
    is known: a node needs its inputs' types), or None if no member's is. Its name says
    which tensors it consumes, so a gate that an earlier run left (and Grappler kept) is
    reused only for the same group."""
    tensors, dtypes = [], []
    for transfer in members:
        source = graph_def.node[transfer.source]
        dtype = output_dtype(source)
        if dtype is None:
            continue
        slot = transfer.slots[0]
        tensors.append(source.name if slot == 0 else f"{source.name}:{slot}")
        dtypes.append(dtype)
    if not tensors:
        return None
    name = f"{ARRIVAL_PREFIX}{destination_index}/{tensors[0].split(':')[0]}"
    if len(tensors) > 1:
        digest = hashlib.sha1("\n".join(tensors).encode()).hexdigest()[:8]
        name += f"/and_{len(tensors) - 1}_{digest}"
    return ArrivalNode(name=name, tensors=tuple(tensors), device=destination,
                       dtypes=tuple(dtypes))


def plan_transfer_order(graph_def, options: Options) -> TransferPlan:
    """What the TicTac pass enforces, without the rewrite.

    Transfers inside control flow are left out of the order
    (``notes["transfers_left_out"]``).
    """
    model, flow = analysed(graph_def)
    is_ps = DeviceMatcher(options.ps_devices)
    devices = model.colocated_devices()
    # Arrival gates an earlier run left (Grappler preserves them) are not the model's ops.
    earlier_gates = {v for v in range(model.num_nodes) if ARRIVAL_ATTR in graph_def.node[v].attr}
    found = sorted(find_transfers(model, devices, is_ps, ignore=earlier_gates),
                   key=lambda t: (t.destination, t.source))
    if not found:
        return TransferPlan(model, [])
    destinations_of_source: dict[int, set[str]] = {}
    for transfer in found:
        destinations_of_source.setdefault(transfer.source, set()).add(transfer.destination)
    transfers, left_out = _orderable(found, flow, model)
    plan = TransferPlan(model, transfers)
    if left_out:
        plan.notes["transfers_left_out"] = left_out
    if not transfers:
        return plan
    plan.sizes = _transfer_sizes(graph_def, model, transfers)
    plan.link = link_figures(options, {devices[t.source] for t in transfers})
    bandwidth, round_trip, _ = plan.link
    topological = model.topological_order()
    position = [0] * model.num_nodes
    for rank, node in enumerate(topological):
        position[node] = rank
    bits = dependency_bits(model, topological, transfers)
    # A source downstream of another source (a PS-side chain) must be ordered after it:
    # gating the upstream one on the downstream one's arrival would close a cycle.
    upstream_sources = dependency_bits(model, topological, transfers, at_source=True)
    costs = (_Costs(graph_def, model, options, bandwidth) if options.schedule == "tac"
             else None)
    if costs is not None:
        costs.check_matches(transfers)

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
        plan.orders[destination] = [start + t for t in order]
        sizes = [plan.sizes[start + t] for t in order]
        credit = credit_bytes(options, sum(sizes), bandwidth, round_trip)
        plan.credit[destination] = credit
        # Each PS task's link to this worker gets its own window of release groups: one
        # window over all links idles a link whenever the groups in flight all come from
        # the others. Every edge still goes from a gate that needs only transfers ordered
        # before the sources it releases, so none can close a cycle.
        links = [task_of(devices[local[t].source]) for t in order]
        ordered_so_far, so_far = [], 0        # transfers up to each position of the order
        for t in order:
            so_far |= 1 << t
            ordered_so_far.append(so_far)
        all_groups = []
        for _, positions_of_groups in release_groups_per_link(sizes, links, credit):
            groups = [[order[k] for k in positions] for positions in positions_of_groups]
            all_groups += positions_of_groups
            # The gate of each group: with gate="consumer", a one-transfer group's earliest
            # consumer that is a plain node and follows no source ordered later (by any
            # path); else an arrival node of the group. A group without one borrows the
            # link's last gate.
            gate_so_far: list[str | None] = []
            for positions, group in zip(positions_of_groups, groups):
                gate = None
                if options.gate == "consumer" and len(group) == 1:
                    allowed = ordered_so_far[positions[-1]]
                    valid = [c for c in local[group[0]].consumers
                             if after_sources(c) & ~allowed == 0 and flow.is_plain(c)]
                    if valid:
                        gate = model.names[min(valid, key=position.__getitem__)]
                if gate is None and len(gate_so_far) + options.window < len(groups):
                    arrival = _arrival_node(graph_def, len(plan.orders) - 1, destination,
                                            [local[t] for t in group])
                    if arrival is not None:
                        plan.arrivals.append(arrival)
                        gate = arrival.name
                gate_so_far.append(gate if gate is not None else
                                   (gate_so_far[-1] if gate_so_far else None))
            for j in range(options.window, len(groups)):
                gate = gate_so_far[j - options.window]
                if gate is None:
                    continue
                for t in groups[j]:
                    target = local[t].source
                    if len(destinations_of_source[target]) > 1:
                        shared_sources += 1
                        continue
                    plan.edges.append((gate, model.names[target]))
        plan.groups[destination] = [[start + order[k] for k in positions]
                                    for positions in sorted(all_groups)]
        start = stop

    if shared_sources:
        plan.notes["sources_feeding_several_workers_not_gated"] = shared_sources
    if costs is not None:
        costs.note_estimates()
        plan.notes["estimated_transfer_times"] = costs.estimated_transfers
        plan.notes["estimated_op_times"] = costs.estimated_ops
    return plan


@dataclasses.dataclass(frozen=True)
class GainEstimate:
    """What ordering gains on the destination where it gains most: the default's and the
    ordered step as :mod:`tfoverlap.costs.contention` predicts them, from the links both
    directions carry and how the workers' phases line up.

    ``low_gain`` is the gain with the link and the compute each off by up to
    DECISION_MARGIN either way (where both came from this host's own measurements, they
    vary from run to run): deciding on it keeps a program ordered, or not, in every run.
    """

    destination: str
    steps: StepPrediction
    comp_seconds: float
    figures: str          # where the times came from
    low_gain: float

    @property
    def gain(self) -> float:
        return self.steps.gain

    @property
    def comm_seconds(self) -> float:
        """The busiest link direction's transfer time per step."""
        return max(self.steps.pull_seconds, self.steps.push_seconds)

    @property
    def workers(self) -> int:
        return self.steps.workers

    def describe(self) -> str:
        shared = (f" ({self.workers} workers sharing each PS link)" if self.workers > 1
                  else "")
        return (f"transfers to {self.destination or 'the worker'} take about "
                f"{self.comm_seconds * 1e3:.3g} ms{shared} and its computation about "
                f"{self.comp_seconds * 1e3:.3g} ms per step ({self.figures}); "
                f"{self.steps.describe()}: ordering can gain {self.gain:.1%}, at least "
                f"{self.low_gain:.1%} with the link and the compute off by up to "
                f"{DECISION_MARGIN:g}x")


#: how far off the link and compute figures may be (run-to-run measurement noise, static
#: FLOP estimates) where the decision to order must still hold.
DECISION_MARGIN = 1.5


def estimate_gain(graph_def, plan: TransferPlan, options: Options) -> GainEstimate | None:
    """What ordering ``plan``'s graph gains (None: nothing is ordered).

    Transfer times are bytes (the profile's where it has them) over the link's bandwidth,
    pulls from and pushes to each PS task; compute times come from the profile, else from
    static FLOP estimates at ``options.flops`` (this host's measured rate when 0); the link
    is the plan's. ``workers`` workers (the option, else TF_CONFIG's cluster, else 1) pull
    from and push to every PS task, so its link carries each tensor that many times per
    step in each direction. A training step's forward pass is FORWARD_SHARE of its
    compute.
    """
    if not plan.orders:
        return None
    model = plan.model
    profile = load_profile(options.profile) if options.profile else None
    if profile is not None:
        op_seconds = profile.op_seconds
        figures = f"profile {options.profile!r}"
    else:
        flops = options.flops or host_flops()
        op_seconds = static_costs(graph_def, flops).op_seconds
        figures = f"static estimates at {flops:.3g} FLOP/s"
        emulated, described = emulated_op_seconds(graph_def, options)
        if emulated:
            op_seconds = {**op_seconds, **emulated}
            figures += f", {described}"
    bandwidth, _, link_source = plan.link
    figures += f", {bandwidth * 8 / 1e9:.3g} Gbit/s {link_source}"
    devices = model.colocated_devices()
    comp: dict[str, float] = {}
    for node, device in enumerate(devices):
        if device in plan.orders:
            comp[device] = comp.get(device, 0.0) + op_seconds.get(model.names[node], 0.0)
    ps_jobs = {parse_device_spec(spec).get("job") for spec in options.ps_devices.split(",")
               if spec.strip()} - {None}
    workers = options.workers or cluster_workers(ps_jobs or {"ps"}) or 1
    pushes = _push_bytes(graph_def, model, devices, plan)
    hosted_here = (colocated_ps_task(ps_jobs or {"ps"}) if options.layout == "auto"
                   else None)
    best = None
    for destination, order in plan.orders.items():
        # Bytes over the link, not the profile's transfer times: those overlap, and each
        # includes the time it waited for the others.
        pulls: dict[str, float] = {}
        for t in order:
            name = model.names[plan.transfers[t].source]
            size = profile.transfer_bytes.get(name) if profile is not None else None
            task = task_of(devices[plan.transfers[t].source])
            pulls[task] = pulls.get(task, 0.0) + (size if size is not None else plan.sizes[t])
        pushed = pushes.get(destination, {})
        compute = comp.get(destination, 0.0)
        own_task = _own_ps_task(options, destination, set(pulls) | set(pushed), workers,
                                hosted_here)

        def predict(link_factor=1.0, compute_factor=1.0):
            return predict_steps_for_compute(pulls, pushed, workers, bandwidth * link_factor,
                                             compute * compute_factor, own_task=own_task)

        factors = (1 / DECISION_MARGIN, 1.0, DECISION_MARGIN)
        low_gain = min(predict(link, work).gain for link in factors for work in factors)
        estimate = GainEstimate(destination, predict(), compute, figures, low_gain)
        if best is None or estimate.gain > best.gain:
            best = estimate
    return best


def _own_ps_task(options: Options, destination: str, tasks: set[str], workers: int,
                 hosted_here: str | None) -> str | None:
    """The PS task ("job:index") on ``destination``'s host where the layout is colocated
    (the option; or, for "auto", the one TF_CONFIG puts on this host), else None. PS task
    i sits on worker i's host; a cluster with more PS tasks than workers is not colocated."""
    if options.layout == "dedicated" or len(tasks) > workers:
        return None
    if options.layout == "auto":
        return hosted_here
    index = parse_device_spec(destination).get("task", "0")
    job = next(iter(sorted(task.split(":")[0] for task in tasks)), "ps")
    return f"{job}:{index}"


def _push_bytes(graph_def, model: GraphModel, devices: list[str], plan: TransferPlan
                ) -> dict[str, dict[str, float]]:
    """Destination device -> PS task -> bytes it sends to that PS task per step (the
    gradients a training step pushes; nothing in inference)."""
    ps_devices = {devices[plan.transfers[t].source] for t in range(len(plan.transfers))}
    pushed: dict[str, dict[str, float]] = {}
    sent = set()
    for consumer, device in enumerate(devices):
        if device not in ps_devices:
            continue
        for producer, slot in model.data_inputs[consumer]:
            source = devices[producer]
            if source not in plan.orders or (producer, slot, device) in sent:
                continue
            sent.add((producer, slot, device))   # a tensor goes to a device once
            size = edge_bytes(graph_def, model, producer, consumer, slot) or 0
            per_task = pushed.setdefault(source, {})
            per_task[task_of(device)] = per_task.get(task_of(device), 0.0) + size
    return pushed
