"""The ``tfoverlap`` command: inspect, schedule, trace, plot, simulate.

Every subcommand runs the same code as the Python API (``plan_transfer_order`` is what
the pass plans; ``tfoverlap.sim.whatif.predict`` is the simulator). A user mistake (a
file that is not a graph, a profile of another graph, an option out of range) ends with
one line on stderr and exit code 2.
"""
from __future__ import annotations

import argparse
import json
import os
import sys

__all__ = ["main", "load_graph", "CliError"]

HOROVOD_OPS = ("HorovodAllreduce", "HorovodGroupedAllreduce", "HorovodAllgather",
               "HorovodBroadcast", "HorovodAlltoall", "HorovodReducescatter",
               "HorovodGroupedReducescatter")


class CliError(Exception):
    """A user mistake: printed as one line, exit code 2."""


# ---------------------------------------------------------------------- loading
def _read(path: str) -> bytes:
    try:
        with open(path, "rb") as stream:
            return stream.read()
    except OSError as error:
        raise CliError(f"cannot read {path}: {error.strerror}") from None


def _looks_like_graph(graph_def) -> bool:
    return len(graph_def.node) > 0 and all(node.op and node.name for node in graph_def.node)


def load_graph(path: str):
    """A GraphDef from a GraphDef (.pb/.pbtxt), a MetaGraphDef or a SavedModel directory."""
    from google.protobuf import message, text_format
    from tensorflow.core.framework import graph_pb2
    from tensorflow.core.protobuf import meta_graph_pb2, saved_model_pb2
    if os.path.isdir(path):
        candidate = os.path.join(path, "saved_model.pb")
        if not os.path.exists(candidate):
            raise CliError(f"{path} is a directory without saved_model.pb (not a SavedModel)")
        saved = saved_model_pb2.SavedModel()
        try:
            saved.ParseFromString(_read(candidate))
        except message.DecodeError:
            raise CliError(f"{candidate} is truncated or not a SavedModel") from None
        if not saved.meta_graphs or not _looks_like_graph(saved.meta_graphs[0].graph_def):
            raise CliError(f"{candidate} holds no graph")
        return saved.meta_graphs[0].graph_def
    data = _read(path)
    if not data:
        raise CliError(f"{path} is empty")
    candidates = []
    if path.endswith((".pbtxt", ".txt")):
        text = data.decode("utf-8", errors="replace")
        for proto in (graph_pb2.GraphDef(), meta_graph_pb2.MetaGraphDef()):
            try:
                text_format.Parse(text, proto)
                candidates.append(proto)
            except text_format.ParseError:
                continue
    else:
        for proto in (graph_pb2.GraphDef(), meta_graph_pb2.MetaGraphDef()):
            try:
                proto.ParseFromString(data)
                candidates.append(proto)
            except (message.DecodeError, RuntimeError, ValueError):
                continue
    for proto in candidates:
        graph_def = proto.graph_def if hasattr(proto, "graph_def") else proto
        if _looks_like_graph(graph_def):
            return graph_def
    raise CliError(f"{path} is truncated or not a TensorFlow graph "
                   "(expected a GraphDef .pb/.pbtxt, a MetaGraphDef or a SavedModel)")


def _load_profile(path: str):
    if not path:
        return None
    from tfoverlap.costs.profile import ProfileError, load_profile
    try:
        return load_profile(path)
    except ProfileError as error:
        raise CliError(str(error)) from None


def _options(args, schedule: str):
    """The pass's options from the command line, validated as every option is."""
    from tfoverlap.options import parse_options
    try:
        return parse_options({"schedule": schedule, "window": args.window,
                              "credit": args.credit, "ps_devices": args.ps_devices,
                              "profile": getattr(args, "profile", "") or ""})
    except ValueError as error:
        raise CliError(str(error)) from None


def _plan(graph_def, args, schedule: str):
    from tfoverlap.costs.profile import ProfileError
    from tfoverlap.graph.model import GraphError
    from tfoverlap.planning.tictac import plan_transfer_order
    options = _options(args, schedule)
    try:
        return plan_transfer_order(graph_def, options)
    except (GraphError, ProfileError) as error:
        raise CliError(str(error)) from None


def _megabytes(num_bytes) -> str:
    return "?" if num_bytes is None else f"{num_bytes / 1e6:.2f} MB"


