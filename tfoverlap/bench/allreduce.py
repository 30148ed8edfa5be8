"""The Horovod benchmark: Horovod's defaults vs autotune vs DDP-style buckets vs Caramel.

For every model and link rate it builds an emulated network of two hosts (tbf-shaped
links) and runs two Horovod (Gloo) jobs, one rank per host:

- one job holds the graphs of ``horovod``, ``ddp25``, ``caramel``, ``compute_only`` and
  ``comm_only`` side by side and times them in turns, block by block, rotated every round
  (:mod:`tfoverlap.bench.allreduce_worker`), so a slow phase of the shared machine hits all
  of them alike;
- ``HOROVOD_AUTOTUNE=1`` is process-wide, so ``autotune`` runs in a second job right after
  (tuning during its warm-up steps) and is compared with the first job's ``horovod``;
- a third job, not timed, traces three steps of each variant with TensorFlow's tracer and
  Horovod's timeline, and splits rank 0's median traced step into compute until the last
  gradient, ring time, waits and the tail after it (:mod:`tfoverlap.costs.horovod_timeline`;
  ``breakdown`` in the rows, a table, and ``timeline-MODEL-LINK.png``).

``--api keras`` times Keras ``model.fit`` instead (:mod:`tfoverlap.bench.keras_worker`:
Horovod's Keras optimizer, again as the A/A row, with DDP's buckets, and
tfoverlap.horovod.keras's, compiled with ``--steps-per-execution``; autotune in its own job
as above), without the traced job; its rows carry ``api: keras``.

Speed-ups are medians over the steps of both ranks' lock-stepped job (rank 0's clock),
with 95% bootstrap intervals, and the range of the per-round ratios. Results go to CSV, Markdown, JSON and a PNG.

    sudo .venv/bin/python -m tfoverlap.bench.allreduce --out out/horovod

``--workers N`` runs N ranks (one per emulated host). ``--emulate v100`` (a100, h100, a
device file) puts every variant's heavy compute on emulated accelerators, with the
dilation K that ``--dilation auto`` chooses by short calibration jobs (the host's CPUs at
most 60% busy, :mod:`tfoverlap.bench.dilation`); links are then given in emulated units and
shaped to 1/K of that, Horovod's cycle is K times its own, and times are reported in
emulated seconds.
"""
from __future__ import annotations

import argparse
import json
import math
import os
import statistics
import sys

from tfoverlap.bench.allreduce_worker import CARAMEL_VARIANTS
from tfoverlap.bench.dilation import FIRST_DILATION, next_dilation, parse_dilation
from tfoverlap.bench.ps import link_name
from tfoverlap.bench.report import progress, speedup_cell, summary_lines, variant_cell
from tfoverlap.options import parse_bandwidth

__all__ = ["DEFAULT_BATCH", "run_configuration", "summarize", "main"]

#: model -> batch per rank, chosen so that at 1 Gbit/s communication is about as long
#: as computation or longer on this project's 2-core machines (the measured ratio is
#: reported next to every result).
DEFAULT_BATCH = {"resnet50": 2, "inception_v3": 2, "vgg16": 2, "transformer": 4,
                 "resnet20": 32, "mobilenet_v2": 8}
AUTOTUNE_ENV = {"HOROVOD_AUTOTUNE": "1", "HOROVOD_AUTOTUNE_WARMUP_SAMPLES": "1",
                "HOROVOD_AUTOTUNE_STEPS_PER_SAMPLE": "3",
                "HOROVOD_AUTOTUNE_BAYES_OPT_MAX_SAMPLES": "8"}
AUTOTUNE_WARMUP = 24       # training steps for autotune to settle before it is timed
#: batch per rank of emulated runs: what one GPU of the emulated class trains on.
EMULATED_BATCH = {"resnet50": 64, "inception_v3": 64, "vgg16": 32, "transformer": 32,
                  "resnet20": 128, "mobilenet_v2": 64}



