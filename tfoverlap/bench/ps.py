"""The parameter-server benchmark: TensorFlow's default vs its recv scheduling vs TIC vs TAC.

For every configuration (model, training or inference) it builds an emulated network
(tbf-shaped links; ``--layout dedicated``: one namespace per PS task and per worker,
``--layout colocated``: one per worker, which runs a PS task too), starts the PS servers and
one benchmark worker process per worker (:mod:`tfoverlap.bench.ps_worker`), and then drives
all workers in lock step: every block of steps runs on all workers at once, and the
variants take turns block by block (rotated every round), so slow phases of a noisy
machine hit all variants alike. It also measures the communication-only and
computation-only time of an iteration (for comm/comp and E) and traces steps for the
observed transfer order and the timelines, and the resident memory of every PS task and
worker after the warm-up. Results go to CSV, Markdown and PNG plots.

    sudo .venv/bin/python -m tfoverlap.bench.ps --models seq32,resnet50 --out out/bench

With ``--emulate v100`` (or a100, h100, a device file) the workers' heavy compute runs on
emulated accelerators (:mod:`tfoverlap.planning.emulation`): every variant, the
computation-only reference included, runs the emulate pass after its own. Durations are
multiplied by a dilation K and link rates divided by K (``--dilation auto`` picks K so that
the host's CPUs stay below 60% busy, :mod:`tfoverlap.bench.dilation`); results are
reported in emulated time and links in emulated units (``--link 25Gbit``).
"""
from __future__ import annotations

import argparse
import copy
import dataclasses
import json
import os
import statistics
import subprocess
import time
import sys

from tfoverlap.bench.dilation import (FIRST_DILATION, busy_fraction, cpu_sample, next_dilation,
                                      parse_dilation)
from tfoverlap.bench.report import progress
from tfoverlap.options import parse_bandwidth
from tfoverlap.testbed.cluster import hosts_needed

__all__ = ["Configuration", "VARIANTS", "DEFAULT_VARIANTS", "DEFAULT_BATCH",
           "DEFAULT_BANDWIDTH", "Workers", "variant_spec", "run_configuration", "choose_dilation",
           "measure_rounds", "summarize", "timing_row", "plot_step_timelines", "link_name",
           "main"]

#: name -> how its sessions are configured (see ps_worker.Worker.session_config).
VARIANTS = {
    "default": {},
    # The default again, in its own session: how far two identical variants measure apart
    # in one run (the run's noise floor, which the bootstrap intervals of its steps, blocks
    # of steps that ran together, understate).
    "default_again": {},
    "tf_recv_scheduling": {"recv_scheduling": True},
    "tic": {"tfoverlap": {"schedule": "tic"}},
    "tac": {"tfoverlap": {"schedule": "tac"}},  # the profile path is added per worker
    # Every transfer gated on the one before, always (what TIC did before credits).
    "tic_serial": {"tfoverlap": {"schedule": "tic", "credit": 0, "window": 1, "force": True}},
    # Four release groups in flight per PS task's link instead of two.
    "tic_window4": {"tfoverlap": {"schedule": "tic", "window": 4}},
    # Credits, but ordering even where the gain estimate would decline.
    "tic_forced": {"tfoverlap": {"schedule": "tic", "force": True}},
    # The emulation's check: every worker op replaced by an emulated kernel that takes the
    # time the default's profile measured for it (a CPU's semantics: the executor waits
    # for each op), one kernel at a time, each op its share of the profiled steps' compute
    # time (tfoverlap.costs.profile). The profile path is added per worker.
    "replay": {"tfoverlap": {"schedule": "none", "emulate_blocking": True}},
}
#: what a run compares unless told otherwise.
DEFAULT_VARIANTS = ("default", "tf_recv_scheduling", "tic", "tac")