# ---------------------------------------------------------------------- inspect
def _inspect(args) -> int:
    from tfoverlap.graph.devices import DeviceMatcher
    from tfoverlap.graph.model import tensor_bytes
    from tfoverlap.planning.tictac import dependency_bits
    graph_def = load_graph(args.graph)
    profile = _load_profile(args.profile)
    plan = _plan(graph_def, args, "tic")
    model, transfers = plan.model, plan.transfers
    devices = model.colocated_devices()
    is_ps = DeviceMatcher(args.ps_devices)
    print(f"{args.graph}: {model.num_nodes} nodes")
    variables = [v for v in range(model.num_nodes)
                 if model.ops[v] in ("VarHandleOp", "VariableV2", "Variable")]
    total = sum(tensor_bytes(graph_def, model, v) or 0 for v in variables)
    print(f"parameters: {len(variables)} variables, {_megabytes(total)}")
    by_device: dict[str, list[int]] = {}
    for v in variables:
        by_device.setdefault(devices[v], []).append(v)
    for device, members in sorted(by_device.items()):
        kind = "PS" if device and is_ps(device) else "not a PS device"
        size = sum(tensor_bytes(graph_def, model, v) or 0 for v in members)
        print(f"  {device or '(unplaced)':<40} {len(members):>5} variables "
              f"{_megabytes(size):>12}  ({kind})")
    print(f"transfers (PS devices {args.ps_devices!r}): {len(transfers)}")
    if transfers:
        topological = model.topological_order()
        bits = dependency_bits(model, topological, transfers)
        alone = [0] * len(transfers)
        for node, value in enumerate(bits):
            if value and value & (value - 1) == 0 and not is_ps(devices[node]):
                alone[value.bit_length() - 1] += 1
        destinations = sorted({t.destination for t in transfers})
        for destination in destinations:
            members = [i for i, t in enumerate(transfers) if t.destination == destination]
            size = sum(tensor_bytes(graph_def, model, transfers[i].source) or 0 for i in members)
            print(f"  to {destination or '(unplaced)'}: {len(members)} transfers, "
                  f"{_megabytes(size)}")
        print(f"  {'transfer (PS-side source)':<48} {'size':>12} {'ops it alone unblocks':>22}")
        shown = sorted(range(len(transfers)), key=lambda i: -alone[i])[:args.top]
        for i in shown:
            size = tensor_bytes(graph_def, model, transfers[i].source)
            print(f"  {model.names[transfers[i].source]:<48} {_megabytes(size):>12} "
                  f"{alone[i]:>22}")
        if len(transfers) > len(shown):
            print(f"  ... {len(transfers) - len(shown)} more (--top N)")
    path, seconds = _critical_path(model, profile)
    unit = f"{seconds * 1e3:.1f} ms of profiled compute" if profile else f"{len(path)} ops"
    print(f"critical path: {unit}; starts {' -> '.join(model.names[v] for v in path[:3])}"
          f"{' -> ...' if len(path) > 3 else ''} -> {model.names[path[-1]] if path else ''}")
    horovod = {}
    for op in model.ops:
        if op in HOROVOD_OPS:
            horovod[op] = horovod.get(op, 0) + 1
    print("horovod ops: " + (", ".join(f"{op} x{n}" for op, n in sorted(horovod.items()))
                             or "none"))
    return 0


def _critical_path(model, profile) -> tuple[list[int], float]:
    """Longest path by profiled op time (by op count without a profile)."""
    if not model.num_nodes:
        return [], 0.0
    weight = [(profile.op_seconds.get(name, 0.0) if profile else 1.0) for name in model.names]
    best = list(weight)          # longest path ending at a node, the node included
    parent = [-1] * model.num_nodes
    succs = model.successors()
    for node in model.topological_order():
        for consumer in succs[node]:
            if best[node] + weight[consumer] > best[consumer]:
                best[consumer] = best[node] + weight[consumer]
                parent[consumer] = node
    end = max(range(model.num_nodes), key=best.__getitem__)
    path = []
    while end >= 0:
        path.append(end)
        end = parent[end]
    return path[::-1], best[path[0]]