def _worker_job(network, argv: list[str], env: dict, timeout: float, log_path: str,
                worker: str = "tfoverlap.bench.allreduce_worker") -> dict:
    from tfoverlap.testbed.horovod_launch import run_horovod
    command = [sys.executable, "-m", worker] + argv
    # Eight ranks building six variants' graphs on two cores are minutes apart: Gloo's
    # 30 s default would end the job while the first ranks wait for the last.
    env = {"HOROVOD_GLOO_TIMEOUT_SECONDS": "900", **env}
    result = run_horovod(network, network.num_hosts, command, "gloo", env=env,
                         timeout=timeout)
    with open(log_path, "w") as log:
        for rank, output in enumerate(result.outputs):
            log.write(f"===== rank {rank} =====\n{output}\n")
    lines = [line for line in result.outputs[0].splitlines() if line.startswith("{")]
    if result.returncode != 0 or not lines:
        raise RuntimeError(f"the Horovod job failed ({result.launcher}, exit "
                           f"{result.returncode}); see {log_path}")
    return json.loads(lines[-1])


MAIN_JOB_VARIANTS = "horovod,ddp25,caramel,compute_only,comm_only"


def run_configuration(model: str, batch: int, bandwidth: float | None, rounds: int,
                      steps: int, workdir: str, autotune: bool = True,
                      timeout: float = 3600.0, variants: str = MAIN_JOB_VARIANTS,
                      ranks: int = 2, emulate: str = "",
                      dilation: float | None = 1.0, breakdown: bool = True,
                      api: str = "graph", steps_per_execution: int = 4) -> dict:
    """The jobs of one configuration on a fresh network of ``ranks`` hosts; the raw
    measurements. ``bandwidth`` is in emulated units where ``emulate`` is given;
    ``dilation=None`` chooses it. ``breakdown``: a third job traces a few steps of each
    variant with Horovod's timeline, to split them (not timed). ``api="keras"``: the
    side-by-side job is :mod:`tfoverlap.bench.keras_worker`'s ``model.fit`` (``steps``
    timed calls of ``steps_per_execution`` steps per block), without the traced job."""
    from tfoverlap.testbed.network import EmulatedNetwork
    os.makedirs(workdir, exist_ok=True)
    automatic = bool(emulate) and dilation is None
    dilation = (dilation or FIRST_DILATION) if emulate else 1.0
    common = ["--model", model, "--batch", str(batch)]
    link = None if bandwidth is None else bandwidth / dilation
    calibration = []
    with EmulatedNetwork(ranks, bandwidth=link) as network:
        if automatic:
            dilation, calibration = _choose_dilation(network, common, emulate, dilation,
                                                     bandwidth, workdir, timeout)
        if emulate:
            common += ["--emulate", emulate, "--dilation", str(dilation)]
        description = network.describe()
        progress(f"{model} at {link_name(bandwidth)}: {description}; side-by-side job")
        if api in ("keras", "tape"):
            worker = "tfoverlap.bench.keras_worker"
            keras_calls = ["--steps-per-execution", str(steps_per_execution)] + (
                ["--loop", "tape"] if api == "tape" else [])
            main_job = _worker_job(network, common + keras_calls + [
                "--rounds", str(rounds), "--calls", str(steps), "--variants", variants],
                dilated_horovod_env(dilation), timeout, os.path.join(workdir, "main-job.log"),
                worker=worker)
            breakdown = False
            autotune_steps = keras_calls + [
                "--calls", str(rounds * steps),
                "--warmup", str(-(-AUTOTUNE_WARMUP // steps_per_execution))]
        else:
            worker = "tfoverlap.bench.allreduce_worker"
            autotune_steps = ["--steps", str(rounds * steps), "--warmup", str(AUTOTUNE_WARMUP)]
            main_job = _worker_job(network, common + ["--rounds", str(rounds), "--steps",
                                                      str(steps), "--variants", variants],
                                   dilated_horovod_env(dilation), timeout,
                                   os.path.join(workdir, "main-job.log"))
        breakdowns, figures = {}, {}
        traced_variants = [v for v in variants.split(",")
                           if v not in ("compute_only", "comm_only")]
        if breakdown and traced_variants:
            # A job of its own: Horovod's timeline costs rank 0 a spinning thread.
            progress(f"{model}: traced steps with Horovod's timeline")
            timeline = os.path.join(workdir, "horovod-timeline.json")
            traced = _worker_job(network, common + [
                "--variants", ",".join(traced_variants), "--rounds", "0", "--warmup", "2",
                "--trace-timeline", timeline], {**dilated_horovod_env(dilation),
                                          "HOROVOD_TIMELINE": "DYNAMIC"},
                timeout, os.path.join(workdir, "trace-job.log"))
            breakdowns, figures = traced_breakdowns(traced["traced"], timeline)
            progress(f"{model}: {traced['calmed_threads']} spinning Horovod thread(s) of "
                     "rank 0 moved to SCHED_IDLE while tracing")
        tuned = None
        if autotune:
            progress(f"{model}: autotune job")
            log = os.path.join(workdir, "autotune.csv")
            tuned = _worker_job(network, common + autotune_steps + [
                "--variants", "autotune", "--rounds", "1"],
                {**dilated_horovod_env(dilation), **AUTOTUNE_ENV, "HOROVOD_AUTOTUNE_LOG": log},
                timeout, os.path.join(workdir, "autotune-job.log"), worker=worker)
            tuned["autotune_log_tail"] = _tail(log)
    times = dict(main_job["times"])
    cpu = dict(main_job["cpu"])
    if tuned:
        times["autotune"] = tuned["times"]["autotune"]
        cpu["autotune"] = tuned["cpu"]["autotune"]
    return {"model": model, "batch": batch, "bandwidth": bandwidth, "network": description,
            "ranks": ranks, "emulate": emulate, "dilation": dilation,
            "calibration": calibration, "host_busy": main_job["host_busy"], "cpu": cpu,
            "times": times, "caramel": main_job["caramel"],
            "network_model": main_job["network_model"],
            "parameter_bytes": main_job["parameter_bytes"], "tensors": main_job["tensors"],
            "autotune": tuned and tuned["autotune_log_tail"],
            "breakdown": breakdowns, "figure_steps": figures, "api": api,
            "steps_per_execution": main_job.get("steps_per_execution"),
            "steps_per_block": steps}


def traced_breakdowns(traced: dict, timeline_path: str) -> tuple[dict, dict]:
    """Per variant, the breakdown of its median traced step (wall seconds) and that step
    as a figure's lists (compute, and the collectives as transfers with their operation;
    µs since its start)."""
    from tfoverlap.costs.horovod_timeline import read_timeline, step_breakdown
    if not traced:
        return {}, {}
    try:
        with open(timeline_path) as stream:
            records = read_timeline(stream.read())
    except (OSError, ValueError) as error:
        progress(f"no step breakdown: Horovod's timeline is unreadable ({error})")
        return {}, {}
    breakdowns, figures = {}, {}
    for variant, steps in traced.items():
        try:
            measured = sorted(((step_breakdown(*step["span"], step["ready"], records), index)
                               for index, step in enumerate(steps)),
                              key=lambda pair: pair[0].step)
        except ValueError as error:
            progress(f"{variant}: no step breakdown ({error})")
            continue
        breakdown, index = measured[len(measured) // 2]
        breakdowns[variant] = breakdown.as_dict()
        start, end = steps[index]["span"]
        reductions = sorted({(b, e, name) for name, record in records.items()
                             for b, e in record.reductions if e > start and b < end})
        figures[variant] = {"compute": steps[index]["compute"], "seconds": (end - start) * 1e-6,
                            "transfers": [[name, b - start, e - b, records[name].bytes,
                                           records[name].operation]
                                          for b, e, name in reductions]}
    return breakdowns, figures


def dilated_horovod_env(dilation: float) -> dict:
    """Horovod's own clock dilated too: its cycle (HOROVOD_CYCLE_TIME, 1 ms by default),
    which drives negotiation whether or not there is work, runs K times slower in wall
    time; otherwise 8 idle ranks' cycles alone keep 2 cores busy at any dilation."""
    if dilation == 1:
        return {}
    from tfoverlap.planning.caramel import horovod_cycle_seconds
    return {"HOROVOD_CYCLE_TIME": f"{horovod_cycle_seconds(0.0) * 1e3 * dilation:g}"}


def _choose_dilation(network, common: list[str], emulate: str, dilation: float,
                     bandwidth: float | None, workdir: str,
                     timeout: float) -> tuple[float, list]:
    """Short jobs of Horovod's defaults at rising dilations until the host's CPUs are at
    most BUSY_LIMIT busy while they time; the dilation and every (dilation, busy) tried."""
    tried = []
    while True:
        if bandwidth is not None:
            network.set_bandwidth(bandwidth / dilation)
        job = _worker_job(network, common + [
            "--variants", "horovod", "--rounds", "1", "--steps", "4", "--warmup", "2",
            "--emulate", emulate, "--dilation", str(dilation)], dilated_horovod_env(dilation),
            timeout, os.path.join(workdir, f"calibration-{dilation:g}.log"))
        tried.append((dilation, job["host_busy"]))
        progress(f"dilation {dilation:g}: host CPUs {job['host_busy']:.0%} busy")
        following = next_dilation(dilation, job["host_busy"])
        if following is None:
            return dilation, tried
        dilation = following


def _plot_steps(result: dict, path: str) -> None:
    """Rank 0's median traced step of Horovod's defaults and of each Caramel variant:
    compute, and the reductions (Horovod's timeline), in emulated time."""
    from tfoverlap.bench import report
    figures = {variant: figure for variant, figure in result.get("figure_steps", {}).items()
               if variant in ("horovod", *CARAMEL_VARIANTS)}
    if figures:
        title = f"{result['model']}, {result['ranks']} ranks, {link_name(result['bandwidth'])}"
        if result.get("emulate"):
            title += f" (emulated {result['emulate']})"
        report.plot_timelines(figures, title + ": compute and reductions", path,
                              transfer_label="reductions", dilation=result.get("dilation", 1.0))


def _tail(path: str, lines: int = 2) -> list[str]:
    try:
        with open(path) as stream:
            return stream.read().strip().splitlines()[-lines:]
    except OSError:
        return []


def predicted_step(variant: str, caramel: dict) -> float:
    """The step Caramel's simulation predicted for ``variant`` (seconds as planned; NaN
    where nothing predicts it): its plan's step for a Caramel variant that planned, the
    step under Horovod's own fusion for Horovod's defaults and for a Caramel variant that
    stepped aside; with gradients deferred (or decoupled), the step predicted so."""
    summaries = {name: summary for name, summary in (caramel or {}).items() if summary}
    if variant in CARAMEL_VARIANTS:
        summary = summaries.get(variant) or {}
        deferral = summary.get("cross_step") or {}
        decoupled = summary.get("decouple") or {}
        if deferral.get("deferred"):
            return float(deferral["predicted_step_ms"]) / 1e3
        if decoupled.get("decoupled"):
            return float(decoupled["predicted_step_ms"]) / 1e3
        key = "predicted_horovod_step_s" if summary.get("declined") else "predicted_step_s"
        return float(summary.get(key, math.nan))
    if variant in ("horovod", "horovod_again"):
        return next((float(s["predicted_horovod_step_s"]) for s in summaries.values()
                     if "predicted_horovod_step_s" in s), math.nan)
    return math.nan


def _round_ratios(baseline: list, variant: list, per_round: int | None) -> list[float]:
    """Per round, the median step of ``baseline`` over that of ``variant`` (their step
    lists hold ``per_round`` steps of each round, in order); [] where that is unknown."""
    if not per_round or len(baseline) != len(variant) or len(baseline) % per_round:
        return []
    return [statistics.median(baseline[i:i + per_round])
            / statistics.median(variant[i:i + per_round])
            for i in range(0, len(baseline), per_round)]


def _stepped_aside(result: dict, name: str, caramel: dict) -> str:
    """Why a Caramel variant ran Horovod's own schedule ("" where it changed something):
    nothing deferred or decoupled, and in graph mode its in-step buckets declined too."""
    from tfoverlap.bench.report import short_reason
    if name not in CARAMEL_VARIANTS or not caramel:
        return ""
    deferral = caramel.get("cross_step") or {}
    decoupled = caramel.get("decouple") or {}
    if deferral.get("deferred") or decoupled.get("decoupled"):
        return ""
    in_step = result.get("api") in ("keras", "tape") or caramel.get("declined")
    if not in_step:
        return ""
    reason = deferral.get("reason") or decoupled.get("reason")
    if not reason and isinstance(caramel.get("declined"), str):
        reason = caramel["declined"]
    return short_reason(reason or "nothing deferred")


def summarize(result: dict) -> list[dict]:
    """One row per variant: median step, spread, speed-up over Horovod's defaults, and
    the step Caramel's simulation predicted for it (``predicted_s``, where it predicts one)."""
    from tfoverlap.bench import metrics
    scale = 1.0 / result.get("dilation", 1.0)     # emulated runs: wall -> emulated time
    times = {name: [t * scale for t in values] for name, values in result["times"].items()}
    # Without the comm_only and compute_only variants (a run that cannot hold their graphs
    # too), comm/comp is unknown.
    comm = statistics.median(times["comm_only"]) if "comm_only" in times else math.nan
    comp = statistics.median(times["compute_only"]) if "compute_only" in times else math.nan
    rows = []
    for name in ("horovod", "horovod_again", "autotune", "ddp25", *CARAMEL_VARIANTS):
        if name not in times:
            continue
        spread = metrics.spread(times[name])
        ratio, low, high = metrics.speedup(times["horovod"], times[name])
        caramel = (result["caramel"] or {}).get(name) or {}
        cpu = result.get("cpu", {}).get(name)
        predicted = predicted_step(name, result["caramel"]) * scale
        rows.append({
            "model": result["model"], "mode": "training", "workers": result.get("ranks", 2),
            "emulated": result.get("emulate", ""), "dilation": result.get("dilation", 1.0),
            "host_busy": result.get("host_busy", float("nan")),
            "worker_cpu_share": (statistics.median(cpu) / statistics.median(result["times"][name])
                                 if cpu else float("nan")),
            "link": link_name(result["bandwidth"]), "batch": result["batch"],
            "variant": name, "median_s": spread.median, "p10_s": spread.p10,
            "p90_s": spread.p90, "steps": spread.count,
            "speedup": ratio, "ci_low": low, "ci_high": high,
            "comm_s": comm, "comp_s": comp, "comm_over_comp": comm / comp,
            "efficiency": metrics.efficiency(spread.median, comm, comp),
            "tensors": result["tensors"], "parameter_mb": result["parameter_bytes"] / 1e6,
            "caramel_buckets": caramel.get("buckets", ""),
            "declined": bool(caramel.get("declined")),
            "predicted_gain": caramel.get("predicted_gain", ""),
        })
        rows[-1]["api"] = result.get("api") or "graph"
        if result.get("api") in ("keras", "tape"):
            rows[-1]["steps_per_execution"] = result["steps_per_execution"]
        rounds = _round_ratios(times["horovod"], times[name], result.get("steps_per_block"))
        if rounds:
            rows[-1].update(round_low=min(rounds), round_high=max(rounds))
        deferral = caramel.get("cross_step") or {}
        if deferral.get("drain_ms"):        # one drain per call, in the rows' time unit
            rows[-1]["drain_ms"] = deferral["drain_ms"] * scale
        if deferral.get("candidates_ms"):      # priced, whether or not it deferred
            rows[-1]["deferral_candidates_ms"] = {
                order: step * scale for order, step in deferral["candidates_ms"].items()}
        if deferral.get("deferred"):
            rows[-1].update(deferred_gradients=deferral["deferred"],
                            deferred_mb=deferral.get("deferred_bytes", 0) / 1e6,
                            deferral_order=deferral.get("order", ""),
                            deferred_chunks=len(deferral.get("chunks") or []))
        decoupled = caramel.get("decouple") or {}
        if decoupled.get("decoupled"):
            rows[-1].update(decoupled_gradients=decoupled["decoupled"],
                            reduce_scatter_buckets=len(decoupled.get("buckets", [])),
                            gather_requests=len(decoupled.get("gathers", [])))
        aside = _stepped_aside(result, name, caramel)
        if aside:
            rows[-1]["stepped_aside"] = aside
        if math.isfinite(predicted):
            rows[-1].update(predicted_s=predicted,
                            prediction_error=predicted / spread.median - 1)
        breakdown = result.get("breakdown", {}).get(name)
        if breakdown:
            rows[-1]["breakdown"] = {key: value * (1 if key == "requests" else scale)
                                     for key, value in breakdown.items()}
    return rows


def what_it_did(row: dict) -> str:
    """What a Caramel variant changed, and the step predicted and measured for it ("" for
    a row that changed nothing)."""
    if row.get("deferred_gradients"):
        did = (f"deferred {row['deferred_gradients']} gradients "
               f"({row.get('deferred_mb', 0):.1f} MB) under the next step's forward pass"
               + (f" ({row['deferral_order']}, {row.get('deferred_chunks', 0)} "
                  f"request{'s' if row.get('deferred_chunks') != 1 else ''})"
                  if row.get("deferral_order") else ""))
    elif row.get("decoupled_gradients"):
        did = f"decoupled {row['decoupled_gradients']} gradients"
    else:
        return ""
    predicted = row.get("predicted_s", math.nan)
    return (did + (f"; step predicted {predicted * 1e3:.1f} ms" if predicted == predicted
                   else "") + f", measured {row['median_s'] * 1e3:.1f} ms")


def breakdown_table(rows: list[dict]) -> str:
    """Where each variant's median traced step goes (rank 0), in the rows' time unit."""
    lines = ["| model | link | variant | step ms | until last gradient | tail: ring / wait / "
             "after | ring idle | negotiating | requests | in-step bound |",
             "|---|---|---|---|---|---|---|---|---|---|"]
    for row in rows:
        part = row.get("breakdown")
        if not part:
            continue
        ms = {key: value * 1e3 for key, value in part.items() if key != "requests"}
        lines.append(
            f"| {row['model']} | {row['link']} | {row['variant']} | {ms['step']:.1f} | "
            f"{ms['until_last_gradient']:.1f} | {ms['tail_ring']:.1f} / {ms['tail_wait']:.1f}"
            f" / {ms['after_last_reduction']:.1f} | {ms['ring_idle']:.1f} | "
            f"{ms['negotiation']:.1f} | {part['requests']} | {ms['in_step_bound']:.1f} |")
    return "\n".join(lines) + "\n"


def markdown_table(rows: list[dict]) -> str:
    lines = ["| model | link | batch | variant | iteration s (p10-p90) | speed-up (95% CI) | "
             "comm/comp | E | predicted s (error) |", "|---|---|---|---|---|---|---|---|---|"]
    for row in rows:
        speedup = "1.00x" if row["variant"] == "horovod" else speedup_cell(row)
        variant = variant_cell(row) + (f" ({row['caramel_buckets']} buckets)"
                                       if row["caramel_buckets"] != ""
                                       and not row.get("stepped_aside") else "")
        efficiency = row["efficiency"]
        predicted = row.get("predicted_s", math.nan)
        prediction = ("n/a" if predicted != predicted
                      else f"{predicted:.3f} ({row['prediction_error']:+.0%})")
        lines.append(
            f"| {row['model']} ({row['tensors']} tensors, {row['parameter_mb']:.0f} MB) | "
            f"{row['link']} | {row['batch']} | {variant} | {row['median_s']:.3f} "
            f"({row['p10_s']:.3f}-{row['p90_s']:.3f}) | {speedup} | "
            f"{row['comm_s']:.2f}/{row['comp_s']:.2f} = {row['comm_over_comp']:.2f} | "
            f"{'n/a' if efficiency != efficiency else f'{efficiency:.2f}'} | "
            f"{prediction} |")
    return "\n".join(lines) + "\n"


def main(argv=None) -> int:
    parser = argparse.ArgumentParser(prog="python -m tfoverlap.bench.allreduce",
                                     description=__doc__.splitlines()[0])
    parser.add_argument("--models", default="resnet50,vgg16,inception_v3,transformer")
    parser.add_argument("--bandwidths", "--links", dest="bandwidths", default="1Gbit,10Gbit",
                        help="comma-separated link rates; 'unshaped' for plain loopback")
    parser.add_argument("--batch", type=int, help="override the per-model batch size")
    parser.add_argument("--workers", type=int, default=2, help="ranks, one per host")
    parser.add_argument("--emulate", default="",
                        help="emulated accelerators: v100, a100, h100 or a device file")
    parser.add_argument("--dilation", default="auto",
                        help="emulated runs: the time dilation K (a number >= 1), or 'auto'")
    parser.add_argument("--rounds", type=int, default=3)
    parser.add_argument("--steps", type=int, default=3, help="steps per block")
    parser.add_argument("--no-autotune", action="store_true", help="skip the autotune job")
    parser.add_argument("--no-breakdown", action="store_true",
                        help="skip the job that traces steps with Horovod's timeline")
    parser.add_argument("--variants", default=MAIN_JOB_VARIANTS,
                        help="the side-by-side job's variants (see allreduce_worker); "
                             "compute_only and comm_only give comm/comp (else unknown)")
    parser.add_argument("--api", choices=("graph", "keras", "tape"), default="graph",
                        help="graph: TF1 sessions (allreduce_worker); keras: model.fit "
                             "(keras_worker: horovod, horovod_again, ddp25, caramel, "
                             "caramel_cross_step, compute_only); tape: a TF2 custom loop, "
                             "DistributedGradientTape steps in a tf.range loop inside one "
                             "tf.function (keras_worker --loop tape: horovod, "
                             "horovod_again, autotune, caramel, caramel_decoupled)")
    parser.add_argument("--steps-per-execution", type=int, default=4,
                        help="--api keras: compile(steps_per_execution=); --steps is "
                             "then the timed calls of the train function per block")
    parser.add_argument("--results", help="also merge the rows into this JSON file "
                                           "(docs/results/*.json), replacing rows of the same "
                                           "model, mode, workers, link and variant")
    parser.add_argument("--out", default="out/horovod")
    args = parser.parse_args(argv)
    command = " ".join([parser.prog]
                       + [str(a) for a in (sys.argv[1:] if argv is None else argv)])
    from tfoverlap.testbed.models import MODEL_NAMES
    try:
        models = [m.strip() for m in args.models.split(",") if m.strip()]
        unknown = [m for m in models if m not in MODEL_NAMES or m.startswith(("seq", "par"))]
        if unknown or not models:
            raise ValueError(f"unknown model {unknown[0] if unknown else ''!r}; choose from "
                             f"{', '.join(DEFAULT_BATCH)}")
        bandwidths = [None if b.strip() == "unshaped" else parse_bandwidth(b)
                      for b in args.bandwidths.split(",")]
        if args.api == "keras":
            from tfoverlap.bench.keras_worker import VARIANTS as VARIANT_NAMES
            if args.variants == MAIN_JOB_VARIANTS:
                args.variants = "horovod,horovod_again,ddp25,caramel"
        elif args.api == "tape":
            from tfoverlap.bench.keras_worker import TAPE_VARIANTS as VARIANT_NAMES
            if args.variants == MAIN_JOB_VARIANTS:
                args.variants = "horovod,horovod_again,caramel"
        else:
            from tfoverlap.bench.allreduce_worker import VARIANT_NAMES
        if args.api in ("keras", "tape"):
            if args.steps_per_execution < 1:
                raise ValueError("--steps-per-execution must be >= 1")
        chosen = args.variants.split(",")
        if "horovod" not in chosen or set(chosen) - set(VARIANT_NAMES):
            raise ValueError(f"--variants must include horovod and come from "
                             f"{', '.join(VARIANT_NAMES)}")
        if min(args.rounds, args.steps) < 1 or (args.batch is not None and args.batch < 1):
            raise ValueError("--rounds, --steps and --batch must be >= 1")
        if args.workers < 2:
            raise ValueError("--workers must be at least 2")
        dilation = parse_dilation(args.dilation, args.emulate)
    except ValueError as error:
        print(f"tfoverlap bench: {error}", file=sys.stderr)
        return 2
    from tfoverlap.bench import report
    os.makedirs(args.out, exist_ok=True)
    rows, results = [], []
    for model in models:
        for bandwidth in bandwidths:
            workdir = os.path.join(args.out, "work", f"{model}-{link_name(bandwidth)}")
            batches = EMULATED_BATCH if args.emulate else DEFAULT_BATCH
            result = run_configuration(model, args.batch or batches.get(model, 4),
                                       bandwidth, args.rounds, args.steps, workdir,
                                       autotune=not args.no_autotune, variants=args.variants,
                                       ranks=args.workers, emulate=args.emulate,
                                       dilation=dilation, breakdown=not args.no_breakdown,
                                       api=args.api,
                                       steps_per_execution=args.steps_per_execution)
            results.append(result)
            rows.extend(summarize(result))
            progress(", ".join(f"{r['variant']} {r['median_s']:.3f}s ({r['speedup']:.2f}x)"
                                for r in rows[-4:] if r["model"] == model))
            report.write_csv(rows, os.path.join(args.out, "results.csv"))
            with open(os.path.join(args.out, "results.json"), "w") as stream:
                json.dump(results, stream)
            with open(os.path.join(args.out, "results.md"), "w") as stream:
                stream.write(markdown_table(rows) + "\n" + breakdown_table(rows))
            _plot_steps(result, os.path.join(args.out, f"timeline-{model}-"
                                                       f"{link_name(bandwidth)}.png"))
            report.write_result_rows(rows, os.path.join(args.out, "rows.json"))
            if args.results:
                report.write_result_rows(rows, args.results, merge=True,
                                         command=command)
            report.plot_speedups(rows, os.path.join(args.out, "speedups.png"),
                                 baseline="horovod",
                                 ylabel="speed-up over Horovod's defaults")
    print()
    print(f"{args.workers} ranks (Gloo), {results[0]['network']}; {args.rounds} rounds x "
          f"{args.steps} steps per variant, interleaved")
    for result in results:
        if result["emulate"]:
            print(f"{result['model']} at {link_name(result['bandwidth'])}: emulated "
                  f"{result['emulate']}, dilation {result['dilation']:g} (links shaped to "
                  f"1/{result['dilation']:g}; times in emulated seconds); host CPUs "
                  f"{result['host_busy']:.0%} busy while timing")
    print(markdown_table(rows))
    if any(row.get("breakdown") for row in rows):
        print(breakdown_table(rows))
    for line in summary_lines(rows, "horovod"):
        print(line)
    for row in rows:
        if what_it_did(row):
            print(f"{row['model']} {row['link']} {row['variant']}: {what_it_did(row)}")
    print(f"results: {os.path.abspath(args.out)}/results.md, results.csv, results.json, "
          "rows.json, speedups.png, timeline-*.png")
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