#: (model, training) -> batch size chosen for comm/comp near 1 at DEFAULT_BANDWIDTH with
#: one PS and two workers on this project's 2-core machines (the measured ratio is reported).
DEFAULT_BATCH = {
    ("seq32", False): 1536, ("seq32", True): 512,
    ("par32", False): 1536, ("par32", True): 512,
    ("resnet50", False): 8, ("resnet50", True): 3,
    ("inception_v3", False): 12, ("inception_v3", True): 3,
    ("vgg16", False): 12, ("vgg16", True): 4,
    ("resnet20", False): 32, ("resnet20", True): 32,     # computation-bound everywhere
}
DEFAULT_BANDWIDTH = parse_bandwidth("2.5Gbit")
#: per-worker batch sizes of emulated runs: what one GPU of the emulated class trains on.
EMULATED_BATCH = {"resnet50": 64, "inception_v3": 64, "vgg16": 32, "resnet20": 128,
                  "mobilenet_v2": 64}


@dataclasses.dataclass
class Configuration:
    model: str
    training: bool
    batch: int
    bandwidth: float | None   # bytes/s per link and direction; None: unshaped loopback
                              # (emulated runs: in emulated units, divided by the dilation)
    num_ps: int = 1
    num_workers: int = 2
    layout: str = "dedicated"  # where the tasks run: tfoverlap.testbed.cluster.LAYOUTS
    image_size: int = 224
    width: int = 1024         # layer width of seqN/parN
    intra_op: int = 1
    inter_op: int = 2
    seed: int = 0
    emulate: str = ""         # a device model or file: emulated accelerators
    dilation: float | None = 1.0   # emulated runs: None chooses it (see bench.dilation)

    @property
    def mode(self) -> str:
        return "training" if self.training else "inference"

    @property
    def label(self) -> str:
        return f"{self.model} {self.mode}"

    @property
    def workers_per_ps_link(self) -> int:
        """How many workers pull over each PS task's link: all of them, or, colocated,
        all but the PS task's own host's worker, which reaches it off the link."""
        if self.layout == "colocated":
            return max(1, self.num_workers - 1)
        return self.num_workers


class Workers:
    """The benchmark worker processes of one configuration (or the TF2 job's coordinator),
    driven in lock step over :mod:`tfoverlap.bench.ps_worker`'s line protocol."""

    def __init__(self, channels, timeout: float):
        self.channels, self.timeout = channels, timeout

    def ask_each(self, commands: list[dict | None]) -> list[dict]:
        """Sends ``commands[w]`` to worker w (None: nothing), then collects the answers."""
        chosen = [(channel, command) for channel, command in zip(self.channels, commands)
                  if command is not None]
        for channel, command in chosen:
            channel.send(json.dumps(command))
        return [self._answer(channel, command["cmd"]) for channel, command in chosen]

    def ask(self, command: dict) -> list[dict]:
        return self.ask_each([command] * len(self.channels))

    def _answer(self, channel, what: str) -> dict:
        from tfoverlap.bench.ps_worker import ANSWER
        while True:
            line = channel.read(self.timeout)
            if line.startswith(ANSWER):
                break
        answer = json.loads(line[len(ANSWER):])
        if "error" in answer:
            raise RuntimeError(f"{channel.name}, {what}: {answer['error']}\n"
                               f"{answer.get('traceback', '')}")
        return answer

    def ready(self) -> list[dict]:
        return [self._answer(channel, "start-up") for channel in self.channels]



def _profile_path(workdir: str, task: int) -> str:
    return os.path.join(workdir, f"tac-profile-worker{task}.json")


def variant_spec(name: str, workdir: str, task: int, config: Configuration) -> dict:
    """How variant ``name`` is configured on worker ``task`` (see :data:`VARIANTS`)."""
    spec = copy.deepcopy(VARIANTS[name])
    if spec.get("tfoverlap", {}).get("schedule") == "tac":  # TAC's profile, per worker
        spec["tfoverlap"]["profile"] = _profile_path(workdir, task)
    if spec.get("tfoverlap", {}).get("schedule") in ("tic", "tac"):
        # The testbed sets no TF_CONFIG, so the pass is told the layout; colocated, its
        # estimate counts every worker and knows which PS task is on this host.
        colocated = config.layout == "colocated"
        spec["tfoverlap"]["layout"] = config.layout
        spec["tfoverlap"]["workers"] = (config.num_workers if colocated
                                        else config.workers_per_ps_link)
    if name == "replay":
        spec["tfoverlap"]["emulate"] = _profile_path(workdir, task)
    return spec