# ---------------------------------------------------------------------- schedule
def _schedule(args) -> int:
    from tfoverlap.graph.model import tensor_bytes
    graph_def = load_graph(args.graph)
    if args.algo in ("caramel", "decoupled", "cross_step"):
        return _schedule_allreduce(graph_def, args)
    schedule = _plan(graph_def, args, args.algo)
    model, transfers, notes = schedule.model, schedule.transfers, schedule.notes
    left_out = notes.get("transfers_left_out", {})
    if not transfers:
        inside = (f"; {sum(map(len, left_out.values()))} sit inside control flow and are "
                  "left alone" if left_out else "")
        raise CliError(f"no parameter transfers to order in {args.graph} (PS devices "
                       f"{args.ps_devices!r}){inside}; nothing to schedule")
    group_of = {t: j for groups in schedule.groups.values() for j, group in enumerate(groups)
                for t in group}
    plan = {"algorithm": args.algo, "window": args.window, "credit": args.credit,
            "credit_bytes": schedule.credit, "orders": {}, "constraints": [
                {"after": gate, "before": read} for gate, read in schedule.edges],
            "gate_nodes": [{"name": a.name, "consumes": list(a.tensors), "device": a.device}
                           for a in schedule.arrivals], "notes": notes}
    for destination, order in schedule.orders.items():
        plan["orders"][destination] = [
            {"position": k, "group": group_of[t], "transfer": model.names[transfers[t].source],
             "bytes": tensor_bytes(graph_def, model, transfers[t].source),
             "first_consumer": model.names[transfers[t].consumers[0]]}
            for k, t in enumerate(order)]
    if args.json:
        json.dump(plan, sys.stdout, indent=1)
        print()
        return 0
    for destination, rows in plan["orders"].items():
        print(f"{args.algo.upper()} order of the {len(rows)} transfers to "
              f"{destination or '(unplaced)'}, in {len(schedule.groups[destination])} release "
              f"groups of up to {_megabytes(schedule.credit[destination])}:")
        print(f"  {'#':>4} {'group':>5}  {'transfer (PS-side source)':<48} {'size':>12}  "
              "first consumer")
        for row in rows:
            print(f"  {row['position']:>4} {row['group']:>5}  {row['transfer']:<48} "
                  f"{_megabytes(row['bytes']):>12}  {row['first_consumer']}")
    edges = schedule.edges
    print(f"ordering constraints the pass adds ({len(edges)}; group j+{args.window} waits for "
          f"group j): 'A -> B' means B (a PS-side read) waits for A")
    for constraint in plan["constraints"][:args.top]:
        print(f"  {constraint['after']} -> {constraint['before']}")
    if len(edges) > args.top:
        print(f"  ... {len(edges) - args.top} more (--top N, or --json for all)")
    for reason, names in left_out.items():
        print(f"left out of the order, {reason}: {len(names)} transfers (e.g. {names[0]})")
    for key, value in notes.items():
        if key != "transfers_left_out":
            print(f"note: {key}: {value}")
    return 0


def _schedule_allreduce(graph_def, args) -> int:
    from tfoverlap.options import parse_options
    from tfoverlap.planning.caramel import ALLREDUCE_OP, plan_for_graph
    if not any(node.op == ALLREDUCE_OP for node in graph_def.node):
        raise CliError(f"no {ALLREDUCE_OP} ops in {args.graph}; caramel plans Horovod graphs")
    if args.workers < 2:
        raise CliError(f"--workers must be >= 2 for AllReduce, got {args.workers}")
    try:
        options = parse_options({"allreduce": "caramel", "ranks": args.workers,
                                 "bandwidth": args.bandwidth, "latency": args.latency_us * 1e-6,
                                 "split_bytes": args.chunk_mb * 1e6,
                                 "bucket_bytes": args.bucket_mb * 2 ** 20,
                                 "profile": args.profile or ""})
    except ValueError as error:
        raise CliError(str(error)) from None
    bandwidth = options.bandwidth
    if args.algo == "decoupled":
        return _schedule_decoupled(graph_def, options, args)
    if args.algo == "cross_step":
        return _schedule_cross_step(graph_def, options, args)
    plan, inputs = plan_for_graph(graph_def, options)
    source = inputs.ready_times_from
    names = [plan.model.names[v] for v in plan.nodes]
    rows = [{"bucket": k, "gradients": [{"allreduce": names[p.gradient], "offset": p.offset,
                                          "bytes": p.size} for p in b.pieces],
             "bytes": b.size, "ready_s": b.ready, "start_s": b.start, "finish_s": b.finish}
            for k, b in enumerate(plan.buckets)]
    if args.json:
        json.dump({"algorithm": "caramel", "ranks": args.workers, "bandwidth": bandwidth,
                   "buckets": rows}, sys.stdout, indent=1)
        print()
        return 0
    print(f"Caramel buckets for {len(names)} AllReduces, {args.workers} ranks, "
          f"{bandwidth * 8 / 1e9:g} Gbit/s (op times: {source})")
    _print_buckets(rows, "finish ms")
    return 0


