"""The PS benchmark's TF2 job: ParameterServerStrategy with and without TicTac.

    sudo .venv/bin/python -m tfoverlap.bench.ps_strategy --models resnet50:training \
        --emulate v100 --link 25Gbit --workers 4 --layout colocated

takes the options of :mod:`tfoverlap.bench.ps` and runs, on the same emulated network and
layout as the TF1 rows, the way TF2 trains with PS tasks: PS and worker tasks are plain
``tf.distribute.Server`` processes (with tfoverlap loaded, as ``tfoverlap run`` would have
it), and one coordinator (:mod:`tfoverlap.bench.ps_strategy_chief`, on the launcher host,
off the shaped links) schedules a Keras model's training step on them. The variants take
turns block by block as in :mod:`tfoverlap.bench.ps`; a block is ``steps`` steps of every
worker, scheduled at once, and its time divided by ``steps`` is one sample.

Traced steps run one at a time while the profiler captures one PS task after another: the
order in which each PS task read the variables is the *observed* order, compared with the
order TicTac planned (from the reports the workers write). Worker 0 is captured too, in a
block like the timed ones, for its side of the step (when its pulls arrived, when it
computed); that capture is kept in the work directory for reading, not summarized.
"""
from __future__ import annotations

import dataclasses
import glob
import json
import os
import statistics
import subprocess
import sys

from tfoverlap.bench.dilation import FIRST_DILATION
from tfoverlap.bench.report import progress

__all__ = ["VARIANTS", "DEFAULT_VARIANTS", "check", "main", "run_configuration", "summarize",
           "observed_read_orders", "order_concordance", "planned_orders", "pass_summary"]

#: the variants of bench.ps that a TF2 job can run: TAC needs a profile of the graph,
#: which the coordinator never sees, and recv scheduling is a session option.
VARIANTS = ("default", "default_again", "tic", "tic_forced", "tic_serial")
DEFAULT_VARIANTS = ("default", "tic")


def check(models: list[str], variants: list[str]) -> None:
    """ValueError where the command line asks for what a TF2 job cannot run."""
    from tfoverlap.testbed.models import KERAS_APPLICATIONS
    if not set(variants) <= set(VARIANTS):
        raise ValueError(f"a ParameterServerStrategy job runs the variants "
                         f"{', '.join(VARIANTS)}: TAC needs a profile of the workers' "
                         "graph, recv scheduling is a TF1 session option")
    others = [model for model in models if model not in KERAS_APPLICATIONS]
    if others:
        raise ValueError(f"a ParameterServerStrategy job trains a Keras application "
                         f"({', '.join(KERAS_APPLICATIONS)}), not {', '.join(others)}")


def _report_dir(workdir: str, variant: str) -> str:
    return os.path.join(workdir, "reports", variant)


#: how often a coordinator that a signal killed during start-up is started again
COORDINATOR_STARTS = 2


def _start_coordinator(network, chief_config: dict, workdir: str, timeout: float):
    """Starts the coordinator on the launcher host and waits until the model's variables
    are on the PS tasks: (process, its Workers channel, its ready answer).

    TensorFlow 2.15's coordinator has, rarely, died of SIGSEGV while it connected to the
    cluster (once in CI, before it built anything of ours); such a start is tried again,
    with a line that says so and where its log is. Python's fault handler writes the
    crashing thread's stack to the log."""
    from tfoverlap.bench.ps import Workers
    from tfoverlap.testbed.network import LineChannel, NetworkError
    for attempt in range(1, COORDINATOR_STARTS + 1):
        log_path = os.path.join(workdir, "chief.log" if attempt == 1 else
                                f"chief.{attempt}.log")
        with open(log_path, "w") as log:
            process = network.spawn_launcher(
                [sys.executable, "-X", "faulthandler", "-m",
                 "tfoverlap.bench.ps_strategy_chief", json.dumps(chief_config)],
                stdin=subprocess.PIPE, stdout=subprocess.PIPE, stderr=log, text=True,
                env={**os.environ, "TF_CPP_MIN_LOG_LEVEL": "2"})
        chief = Workers([LineChannel(process, f"the coordinator (log: {log_path})")],
                        timeout)
        try:
            return process, chief, chief.ready()[0]
        except NetworkError:
            killed = process.poll() is not None and process.returncode < 0
            if not killed or attempt == COORDINATOR_STARTS:
                raise
            progress(f"the coordinator died of signal {-process.returncode} while it "
                     f"started (log: {log_path}); starting it again")