def run_configuration(config: Configuration, variants=DEFAULT_VARIANTS, rounds: int = 5,
                      steps: int = 3, traces: int = 3, workdir: str = "/tmp",
                      timeout: float = 900.0, trace_after: int = 0, until_ci: float = 0.0,
                      budget_s: float = 0.0) -> dict:
    """Runs one configuration on a fresh emulated network; returns the raw measurements
    (``until_ci``, ``budget_s``: :func:`measure_rounds`').

    Each traced step is the one after ``trace_after`` untraced steps of a block started on
    every worker at once: 0 traces a lock-step first step, more a step of workers that have
    drifted as far as a block's later steps do."""
    from tfoverlap.testbed.cluster import PsCluster
    from tfoverlap.testbed.network import EmulatedNetwork, LineChannel
    variants = tuple(variants)
    unknown = [name for name in variants if name not in VARIANTS]
    if unknown or "default" not in variants:
        raise ValueError(f"variants must include 'default' and come from {list(VARIANTS)}")
    if config.emulate and "replay" in variants:
        raise ValueError("the replay variant replays this CPU's own profile: run it "
                         "without --emulate")
    os.makedirs(workdir, exist_ok=True)
    dilation = (config.dilation or FIRST_DILATION) if config.emulate else 1.0
    link = None if config.bandwidth is None else config.bandwidth / dilation
    hosts = hosts_needed(config.num_ps, config.num_workers, config.layout)
    with EmulatedNetwork(hosts, bandwidth=link) as network:
        cluster = PsCluster(network, config.num_ps, config.num_workers, layout=config.layout)
        progress(f"{config.label}: {network.describe()}; starting {config.num_ps} PS and "
                  f"{config.num_workers} workers, {config.layout}")
        cluster.start_servers(("ps",), log_dir=workdir)
        ps_started = cluster.resident_memory()["ps"]
        channels = []
        for task in range(config.num_workers):
            worker_config = dataclasses.asdict(config)
            worker_config.update(spec=cluster.spec, task=task, dilation=dilation, variants={
                name: variant_spec(name, workdir, task, config) for name in variants})
            log_path = os.path.join(workdir, f"worker{task}.log")
            with open(log_path, "w") as log:
                process = cluster.spawn_worker(
                    task, [sys.executable, "-m", "tfoverlap.bench.ps_worker",
                           json.dumps(worker_config)],
                    stdin=subprocess.PIPE, stdout=subprocess.PIPE, stderr=log,
                    text=True, env={**os.environ, "TF_CPP_MIN_LOG_LEVEL": "2"})
            channels.append(LineChannel(process, f"worker {task} (log: {log_path})"))
        workers = Workers(channels, timeout)
        graph = workers.ready()[0]
        workers.ask_each([{"cmd": "init"}] + [None] * (config.num_workers - 1))
        ps_initialized = cluster.resident_memory()["ps"]
        calibration = []
        if config.emulate and config.dilation is None:
            dilation, calibration = choose_dilation(workers, network, config, dilation, steps)
        workers.ask({"cmd": "warmup", "variant": "default"})
        fetch = workers.ask_each([{"cmd": "save_graph",
                                   "path": os.path.join(workdir, "graph.pb")}]
                                 + [None] * (config.num_workers - 1))[0]["fetch"]
        progress(f"{config.label}: profiling default steps (for TAC and the simulator)")
        # After a few more steps: the first ones after start-up are slower (ResNet-50
        # inference on 2 workers: 1.23 s of op time per step one step in, 0.82 s four
        # steps in), and a replay of their times would be too.
        workers.ask_each([{"cmd": "profile", "warmup": 3, "steps": 5,
                           "path": _profile_path(workdir, t)}
                          for t in range(config.num_workers)])
        passes = {}
        for name in variants:
            passes[name] = workers.ask({"cmd": "warmup", "variant": name})[0]["pass"]
        memory = {"ps_started": ps_started, "ps_initialized": ps_initialized,
                  **cluster.resident_memory()}
        progress(f"{config.label}: {memory_summary(memory, graph['parameter_bytes'])}")
        progress(f"{config.label}: measuring communication-only and computation-only "
                  "iterations")
        comm = [t for a in workers.ask({"cmd": "comm", "steps": steps}) for t in a["times"]]
        comp = [t for a in workers.ask({"cmd": "comp", "steps": steps}) for t in a["times"]]
        measured = measure_rounds(workers, variants, rounds, steps, config.label, dilation,
                                  until_ci, budget_s)
        traced = {name: [workers.ask({"cmd": "trace", "variant": name,
                                      "after": trace_after})
                         for _ in range(traces)] for name in variants}
        for channel in channels:
            channel.send(json.dumps({"cmd": "quit"}))
        description = network.describe()
    return {"config": dataclasses.asdict(config), "network": description, "graph": graph,
            "workdir": workdir, "fetch": fetch, "dilation": dilation,
            "calibration": calibration, "memory": memory, "passes": passes, "comm": comm,
            "comp": comp, **measured,
            "traces": traced}