def _print_buckets(rows, finish: str) -> None:
    print(f"  {'#':>3} {'gradients':>9} {'size':>12} {'ready ms':>9} {'start ms':>9} "
          f"{finish:>10}  first gradient")
    for row in rows:
        print(f"  {row['bucket']:>3} {len(row['gradients']):>9} {_megabytes(row['bytes']):>12} "
              f"{row['ready_s'] * 1e3:>9.2f} {row['start_s'] * 1e3:>9.2f} "
              f"{row['finish_s'] * 1e3:>10.2f}  {row['gradients'][0]['allreduce']}")


def _schedule_cross_step(graph_def, options, args) -> int:
    from tfoverlap.planning.caramel import plan_cross_step_for_graph
    try:
        plan, cross = plan_cross_step_for_graph(graph_def, options)
    except ValueError as error:
        raise CliError(f"{args.graph}: {error}") from None
    names = plan.model.names
    chunks = [[{"allreduce": names[plan.nodes[p]], "bytes": plan.sizes[p],
                "ready_s": plan.ready[p], "need_s": plan.needs[p],
                "waiting": sorted(names[user] for user in plan.needers[p])}
               for p in chunk] for chunk in cross.chunks]
    if args.json:
        json.dump({"algorithm": "cross_step", "ranks": args.workers,
                   "bandwidth": options.bandwidth, "order": cross.order, "chunks": chunks,
                   "predicted_step_s": cross.predicted_step,
                   "candidates_s": cross.candidates}, sys.stdout, indent=1)
        print()
        return 0
    print(f"Cross-step plan for {len(plan.nodes)} AllReduces, {args.workers} ranks, "
          f"{options.bandwidth * 8 / 1e9:g} Gbit/s: predicted step "
          + ", ".join(f"{name} {seconds * 1e3:.2f} ms"
                      for name, seconds in cross.candidates.items()))
    if not chunks:
        print("nothing to defer: no reduction fits under the next forward pass")
        return 0
    print(f"deferred ({cross.order}), reduced at the next step's start in this order, "
          f"{len(chunks)} request{'s' if len(chunks) != 1 else ''}:")
    print(f"  {'#':>3} {'size':>12} {'ready ms':>9} {'need ms':>9}  gradient -> the ops of "
          "the next forward pass that wait for it")
    for number, chunk in enumerate(chunks):
        for row in chunk:
            print(f"  {number:>3} {_megabytes(row['bytes']):>12} {row['ready_s'] * 1e3:>9.2f} "
                  f"{row['need_s'] * 1e3:>9.2f}  {row['allreduce']} -> "
                  + (f"{row['waiting'][0]}" + (f" and {len(row['waiting']) - 1} more"
                                                if len(row['waiting']) > 1 else "")
                     if row["waiting"] else "(not found: the whole forward pass)"))
    if cross.predicted_step >= cross.in_step:
        print(f"note: no faster than the in-step plan ({cross.in_step * 1e3:.2f} ms); "
              "cross_step=\"auto\" would not defer")
    return 0


def _schedule_decoupled(graph_def, options, args) -> int:
    from tfoverlap.planning.decoupled import plan_decoupled_for_graph
    try:
        plan, inputs = plan_decoupled_for_graph(graph_def, options)
    except ValueError as error:
        raise CliError(f"{args.graph}: {error}") from None
    names = [plan.plan.model.names[v] for v in plan.plan.nodes]
    rows = [{"bucket": k, "gradients": [{"allreduce": names[p.gradient], "bytes": p.size}
                                        for p in b.pieces],
             "bytes": b.size, "ready_s": b.ready, "start_s": b.start, "finish_s": b.finish}
            for k, b in enumerate(plan.buckets)]
    steps = {"horovod": plan.horovod_step, "caramel": plan.caramel_step,
             "cross_step": plan.cross_step_step, "decoupled": plan.predicted_step}
    if args.json:
        json.dump({"algorithm": "decoupled", "ranks": args.workers,
                   "bandwidth": options.bandwidth, "reduce_scatter_buckets": rows,
                   "gather_chunks": plan.gather_chunks, "predicted_step_s": steps},
                  sys.stdout, indent=1)
        print()
        return 0
    print(f"Decoupled plan for {len(names)} gradients, {args.workers} ranks, "
          f"{options.bandwidth * 8 / 1e9:g} Gbit/s (op times: {inputs.ready_times_from}): "
          "reduce-scatter buckets under the backward pass")
    _print_buckets(rows, "scatter ms")
    print(f"all-gathered under the next forward pass in {len(plan.gather_chunks)} requests: "
          + "; ".join(f"buckets {chunk[0]}-{chunk[-1]} "
                      f"({_megabytes(sum(plan.buckets[i].size for i in chunk))})"
                      for chunk in plan.gather_chunks))
    print("predicted step: " + ", ".join(f"{name} {seconds * 1e3:.2f} ms"
                                         for name, seconds in steps.items())
          + f" (decoupled {plan.predicted_gain:+.1%} over the best of the others)")
    return 0