def run_configuration(config, variants=("default", "tic"), rounds: int = 5, steps: int = 3,
                      traces: int = 3, workdir: str = "/tmp", timeout: float = 900.0,
                      loopback: bool = False) -> dict:
    """Runs one configuration (a :class:`tfoverlap.bench.ps.Configuration`) as a TF2 job
    on a fresh emulated network (``loopback``: on plain loopback, the links unshaped);
    returns the raw measurements."""
    from tfoverlap.bench.ps import choose_dilation, measure_rounds, memory_summary, variant_spec
    from tfoverlap.testbed.cluster import PsCluster, hosts_needed
    from tfoverlap.testbed.network import EmulatedNetwork, free_ports
    variants = tuple(variants)
    unknown = [name for name in variants if name not in VARIANTS]
    if unknown or "default" not in variants:
        raise ValueError(f"a ParameterServerStrategy job runs the variants "
                         f"{', '.join(VARIANTS)} (with 'default'); got {', '.join(variants)}")
    os.makedirs(workdir, exist_ok=True)
    dilation = (config.dilation or FIRST_DILATION) if config.emulate else 1.0
    link = None if config.bandwidth is None else config.bandwidth / dilation
    hosts = hosts_needed(config.num_ps, config.num_workers, config.layout)
    with EmulatedNetwork(hosts, bandwidth=None if loopback else link,
                         loopback=loopback) as network:
        cluster = PsCluster(network, config.num_ps, config.num_workers, layout=config.layout)
        cluster.spec["chief"] = [f"{network.launcher_address}:{free_ports(1)[0]}"]
        progress(f"{config.label} (ParameterServerStrategy): {network.describe()}; starting "
                 f"{config.num_ps} PS and {config.num_workers} workers, {config.layout}")
        cluster.start_servers(("ps", "worker"), log_dir=workdir)
        started = cluster.resident_memory()["ps"]
        specs = {}
        for name in variants:
            specs[name] = variant_spec(name, workdir, 0, config)
            if specs[name].get("tfoverlap") is not None:
                specs[name]["tfoverlap"]["report_dir"] = _report_dir(workdir, name)
        chief_config = {**dataclasses.asdict(config), "spec": cluster.spec,
                        "dilation": dilation, "variants": specs}
        process, chief, graph = _start_coordinator(network, chief_config, workdir, timeout)
        initialized = cluster.resident_memory()["ps"]
        calibration = []
        if config.emulate and config.dilation is None:
            dilation, calibration = choose_dilation(chief, network, config, dilation, steps)
        for name in variants:
            chief.ask({"cmd": "warmup", "variant": name})
        memory = {"ps_started": started, "ps_initialized": initialized,
                  **cluster.resident_memory()}
        progress(f"{config.label}: {memory_summary(memory, graph['parameter_bytes'])}")
        progress(f"{config.label}: measuring communication-only and computation-only "
                 "iterations")
        comm = chief.ask({"cmd": "comm", "steps": steps})[0]["times"]
        comp = chief.ask({"cmd": "comp", "steps": steps})[0]["times"]
        measured = measure_rounds(chief, variants, rounds, steps, config.label, dilation)
        traced = {}
        for name in variants:
            logdir = os.path.join(workdir, "capture", name)
            capture_s = 2.0 + 3.0 * traces * statistics.median(measured["times"][name])
            answers = [chief.ask({"cmd": "trace", "variant": name, "steps": traces,
                                  "task": task, "logdir": logdir, "capture_s": capture_s})[0]
                       for task in range(config.num_ps)]
            traced[name] = {"logdir": logdir,
                            "capture_errors": [a["capture_error"] for a in answers
                                               if a["capture_error"]]}
        process.stdin.write(json.dumps({"cmd": "quit"}) + "\n")
        process.stdin.flush()
        description = network.describe()
    planned = {name: planned_orders(_report_dir(workdir, name)) for name in variants}
    # The variants trace the same step, so their PS reads have the same names.
    reads = next((order for orders in planned.values() for order in orders.values()), [])
    for name in variants:
        traced[name]["orders"] = observed_read_orders(traced[name]["logdir"],
                                                      cluster.spec["ps"], reads)
    return {"config": dataclasses.asdict(config), "api": "ps_strategy",
            "network": description, "graph": graph, "workdir": workdir,
            "dilation": dilation, "calibration": calibration, "memory": memory,
            "comm": comm, "comp": comp, **measured,
            "passes": {name: pass_summary(_report_dir(workdir, name)) for name in variants},
            "planned": planned, "traces": traced}