def widest_interval(times: dict, baseline: str = "default") -> float:
    """The widest 95% interval of a variant's speed-up over ``baseline``, as a share of
    the speed-up (the larger side): how far the run is from telling its variants apart."""
    from tfoverlap.bench import metrics
    widths = []
    for name, values in times.items():
        if name == baseline or not values:
            continue
        ratio, low, high = metrics.speedup(times[baseline], values)
        widths.append(max(high / ratio - 1.0, 1.0 - low / ratio))
    return max(widths, default=0.0)


def measure_rounds(workers, variants, rounds: int, steps: int, label: str,
                   dilation: float, until_ci: float = 0.0, budget_s: float = 0.0) -> dict:
    """The timed blocks: every round runs a block of ``steps`` steps of each variant on
    every worker (the variants' order rotated by one each round, so slow phases of a noisy
    machine hit all alike). With ``until_ci`` (a share, 0.05 for +-5%), rounds go on after
    ``rounds`` until every variant's interval is that narrow or ``budget_s`` seconds of
    measuring are spent (``precision`` says which). Returns the step wall times and CPU
    times per variant, each block's mean per worker (``blocks``), and how busy the host's
    CPUs were."""
    times = {name: [] for name in variants}
    cpu = {name: [] for name in variants}
    blocks = {name: [] for name in variants}
    before = cpu_sample()
    began = time.monotonic()
    round_index = 0
    while True:
        if round_index >= rounds:
            width = widest_interval(times)
            if not until_ci or width <= until_ci or time.monotonic() - began >= budget_s:
                break
        shift = round_index % len(variants)
        for name in variants[shift:] + variants[:shift]:
            answers = workers.ask({"cmd": "steps", "variant": name, "steps": steps})
            for answer in answers:
                times[name].extend(answer["times"])
                cpu[name].extend(answer["cpu"])
            blocks[name].append([sum(a["times"]) / len(a["times"]) for a in answers])
        summary = ", ".join(f"{name} {statistics.median(values) / dilation:.3f}s"
                            for name, values in times.items())
        round_index += 1
        progress(f"{label}: round {round_index}/{rounds}{'+' if until_ci else ''}: "
                 f"{summary}")
    measured = {"times": times, "cpu": cpu, "blocks": blocks,
                "host_busy": busy_fraction(before, cpu_sample())}
    if until_ci:
        width = widest_interval(times)
        measured["precision"] = {"target": until_ci, "widest": width, "rounds": round_index,
                                 "seconds": time.monotonic() - began,
                                 "reached": width <= until_ci}
    return measured