# ---------------------------------------------------------------------- trace and plot
def _load_run_metadata(path: str):
    from google.protobuf import message
    from tensorflow.core.protobuf import config_pb2
    metadata = config_pb2.RunMetadata()
    try:
        metadata.ParseFromString(_read(path))
    except message.DecodeError:
        raise CliError(f"{path} is truncated or not a RunMetadata") from None
    if not metadata.step_stats.dev_stats:
        raise CliError(f"{path} has no step stats (was the step run with "
                       "RunOptions(trace_level=FULL_TRACE)?)")
    return metadata


def chrome_trace(metadata) -> dict:
    """Compute and transfers of all devices on one time axis, as a Chrome/Perfetto trace."""
    from tfoverlap.costs.trace import recv_events
    events = []
    origin = min(node.all_start_micros for d in metadata.step_stats.dev_stats
                 for node in d.node_stats)
    for pid, device_stats in enumerate(metadata.step_stats.dev_stats):
        events.append({"ph": "M", "name": "process_name", "pid": pid,
                       "args": {"name": device_stats.device}})
        for node in device_stats.node_stats:
            if node.node_name == "RecvTensor":
                continue
            events.append({"ph": "X", "pid": pid, "tid": 0, "name": node.node_name,
                           "cat": "compute", "ts": node.all_start_micros - origin,
                           "dur": max(1, node.all_end_rel_micros),
                           "args": {"label": node.timeline_label}})
    transfers_pid = len(metadata.step_stats.dev_stats)
    events.append({"ph": "M", "name": "process_name", "pid": transfers_pid,
                   "args": {"name": "transfers (RecvTensor)"}})
    lanes: dict[str, int] = {}
    for event in recv_events(metadata):
        lane = lanes.setdefault(f"{event.source_device} -> {event.destination_device}",
                                len(lanes))
        events.append({"ph": "X", "pid": transfers_pid, "tid": lane, "name": event.source,
                       "cat": "transfer", "ts": event.start_micros - origin,
                       "dur": max(1, event.duration_micros), "args": {"bytes": event.bytes}})
    for name, lane in lanes.items():
        events.append({"ph": "M", "name": "thread_name", "pid": transfers_pid, "tid": lane,
                       "args": {"name": name}})
    return {"traceEvents": events, "displayTimeUnit": "ms"}


def _trace(args) -> int:
    metadata = _load_run_metadata(args.run_metadata)
    trace = chrome_trace(metadata)
    with open(args.out, "w") as stream:
        json.dump(trace, stream)
    print(f"wrote {args.out}: {len(trace['traceEvents'])} events (open in ui.perfetto.dev "
          "or chrome://tracing)")
    return 0


def _plot(args) -> int:
    from tfoverlap.bench.report import plot_timelines
    from tfoverlap.costs.trace import step_timeline
    from tfoverlap.graph.devices import parse_device_spec
    if args.device:
        try:
            parse_device_spec(args.device)
        except ValueError as error:
            raise CliError(f"--device: {error}") from None
    if len(args.run_metadata) > 2:
        raise CliError("plot takes one RunMetadata, or two to compare side by side")
    labels = args.labels.split(",") if args.labels else (
        ["default", "scheduled"] if len(args.run_metadata) == 2 else ["step"])
    if len(labels) != len(args.run_metadata):
        raise CliError("--labels needs one label per RunMetadata")
    timelines = {}
    for label, path in zip(labels, args.run_metadata):
        timeline = step_timeline(_load_run_metadata(path), args.device)
        if not timeline["compute"] and not timeline["transfers"]:
            raise CliError(f"{path}: no events on device {args.device!r}")
        end = max([s + d for _, s, d in timeline["compute"]] +
                  [s + d for _, s, d, _ in timeline["transfers"]])
        timelines[label] = {**timeline, "seconds": end * 1e-6}
    plot_timelines(timelines, f"one step on {args.device or 'all devices'}", args.out)
    print(f"wrote {args.out}")
    return 0