def _tictac_summaries(report_dir: str) -> list[dict]:
    summaries = []
    for path in sorted(glob.glob(os.path.join(report_dir, "*.json"))):
        with open(path) as stream:
            report = json.load(stream)
        summaries += [entry["summary"] for entry in report.get("passes", [])
                      if entry.get("name") == "tictac" and entry["summary"].get("transfers")]
    return summaries


def planned_orders(report_dir: str) -> dict[str, list[str]]:
    """Worker device -> the order of its PS reads that TicTac planned, from the first report
    in ``report_dir`` that ordered transfers ({} where none did)."""
    for summary in _tictac_summaries(report_dir):
        if summary.get("ordering_edges") and summary.get("order"):
            return dict(summary["order"])
    return {}


def pass_summary(report_dir: str) -> dict:
    """What TicTac did to the variant's step, as the workers reported it."""
    summaries = _tictac_summaries(report_dir)
    if not summaries:
        return {"transfers": 0, "ordering_edges": 0, "modified": False}
    summary = max(summaries, key=lambda s: s.get("ordering_edges", 0))
    return {"transfers": summary["transfers"],
            "ordering_edges": summary.get("ordering_edges", 0),
            "gates": summary.get("gates", 0),
            "predicted_gain": summary.get("predicted_gain"),
            "declined": summary.get("declined", ""), "reports": len(summaries)}


def observed_read_orders(logdir: str, ps_tasks: list[str], reads: list[str]) -> dict:
    """PS task -> the order in which it ran those of ``reads`` (node names) that it holds,
    one list per traced step, from the profiler capture of every PS task (``ps_tasks``:
    their addresses, in task order) under ``logdir``."""
    from tfoverlap.costs.trace import profiled_op_starts
    captures = glob.glob(os.path.join(logdir, "plugins", "profile", "*", "*.xplane.pb"))
    observed = {}
    for task, address in enumerate(ps_tasks):
        # The profiler client names each task's capture after its address, "host_port".
        files = [path for path in captures
                 if os.path.basename(path) == address.replace(":", "_") + ".xplane.pb"]
        starts = [name for path in files for name, _ in profiled_op_starts(path, reads)]
        held = len(set(starts))
        observed[f"ps{task}"] = [starts[k:k + held]
                                 for k in range(0, len(starts) - held + 1, held)] if held else []
    return observed


def order_concordance(observed: dict, planned: list[str]) -> float:
    """How closely the PS tasks ran their reads in ``planned``'s order: the median, over
    every PS task and traced step, of the share of read pairs that ran in the planned
    order (1: exactly the plan, about 0.5: unrelated to it; NaN: nothing traced).

    A share, not a yes/no per step: TicTac releases its transfers in groups, and reads of
    one group, or of two groups in flight at once, may run in any order."""
    position = {name: index for index, name in enumerate(planned)}
    shares = []
    for per_step in observed.values():
        for step in per_step:
            ranks = [position[name] for name in step]
            pairs = len(ranks) * (len(ranks) - 1) // 2
            if pairs:
                agreeing = sum(later > earlier for index, earlier in enumerate(ranks)
                               for later in ranks[index + 1:])
                shares.append(agreeing / pairs)
    return statistics.median(shares) if shares else float("nan")


def summarize(result: dict) -> list[dict]:
    """One row per variant, shaped like :func:`tfoverlap.bench.ps.summarize`'s, with
    ``api`` "ps_strategy" and how closely the traced steps' PS reads followed TicTac's
    planned order (``order_concordance``)."""
    from tfoverlap.bench.ps import timing_row
    rows = []
    for name, wall_times in result["times"].items():
        planned = next(iter((result["planned"].get(name) or {}).values()), None)
        reference = planned or next(
            (order for orders in result["planned"].values() for order in orders.values()), [])
        observed = result["traces"][name].get("orders", {})
        rows.append({
            **timing_row(result, name, len(wall_times)), "api": "ps_strategy",
            "traced_steps": min((len(steps) for steps in observed.values()), default=0),
            # The default's against TIC's plan: how close TensorFlow's own order comes to it.
            "order_concordance": order_concordance(observed, reference) if reference
            else float("nan"),
        })
    return rows


def main(argv=None) -> int:
    from tfoverlap.bench import ps
    return ps.main(argv, api=sys.modules[__name__])


if __name__ == "__main__":
    raise SystemExit(main())