def choose_dilation(workers, network, config: Configuration, dilation: float,
                     steps: int) -> tuple[float, list]:
    """Raises the dilation from ``dilation`` until a few default steps leave the host's
    CPUs at most BUSY_LIMIT busy; returns it and every (dilation, busy share) tried."""
    tried = []
    while True:
        workers.ask({"cmd": "set_dilation", "value": dilation})
        if config.bandwidth is not None:
            network.set_bandwidth(config.bandwidth / dilation)
        workers.ask({"cmd": "warmup", "variant": "default"})
        before = cpu_sample()
        workers.ask({"cmd": "steps", "variant": "default", "steps": steps})
        busy = busy_fraction(before, cpu_sample())
        tried.append((dilation, busy))
        progress(f"{config.label}: dilation {dilation:g}: host CPUs {busy:.0%} busy")
        following = next_dilation(dilation, busy)
        if following is None:
            return dilation, tried
        dilation = following


def timing_row(result: dict, name: str, rounds: int) -> dict:
    """Variant ``name``'s row of a run's result: its configuration, its step times (in
    emulated time where emulated) against the default's, by round too, comm/comp, E and
    what the pass did; the part of a row that the TF1 and the TF2 jobs share (its api,
    "session", is the TF1 job's: the TF2 job names its own)."""
    from tfoverlap.bench import metrics
    from tfoverlap.bench.report import short_reason
    config = result["config"]
    scale = 1.0 / result.get("dilation", 1.0)     # emulated runs: wall time -> emulated time
    comm = statistics.median(result["comm"]) * scale
    comp = statistics.median(result["comp"]) * scale
    baseline = [t * scale for t in result["times"]["default"]]
    values = [t * scale for t in result["times"][name]]
    iteration = metrics.spread(values)
    ratio, low, high = metrics.speedup(baseline, values)
    by_round = metrics.round_ratios(baseline, values, rounds)
    passes = result["passes"].get(name, {})
    return {
        "model": config["model"], "mode": "training" if config["training"] else "inference",
        "batch": config["batch"], "link": link_name(config["bandwidth"]),
        "ps": config["num_ps"], "layout": config["layout"], "api": "session",
        "workers": config["num_workers"], "variant": name,
        "median_s": iteration.median, "p10_s": iteration.p10, "p90_s": iteration.p90,
        "steps": iteration.count,
        "samples_per_s": config["batch"] * config["num_workers"] / iteration.median,
        "speedup": ratio, "ci_low": low, "ci_high": high,
        "round_low": min(by_round), "round_high": max(by_round),
        "comm_s": comm, "comp_s": comp, "comm_over_comp": comm / comp,
        "efficiency": metrics.efficiency(iteration.median, comm, comp),
        "emulated": config.get("emulate", ""), "dilation": result.get("dilation", 1.0),
        "host_busy": result.get("host_busy", float("nan")),
        "transfers": passes.get("transfers", ""),
        "ordering_edges": passes.get("ordering_edges", ""),
        "gates": passes.get("gates", ""),
        "declined": bool(passes.get("declined")),
        "stepped_aside": short_reason(passes["declined"]) if passes.get("declined") else "",
        "pass_link": passes.get("link", ""),
    }


def summarize(result: dict) -> list[dict]:
    """One row per variant: the metrics of :mod:`tfoverlap.bench.metrics`."""
    from tfoverlap.bench import metrics
    scale = 1.0 / result.get("dilation", 1.0)
    rows = []
    for name, wall_times in result["times"].items():
        cpu = result.get("cpu", {}).get(name)
        per_worker = [metrics.order_consistency([traced[w]["order"]
                                                 for traced in result["traces"][name]])
                      for w in range(result["config"]["num_workers"])]
        rows.append({
            **timing_row(result, name, len(result["blocks"][name])),
            **_later_steps(result, name),
            "straggler": metrics.straggler_effect(result["blocks"][name]),
            "distinct_orders": max(d for d, _ in per_worker),
            "top_order_share": min(s for _, s in per_worker),
            "transfer_span_s": _transfer_span(result["traces"][name]) * scale,
            "worker_cpu_share": (statistics.median(cpu) / statistics.median(wall_times)
                                 if cpu else float("nan")),
        })
    return rows