def _breakdown(args) -> int:
    from tfoverlap.costs.horovod_timeline import read_timeline
    from tfoverlap.planning.caramel import traced_step_breakdown
    metadata = _load_run_metadata(args.run_metadata)
    try:
        records = read_timeline(_read(args.horovod_timeline).decode("utf-8", "replace"))
    except ValueError as error:
        raise CliError(f"{args.horovod_timeline}: {error}") from None
    try:
        part = traced_step_breakdown(metadata, records, args.device)
    except ValueError as error:
        raise CliError(f"{args.run_metadata} with {args.horovod_timeline}: {error}") from None
    ms = {key: value * 1e3 for key, value in part.as_dict().items() if key != "requests"}
    print(f"step {ms['step']:.2f} ms (rank 0)")
    print(f"  forward and backward, until the last gradient  {ms['until_last_gradient']:8.2f} ms"
          f"   (first gradient at {ms['first_gradient']:.2f} ms)")
    print(f"  tail after the last gradient                   {ms['tail']:8.2f} ms")
    print(f"    reductions running                           {ms['tail_ring']:8.2f} ms")
    print(f"    nothing reducing (negotiation, cycle, queue) {ms['tail_wait']:8.2f} ms")
    print(f"    after the last reduction                     "
          f"{ms['after_last_reduction']:8.2f} ms")
    print(f"  ring busy {ms['ring']:.2f} ms in {part.requests} fused requests, idle "
          f"{ms['ring_idle']:.2f} ms after the first gradient; negotiating "
          f"{ms['negotiation']:.2f} ms")
    print(f"  in-step bound (the ring never idle once a gradient exists): "
          f"{ms['in_step_bound']:.2f} ms, {part.step / part.in_step_bound:.2f}x at most")
    return 0


# ---------------------------------------------------------------------- simulate
def _scenario(args, **overrides):
    from tfoverlap.options import parse_bandwidth
    from tfoverlap.sim.whatif import Scenario, SimulationError
    try:
        values = {"workers": args.workers, "bandwidth": parse_bandwidth(args.bandwidth),
                  "latency": args.latency_us * 1e-6, "threads": args.threads,
                  "window": args.window, "credit": args.credit, "seeds": args.seeds,
                  "ps_devices": args.ps_devices,
                  "ps_tasks": args.ps, "chunk_bytes": args.chunk_mb * 1e6,
                  "layout": args.layout}
        values.update(overrides)
        scenario = Scenario(**values)
        scenario.validate()
    except (ValueError, SimulationError) as error:
        raise CliError(str(error)) from None
    return scenario


def _predict(graph_def, scenario, args, profile):
    from tfoverlap.costs.profile import ProfileError
    from tfoverlap.graph.model import GraphError
    from tfoverlap.sim.whatif import SimulationError, predict
    try:
        return predict(graph_def, scenario, args.algo.split(","), profile=profile,
                       profile_path=args.profile or "", fetches=args.fetch or ())
    except (SimulationError, GraphError, ProfileError) as error:
        raise CliError(str(error)) from None


def _simulate(args) -> int:
    graph_def = load_graph(args.graph)
    profile = _load_profile(args.profile)
    if args.sweep:
        return _sweep(graph_def, profile, args)
    scenario = _scenario(args)
    predictions = _predict(graph_def, scenario, args, profile)
    print(f"one iteration, {scenario.workers} workers, "
          f"{scenario.bandwidth * 8 / 1e9:g} Gbit/s per link, {scenario.threads} inter-op "
          f"threads, costs from "
          f"{'profile ' + args.profile if profile else 'sizes only (no profile: compute is free)'}")
    baseline = next((p.iteration for p in predictions if p.algorithm == "default"), None)
    print(f"{'algorithm':<10}{'iteration s':>12}{'comm s':>9}{'comp s':>9}{'E':>7}"
          f"{'bound s':>9}{'gain':>8}  {'workers' if predictions[0].phase else ''}")
    for p in predictions:
        gain = f"{baseline / p.iteration:.2f}x" if baseline else ""
        print(f"{p.algorithm:<10}{p.iteration:>12.4f}{p.comm:>9.4f}{p.comp:>9.4f}"
              f"{p.efficiency:>7.2f}{p.lower:>9.4f}{gain:>8}  {p.phase}".rstrip())
    return 0