def _later_steps(result: dict, name: str) -> dict:
    """Variant ``name``'s steps after the first of each block, against the default's
    (``later_s``, ``later_speedup``); {} where blocks hold one step."""
    from tfoverlap.bench import metrics
    values, baseline = result["times"][name], result["times"]["default"]
    blocks = len(result["blocks"][name]) * result["config"]["num_workers"]
    steps_per_block = len(values) // blocks
    if steps_per_block < 2:
        return {}
    scale = 1.0 / result.get("dilation", 1.0)
    later = metrics.after_first_steps(values, steps_per_block)
    later_default = metrics.after_first_steps(baseline, steps_per_block)
    return {"later_s": statistics.median(later) * scale,
            "later_speedup": statistics.median(later_default) / statistics.median(later)}


def memory_summary(memory: dict, parameter_bytes: int) -> str:
    """A run's resident memory in one line: the workers' and the PS tasks' after the
    warm-up, and how much the PS tasks grew from start-up once the variables were
    initialized (their shards: the model's parameters once in all, with the buffers that
    brought them) and by the end of the warm-up."""
    def megabytes(values) -> str:
        return (f"{sum(values) / 1e6:,.0f} MB ({min(values) / 1e6:,.0f}-"
                f"{max(values) / 1e6:,.0f} each)")

    def growth(key: str) -> str:
        return f"{(sum(memory[key]) - sum(memory['ps_started'])) / 1e6:,.0f} MB"
    ps, workers = memory["ps"], memory["worker"]
    return (f"resident memory after the warm-up: {len(ps)} PS tasks {megabytes(ps)}, "
            f"{growth('ps_initialized')} more than at start-up once initialized, "
            f"{growth('ps')} after the warm-up (parameters: {parameter_bytes / 1e6:,.0f} MB); "
            f"{len(workers)} workers {megabytes(workers)}; "
            f"all {(sum(ps) + sum(workers)) / 1e6:,.0f} MB")


def _transfer_span(traced: list[list[dict]]) -> float:
    """Median over traced steps and workers of the time from the first transfer's request
    to the last one's arrival: how long the step's parameters took to arrive."""
    spans = [(max(t[1] + t[2] for t in answer["transfers"])
              - min(t[1] for t in answer["transfers"])) * 1e-6
             for answers in traced for answer in answers if answer["transfers"]]
    return statistics.median(spans) if spans else float("nan")


def plot_step_timelines(config: Configuration, result: dict, path: str):
    """Worker 0's first traced step of the default and of TIC, in the units of the table:
    an emulated run's in emulated time under its emulated link, with the dilation and the
    network the host ran on said on the figure. Returns the figure."""
    from tfoverlap.bench import report
    steps = {name: result["traces"][name][0][0] for name in ("default", "tic")
             if name in result["traces"]}
    title = f"{config.label}, batch {config.batch}, "
    if config.emulate:
        title += (f"emulated {config.emulate}, {link_name(config.bandwidth)} links\n"
                  f"dilation {result['dilation']:g}; the host's network: {result['network']}")
    else:
        title += result["network"]
    return report.plot_timelines(steps, title, path, dilation=result["dilation"])


def link_name(bandwidth: float | None) -> str:
    """"2.5Gbit" for a shaped link, "loopback" for an unshaped one."""
    return "loopback" if bandwidth is None else f"{bandwidth * 8 / 1e9:g}Gbit"


def _parse_models(text: str) -> list[tuple[str, bool]]:
    from tfoverlap.testbed.models import MODEL_NAMES
    chosen = []
    for item in text.split(","):
        name, _, mode = item.strip().partition(":")
        # The transformer keeps its parameters local: it is a model for AllReduce only.
        if (name not in MODEL_NAMES or name == "transformer") and not (
                name[:3] in ("seq", "par") and name[3:].isdigit()):
            choices = ", ".join(m for m in MODEL_NAMES if m != "transformer")
            raise ValueError(f"unknown model {name!r}; choose from {choices}")
        if mode not in ("", "training", "inference"):
            raise ValueError(f"unknown mode {mode!r} in {item!r}: training or inference")
        for training in ((False, True) if not mode else (mode == "training",)):
            chosen.append((name, training))
    return chosen


def main(argv=None, api=None) -> int:
    """The command line of the TF1 benchmark; with ``api`` (a module with ``VARIANTS``,
    ``DEFAULT_VARIANTS``, ``check``, ``run_configuration`` and ``summarize``, as
    :mod:`tfoverlap.bench.ps_strategy`), the same command for another API's job."""
    parser = argparse.ArgumentParser(
        prog="python -m " + (__spec__ if api is None else api.__spec__).name,
        description=(__doc__ if api is None else api.__doc__).splitlines()[0])
    parser.add_argument("--models", default="seq32,par32,resnet50,inception_v3,vgg16",
                        help="comma-separated; model[:training|:inference] (default both)")
    parser.add_argument("--variants",
                        help="comma-separated, from "
                             f"{', '.join(VARIANTS if api is None else api.VARIANTS)}")
    parser.add_argument("--ps", type=int,
                        help="PS tasks (default: 1, colocated: one per worker)")
    parser.add_argument("--workers", type=int, default=2)
    parser.add_argument("--layout", default="dedicated",
                        help="dedicated: every PS task and worker on a host of its own; "
                             "colocated: a PS task on every worker's host, sharing its link")
    parser.add_argument("--batch", type=int, help="override the per-model batch size")
    parser.add_argument("--emulate", default="",
                        help="emulated accelerators: v100, a100, h100 or a device file")
    parser.add_argument("--dilation", default="auto",
                        help="emulated runs: the time dilation K (a number >= 1), or 'auto'")
    parser.add_argument("--bandwidth", "--link", dest="bandwidth",
                        help="override the per-model link rate, e.g. 1Gbit, "
                                            "or 'unshaped' (plain loopback)")
    parser.add_argument("--rounds", type=int, default=5)
    parser.add_argument("--steps", type=int, default=3, help="steps per block")
    parser.add_argument("--traces", type=int, default=3, help="traced steps per variant")
    parser.add_argument("--until-ci", type=float, default=0.0,
                        help="TF1: after --rounds, more rounds until every speed-up's 95%% "
                             "interval is within this share (0.05: +-5%%), or --budget-s")
    parser.add_argument("--budget-s", type=float, default=600.0,
                        help="with --until-ci: the seconds of measuring to stop after")
    parser.add_argument("--trace-after", type=int, default=0,
                        help="trace the step after this many untraced steps of a block "
                             "(TF1 only; 0: the block's lock-step first step)")
    parser.add_argument("--results", help="also merge the rows into this JSON file "
                                           "(docs/results/*.json), replacing rows of the same "
                                           "model, mode, workers, link and variant")
    parser.add_argument("--out", default="out/benchmarks")
    args = parser.parse_args(argv)
    command = " ".join([parser.prog]
                       + [str(a) for a in (sys.argv[1:] if argv is None else argv)])
    try:
        configurations = _parse_models(args.models)
        variants = ([v.strip() for v in args.variants.split(",")] if args.variants else
                    list(DEFAULT_VARIANTS if api is None else api.DEFAULT_VARIANTS))
        if api is not None:
            api.check(sorted({model for model, _ in configurations}), variants)
        unshaped = args.bandwidth == "unshaped"
        bandwidth = parse_bandwidth(args.bandwidth) if args.bandwidth and not unshaped else None
        if args.ps is None:
            args.ps = args.workers if args.layout == "colocated" else 1
        if min(args.ps, args.workers, args.rounds, args.steps, args.traces) < 1:
            raise ValueError("--ps, --workers, --rounds, --steps and --traces must be >= 1")
        if args.trace_after < 0:
            raise ValueError("--trace-after must be >= 0")
        if not 0 <= args.until_ci < 1 or args.budget_s < 0:
            raise ValueError("--until-ci must be in [0, 1) and --budget-s >= 0")
        if api is not None and args.until_ci:
            raise ValueError("--until-ci is for the TF1 benchmark")
        if api is not None and args.trace_after:
            raise ValueError("--trace-after is for the TF1 benchmark; the TF2 job traces "
                             "its steps with the profiler")
        hosts = hosts_needed(args.ps, args.workers, args.layout)
        if args.batch is not None and args.batch < 1:
            raise ValueError("--batch must be >= 1")
        dilation = parse_dilation(args.dilation, args.emulate)
        if args.ps > 1 and "tf_recv_scheduling" in variants:
            # TensorFlow 2.15 aborts (costmodel.cc: "no time estimate for .../replicate/_1")
            # when recv scheduling meets the constants it replicates to a second PS task.
            raise ValueError("tf_recv_scheduling aborts TensorFlow 2.15 with more than one "
                             "PS task; leave it out of --variants")
        if args.emulate and "replay" in variants:
            raise ValueError("the replay variant replays this CPU's own profile: run it "
                             "without --emulate")
    except ValueError as error:
        print(f"tfoverlap bench: {error}", file=sys.stderr)
        return 2
    from tfoverlap.bench import report
    os.makedirs(args.out, exist_ok=True)
    rows, results = [], []
    for model, training in configurations:
        batches = ({m: b for m, b in EMULATED_BATCH.items()} if args.emulate else
                   {m: b for (m, t), b in DEFAULT_BATCH.items() if t == training})
        config = Configuration(model, training, args.batch or batches.get(model, 64),
                               None if unshaped else bandwidth or DEFAULT_BANDWIDTH,
                               num_ps=args.ps, num_workers=args.workers, layout=args.layout,
                               emulate=args.emulate, dilation=dilation)
        workdir = os.path.join(args.out, "work", f"{model}-{config.mode}")
        if api is not None:
            result = api.run_configuration(config, variants, rounds=args.rounds,
                                                   steps=args.steps, traces=args.traces,
                                                   workdir=workdir)
            results.append(result)
            rows.extend(api.summarize(result))
        else:
            result = run_configuration(config, variants, rounds=args.rounds, steps=args.steps,
                                       traces=args.traces, workdir=workdir,
                                       trace_after=args.trace_after,
                                       until_ci=args.until_ci, budget_s=args.budget_s)
            results.append(result)
            rows.extend(summarize(result))
            plot_step_timelines(config, result,
                                os.path.join(args.out, f"timeline-{model}-{config.mode}.png"))
        # Written after every configuration, so a long run that is stopped keeps its results.
        report.write_csv(rows, os.path.join(args.out, "results.csv"))
        with open(os.path.join(args.out, "results.json"), "w") as stream:
            json.dump(results, stream)
        report.plot_speedups(rows, os.path.join(args.out, "speedups.png"))
        with open(os.path.join(args.out, "results.md"), "w") as stream:
            stream.write(report.markdown_table(rows))
        report.write_result_rows(rows, os.path.join(args.out, "rows.json"))
        if args.results:
            report.write_result_rows(rows, args.results, merge=True,
                                     command=command)
    print()
    print(f"{args.ps} PS, {args.workers} workers, {args.layout} on {hosts} hosts, "
          f"{results[0]['network']}; {args.rounds} rounds x {args.steps} steps per variant "
          "and worker, interleaved")
    for result in results:
        config = result["config"]
        mode = "training" if config["training"] else "inference"
        print(f"{config['model']} {mode}: "
              f"{memory_summary(result['memory'], result['graph']['parameter_bytes'])}")
        if config["emulate"]:
            print(f"{config['model']} {mode}: emulated {config['emulate']}, dilation "
                  f"{result['dilation']:g} (links shaped to 1/{result['dilation']:g} of the "
                  f"emulated rate; times in emulated seconds); host CPUs "
                  f"{result['host_busy']:.0%} busy while measuring")
        precision = result.get("precision")
        if precision:
            print(f"{config['model']} {mode}: {precision['rounds']} rounds in "
                  f"{precision['seconds']:.0f} s: "
                  + (f"every interval within +-{precision['target']:.0%}"
                     if precision["reached"] else
                     f"time budget spent; widest interval +-{precision['widest']:.1%} "
                     f"(target +-{precision['target']:.0%})"))
    print(report.markdown_table(rows))
    for line in report.summary_lines(rows, "default"):
        print(line)
    print(f"results: {os.path.abspath(args.out)}/results.md, results.csv, results.json, "
          "rows.json; plots: speedups.png" + (", timeline-*.png" if api is None else ""))
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