def _sweep(graph_def, profile, args) -> int:
    from tfoverlap.options import parse_bandwidth
    key, _, values = args.sweep.partition("=")
    if key not in ("workers", "bandwidth", "ps") or not values:
        raise CliError("--sweep takes workers=8,64,..., ps=1,2,4 or bandwidth=1Gbit,10Gbit,...")
    rows = []
    for value in values.split(","):
        try:
            override = ({"bandwidth": parse_bandwidth(value)} if key == "bandwidth"
                        else {"workers" if key == "workers" else "ps_tasks": int(value)})
        except ValueError as error:
            raise CliError(f"--sweep value {value!r}: {error}") from None
        predictions = _predict(graph_def, _scenario(args, **override), args, profile)
        rows.append((value, predictions))
    algorithms = [p.algorithm for p in rows[0][1]]
    phases = rows[0][1][0].phase
    print(f"{key:>10}" + "".join(f"{a + ' s':>12}" for a in algorithms) + f"{'best gain':>11}"
          + (f"  {'':<8}  workers ({', '.join(algorithms)})" if phases else ""))
    for value, predictions in rows:
        best = min(predictions, key=lambda p: p.iteration)
        gain = (f"{predictions[0].iteration / best.iteration:>10.2f}x {best.algorithm:<8}"
                if algorithms[0] == "default" else f"{'':>20}")
        print(f"{value:>10}" + "".join(f"{p.iteration:>12.4f}" for p in predictions) + gain
              + (f"  {', '.join(p.phase for p in predictions)}" if phases else ""))
    if args.plot:
        import matplotlib
        matplotlib.use("Agg")
        import matplotlib.pyplot as plt
        figure, axes = plt.subplots(figsize=(6, 4))
        for index, algorithm in enumerate(algorithms):
            axes.plot([v for v, _ in rows], [p[index].iteration for _, p in rows], marker="o",
                      label=algorithm)
        axes.set_xlabel(key)
        axes.set_ylabel("predicted iteration (s)")
        axes.legend()
        figure.tight_layout()
        figure.savefig(args.plot, dpi=120)
        print(f"wrote {args.plot}")
    return 0


# ---------------------------------------------------------------------- main
class _Parser(argparse.ArgumentParser):
    """argparse, but a usage mistake is one line on stderr (and exit code 2)."""

    def error(self, message):
        self.exit(2, f"{self.prog}: error: {message}\n")


def _parser() -> argparse.ArgumentParser:
    parser = _Parser(prog="tfoverlap", description=__doc__.splitlines()[0])
    commands = parser.add_subparsers(dest="command", required=True, parser_class=_Parser)

    def graph_command(name, help_text):
        command = commands.add_parser(name, help=help_text, description=help_text)
        command.add_argument("graph", help="GraphDef (.pb/.pbtxt), MetaGraphDef or SavedModel dir")
        command.add_argument("--ps-devices", default="/job:ps",
                             help="comma-separated device specs of the PS tasks")
        command.add_argument("--profile", default="", help="a tfoverlap profile (JSON)")
        command.add_argument("--window", type=int, default=2,
                             help="release groups in flight (the option 'window')")
        command.add_argument("--credit", default="auto",
                             help="bytes per release group, e.g. 4MB, or auto (the option "
                                  "'credit')")
        command.add_argument("--top", type=int, default=10, help="rows to show")
        return command

    commands.add_parser("run", help="run an unmodified program with TfOverlap on: "
                                    "tfoverlap run [options] -- PROGRAM ARGS...")
    inspect = graph_command("inspect", "parameters, PS tasks, transfers, critical path, "
                                       "Horovod ops of a graph")
    inspect.set_defaults(run=_inspect)
    schedule = graph_command("schedule", "the transfer order TIC or TAC plans and the "
                                         "ordering constraints the pass would add; for "
                                         "Horovod graphs Caramel's AllReduce buckets")
    schedule.add_argument("--algo", choices=("tic", "tac", "caramel", "decoupled",
                                             "cross_step"),
                          default="tic")
    schedule.add_argument("--json", action="store_true")
    schedule.add_argument("--workers", type=int, default=4, help="caramel: ranks")
    schedule.add_argument("--bandwidth", default="10Gbit", help="caramel: per link")
    schedule.add_argument("--latency-us", type=float, default=50.0, help="caramel: alpha")
    schedule.add_argument("--chunk-mb", type=float, default=64.0,
                          help="caramel: split larger gradients into pieces of this size")
    schedule.add_argument("--bucket-mb", type=float, default=4.0,
                          help="caramel: the largest bucket of several gradients, MiB")
    schedule.set_defaults(run=_schedule)
    simulate = graph_command("simulate", "predict one iteration with each algorithm "
                                         "(discrete-event simulation)")
    simulate.add_argument("--algo", default="default,tic,tac",
                          help="comma-separated: default, tic, tac (PS graphs); default, "
                               "caramel (Horovod graphs)")
    simulate.add_argument("--workers", type=int, default=2)
    simulate.add_argument("--ps", type=int, default=0,
                          help="spread the variables over this many PS tasks, for the "
                               "simulation and the TicTac plan alike (default: as placed)")
    simulate.add_argument("--layout", default="dedicated",
                          help="dedicated: each PS task on a host of its own; colocated: PS "
                               "task i on worker i's host, sharing its link (--ps at most "
                               "--workers)")
    simulate.add_argument("--bandwidth", default="2.5Gbit", help="per link, e.g. 10Gbit")
    simulate.add_argument("--latency-us", type=float, default=100.0)
    simulate.add_argument("--threads", type=int, default=2, help="a worker's inter-op threads")
    simulate.add_argument("--chunk-mb", type=float, default=16.0,
                          help="a transfer larger than this interleaves with others on its link")
    simulate.add_argument("--seeds", type=int, default=16,
                          help="random default orders to take the median over")
    simulate.add_argument("--fetch", action="append",
                          help="simulate only what running this node executes (repeatable)")
    simulate.add_argument("--sweep", help="workers=8,64,512, ps=1,2,4 or bandwidth=1Gbit,10Gbit")
    simulate.add_argument("--plot", help="with --sweep: write a PNG of the sweep")
    simulate.set_defaults(run=_simulate)
    trace = commands.add_parser("trace", help="RunMetadata -> Chrome/Perfetto trace JSON",
                                description="Compute and transfers of all devices of a traced "
                                            "step on one time axis.")
    trace.add_argument("run_metadata")
    trace.add_argument("--out", default="trace.json")
    trace.set_defaults(run=_trace)
    plot = commands.add_parser("plot", help="RunMetadata (one or two) -> PNG Gantt chart",
                               description="A step's compute and transfers on one device; "
                                           "two RunMetadata files are drawn one above the other.")
    plot.add_argument("run_metadata", nargs="+")
    plot.add_argument("--device", default="/job:worker/task:0")
    plot.add_argument("--labels", help="comma-separated, one per file")
    plot.add_argument("--out", default="step.png")
    plot.set_defaults(run=_plot)
    breakdown = commands.add_parser(
        "breakdown", help="a Horovod step: compute, ring, waits, tail",
        description="Where rank 0's traced step of a Horovod job went: its RunMetadata "
                    "(FULL_TRACE) and Horovod's timeline of the same run (HOROVOD_TIMELINE, "
                    "written by rank 0), lined up on one clock.")
    breakdown.add_argument("run_metadata")
    breakdown.add_argument("--horovod-timeline", required=True)
    breakdown.add_argument("--device", default="", help="only ops on these devices")
    breakdown.set_defaults(run=_breakdown)
    return parser


def _run(argv: list[str]) -> int:
    """``tfoverlap run [options] -- PROGRAM ARGS...``: see :mod:`tfoverlap.launcher`."""
    from tfoverlap.launcher import run_program
    from tfoverlap.options import OPTION_NAMES, Options, option_help, parse_options
    parser = _Parser(prog="tfoverlap run",
                     usage="tfoverlap run [options] -- PROGRAM [ARGS...]",
                     description="Runs an unmodified program with the TfOverlap optimizer "
                                 "switched on in every TensorFlow session and tf.function of "
                                 "it and of the Python processes it starts (horovodrun and "
                                 "mpirun ranks among them). The options are those of "
                                 "tfoverlap.session_config.")
    described = option_help()
    for name in OPTION_NAMES:
        default = getattr(Options(), name)
        shown = "auto" if name == "bandwidth" and not default else default
        parser.add_argument("--" + name.replace("_", "-"), dest=name, metavar="VALUE",
                            help=f"{described[name]} (default: {shown!r})".replace("%", "%%"))
    if "--" not in argv and not {"-h", "--help"} & set(argv):
        parser.error("give the program after '--': tfoverlap run [options] -- python train.py")
    split = argv.index("--") if "--" in argv else len(argv)
    args = parser.parse_args(argv[:split])          # --help prints the help and exits here
    command = argv[split + 1:]
    if not command:
        parser.error("no program after '--'")
    options = {name: value for name, value in vars(args).items() if value is not None}
    try:
        parse_options(options)
    except ValueError as error:
        parser.error(str(error))
    return run_program(command, options)


def main(argv=None) -> int:
    argv = sys.argv[1:] if argv is None else [str(a) for a in argv]
    if argv[:1] == ["run"]:
        return _run(argv[1:])
    args = _parser().parse_args(argv)
    os.environ.setdefault("TF_CPP_MIN_LOG_LEVEL", "2")
    try:
        return args.run(args)
    except CliError as error:
        print(f"tfoverlap: error: {error}", file=sys.stderr)
        return 2


if __name__ == "__main__":
    sys.exit(main())
