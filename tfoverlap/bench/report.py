"""Benchmark output: CSV, a Markdown table, and PNG plots (speed-ups; one step's timeline)."""
from __future__ import annotations

import csv
import json
import math
import os
import re
import sys
import time

__all__ = ["progress", "write_csv", "write_result_rows", "markdown_table", "speedup_cell",
           "variant_cell", "stepped_aside", "summary_lines", "plot_speedups",
           "plot_timelines", "RESULT_FIELDS"]

#: The fields of a row in docs/results/*.json (every benchmark writes them).
RESULT_FIELDS = ("model", "mode", "workers", "link", "variant", "iteration_s", "speedup",
                 "ci_low", "ci_high")


def progress(message: str) -> None:
    """One time-stamped progress line on stderr."""
    print(f"[{time.strftime('%H:%M:%S')}] {message}", file=sys.stderr, flush=True)


def write_csv(rows: list[dict], path: str) -> None:
    if not rows:
        raise ValueError("no benchmark rows to write")
    fields = list(dict.fromkeys(key for row in rows for key in row))   # rows may differ
    with open(path, "w", newline="") as stream:
        writer = csv.DictWriter(stream, fieldnames=fields)
        writer.writeheader()
        writer.writerows(rows)


RESULT_EXTRA = ("batch", "ps", "layout", "comm_over_comp", "comm_s", "comp_s",
                "transfer_span_s", "declined", "stepped_aside",
                "emulated", "dilation", "host_busy", "worker_cpu_share", "breakdown",
                "predicted_s", "prediction_error", "round_low", "round_high",
                "deferred_gradients", "deferred_mb", "deferral_order", "deferred_chunks",
                "deferral_candidates_ms", "decoupled_gradients",
                "reduce_scatter_buckets", "gather_requests", "api", "steps_per_execution",
                "drain_ms", "order_concordance", "later_s", "later_speedup", "pass_link",
                "command", "date")
#: PS rows: per PS count and layout; per API ("graph" and "keras" or "tape" for Horovod,
#: "session" and "ps_strategy" for parameter servers) and per steps_per_execution
_ROW_KEY = ("model", "mode", "workers", "link", "variant", "ps", "layout", "api",
            "steps_per_execution")


def reading_context(row: dict) -> dict:
    """``row`` with what it needs to be read filled in where it was written without it:
    the API (rows from before the field: TF1 graphs, "graph" under Horovod and "session"
    beside parameter servers), a PS row's layout ("dedicated", the only one there was),
    and whether it was emulated (no: "") at which dilation (1.0)."""
    ps = bool(row.get("ps"))
    defaults = {"api": "session" if ps else "graph", "emulated": "", "dilation": 1.0,
                **({"layout": "dedicated"} if ps else {})}
    return {**row, **{key: value for key, value in defaults.items()
                      if row.get(key) is None}}


def _row_key(row: dict) -> tuple:
    """What makes a row another configuration: _ROW_KEY, read in its context."""
    row = reading_context(row)
    return tuple(row.get(key) for key in _ROW_KEY)


def write_result_rows(rows: list[dict], path: str, merge: bool = False,
                      command: str = "") -> None:
    """The machine-readable rows (docs/results/*.json): RESULT_FIELDS, then those of
    RESULT_EXTRA a row has; one JSON object per row, in a list. With ``merge``, rows
    already in the file stay unless a new row has the same configuration (``_ROW_KEY``);
    every row is written in its reading context (:func:`reading_context`); ``command``
    (what reproduces the rows) and today's date go into each row."""
    records = []
    for row in rows:
        row = reading_context({**row, **({"command": command,
                                          "date": time.strftime("%Y-%m-%d")}
                                         if command else {})})
        record = {key: row["median_s"] if key == "iteration_s" else row[key]
                  for key in RESULT_FIELDS}
        record.update({key: row[key] for key in RESULT_EXTRA if key in row})
        # Unknown numbers (NaN) are null: the files stay standard JSON.
        record = {key: None if isinstance(value, float) and math.isnan(value) else value
                  for key, value in record.items()}
        records.append(record)
    if merge and os.path.exists(path):
        with open(path) as stream:
            kept = json.load(stream)
        new_keys = {_row_key(r) for r in records}
        kept = [reading_context(r) for r in kept]
        records = [r for r in kept if _row_key(r) not in new_keys] + records
    with open(path, "w") as stream:
        json.dump(records, stream, indent=1)
        stream.write("\n")


def _number(value, digits: int = 2) -> str:
    if isinstance(value, float) and math.isnan(value):
        return "n/a"
    return f"{value:.{digits}f}"


#: how long a stepped-aside reason may be where a number is shown
_REASON_CHARS = 60


def short_reason(reason: str) -> str:
    """A pass's reason for stepping aside, short enough for a table cell or a bar label:
    the part that says what it would gain (a long reason leads with its inputs), else its
    first clause, cut at a word."""
    clauses = " ".join(str(reason).split()).split("; ")
    clause = next((c for c in clauses if "gain" in c), clauses[0])
    text = next((part for part in reversed(clause.split(": ")) if "gain" in part),
                clause).rstrip(".")
    predicted = re.search(r"\(([-+][\d.]+%)\), below min_gain ([\d.]+%)", text)
    if predicted:       # "... would take the step from A to B ms (+1.0%), below min_gain 3%"
        text = f"predicted {predicted.group(1)}, below min_gain {predicted.group(2)}"
    if len(text) <= _REASON_CHARS:
        return text
    return text[:_REASON_CHARS].rsplit(" ", 1)[0] + "..."


def stepped_aside(row: dict) -> str:
    """Why the row's pass stepped aside ("" where it acted): such a variant ran the
    baseline's own schedule, so its speed-up is the run's noise."""
    return row.get("stepped_aside") or ""


def variant_cell(row: dict) -> str:
    """The variant's name, and where its pass stepped aside, that and why."""
    reason = stepped_aside(row)
    return f"{row['variant']} (stepped aside: {reason})" if reason else row["variant"]


def speedup_cell(row: dict, detail: str = "") -> str:
    """A variant's speed-up with its 95% interval (and ``detail``: the range over rounds),
    in bold only where the interval leaves out 1: a speed-up that could be noise is not
    shown as a result. A variant that stepped aside is marked as noise, never bold."""
    text = f"{row['speedup']:.2f}x"
    if stepped_aside(row):
        text = f"noise: {text}"
    elif row["ci_low"] > 1 or row["ci_high"] < 1:
        text = f"**{text}**"
    return f"{text} ({row['ci_low']:.2f}-{row['ci_high']:.2f}{detail})"


def summary_lines(rows: list[dict], baseline: str) -> list[str]:
    """One line per configuration: each variant's speed-up over ``baseline`` with its
    interval, a variant that stepped aside said so (its number is noise), and the A/A
    variant (``baseline``_again) named as the noise band."""
    lines = []
    keys = ("model", "mode", "link", "workers", "api")
    for config in dict.fromkeys(tuple(row.get(k) for k in keys) for row in rows):
        parts = []
        for row in rows:
            if tuple(row.get(k) for k in keys) != config or row["variant"] == baseline:
                continue
            if row["variant"] in ("compute_only", "comm_only"):
                continue
            interval = f"({row['ci_low']:.2f}-{row['ci_high']:.2f})"
            if row["variant"] == f"{baseline}_again":
                parts.append(f"A/A {row['speedup']:.2f}x {interval}")
            elif stepped_aside(row):
                parts.append(f"{row['variant']} stepped aside ({stepped_aside(row)}): "
                             f"{row['speedup']:.2f}x {interval} is noise")
            else:
                parts.append(f"{row['variant']} {row['speedup']:.2f}x {interval}")
        model, mode, link, workers, api = config
        hosts = f"{workers} ranks" if baseline == "horovod" else f"{workers} workers"
        where = " ".join(str(v) for v in (model, mode, api, hosts, link) if v)
        lines.append(f"{where}: " + "; ".join(parts))
    return lines


def markdown_table(rows: list[dict]) -> str:
    """One line per configuration and variant; the default's line carries comm/comp."""
    lines = ["| model | mode | batch | link | variant | iteration s (p10-p90) | samples/s | "
             "speed-up (95% CI; range over rounds) | comm/comp | E | straggler | orders |",
             "|---|---|---|---|---|---|---|---|---|---|---|---|"]
    for row in rows:
        rounds = (f"; rounds {row['round_low']:.2f}-{row['round_high']:.2f}"
                  if "round_low" in row else "")
        later = (f"; after each block's first step {row['later_speedup']:.2f}x"
                 if "later_speedup" in row else "")
        speedup = (speedup_cell(row, rounds) + later if row["variant"] != "default"
                   else "1.00x")
        lines.append(
            f"| {row['model']} | {row['mode']} | {row['batch']} | {row['link']} "
            f"| {variant_cell(row)} | {row['median_s']:.3f} ({row['p10_s']:.3f}-{row['p90_s']:.3f}) "
            f"| {row['samples_per_s']:.1f} | {speedup} | "
            f"{row['comm_s']:.2f}/{row['comp_s']:.2f} = {row['comm_over_comp']:.2f} | "
            f"{_number(row['efficiency'])} | {_straggler(row)} | {_orders(row)} |")
    return "\n".join(lines) + "\n"


def _straggler(row: dict) -> str:
    return f"{100 * row['straggler']:.1f}%" if "straggler" in row else "-"


def _orders(row: dict) -> str:
    """Distinct transfer orders of the traced steps; TF2 rows, traced on the PS tasks:
    the share of read pairs in TicTac's planned order."""
    if "distinct_orders" in row:
        return f"{row['distinct_orders']} ({100 * row['top_order_share']:.0f}% top)"
    return f"{_number(row.get('order_concordance', float('nan')))} of pairs as planned"


def plot_speedups(rows: list[dict], path: str, baseline: str = "default",
                  ylabel: str = "speed-up over TF default") -> None:
    """Grouped bars: speed-up over ``baseline`` per configuration (model, mode) and variant."""
    import matplotlib
    matplotlib.use("Agg")
    import matplotlib.pyplot as plt
    configurations = list(dict.fromkeys((row["model"], row["mode"], row["link"])
                                        for row in rows))
    variants = [v for v in dict.fromkeys(row["variant"] for row in rows) if v != baseline]
    width = 0.8 / max(1, len(variants))
    figure, axes = plt.subplots(figsize=(max(6, 1.6 * len(configurations) + 2), 4))
    for index, variant in enumerate(variants):
        xs, heights, errors, asides = [], [], [[], []], []
        for position, configuration in enumerate(configurations):
            row = next((r for r in rows if (r["model"], r["mode"], r["link"]) == configuration
                        and r["variant"] == variant), None)
            if row is None:
                continue
            xs.append(position + (index - (len(variants) - 1) / 2) * width)
            heights.append(row["speedup"])
            errors[0].append(row["speedup"] - row["ci_low"])
            errors[1].append(row["ci_high"] - row["speedup"])
            asides.append(bool(stepped_aside(row)))
        bars = axes.bar(xs, heights, width, yerr=errors, capsize=3, label=variant)
        for bar, aside in zip(bars, asides):
            if aside:       # the baseline's own schedule: its bar is the run's noise
                bar.set_hatch("//")
                bar.set_alpha(0.5)
                axes.text(bar.get_x() + bar.get_width() / 2, 0.05, "stepped aside: noise",
                          rotation=90, ha="center", va="bottom", fontsize="x-small")
    axes.axhline(1.0, color="black", linewidth=0.8)
    axes.set_xticks(range(len(configurations)))
    axes.set_xticklabels([f"{model}\n{mode}\n{link}" for model, mode, link in configurations])
    axes.set_ylabel(ylabel)
    top = max((row["ci_high"] for row in rows if row["variant"] != baseline), default=1.0)
    axes.set_ylim(0, top * 1.2)
    axes.legend(loc="upper right", fontsize="small", ncol=len(variants))
    figure.tight_layout()
    figure.savefig(path, dpi=120)
    plt.close(figure)


#: a Horovod timeline's collectives as a figure draws them.
_OPERATION_COLORS = {"ALLREDUCE": "tab:orange", "REDUCESCATTER": "tab:red",
                     "ALLGATHER": "tab:green"}


def plot_timelines(traces: dict[str, dict], title: str, path: str,
                   transfer_label: str = "transfers", dilation: float = 1.0):
    """One step of worker 0 per variant: its transfers (or reductions) and its compute on
    one time axis; returns the figure (saved to ``path`` and closed). A transfer with a
    fifth field (its collective: ALLREDUCE, REDUCESCATTER, ALLGATHER) is drawn in that
    collective's colour, with a legend where a figure has more than one.

    ``dilation``: the traces' host times are that many times the emulated ones (an
    emulated run); they are drawn divided by it, and the axis says so."""
    import matplotlib
    matplotlib.use("Agg")
    import matplotlib.pyplot as plt
    figure, panels = plt.subplots(len(traces), 1, figsize=(10, 1.8 * len(traces) + 0.6),
                                  sharex=True, squeeze=False)
    ms_per_micro = 1e-3 / dilation
    operations = sorted({t[4] for trace in traces.values() for t in trace["transfers"]
                         if len(t) > 4} - {""})
    colors = {operation: _OPERATION_COLORS.get(operation, "tab:gray")
              for operation in operations}
    for panel, (variant, trace) in zip(panels[:, 0], traces.items()):
        by_color = {}
        for transfer in trace["transfers"]:
            color = colors.get(transfer[4] if len(transfer) > 4 else "", "tab:orange")
            by_color.setdefault(color, []).append((transfer[1] * ms_per_micro,
                                                   transfer[2] * ms_per_micro))
        compute = [(start * ms_per_micro, duration * ms_per_micro)
                   for _, start, duration in trace["compute"]]
        for color, spans in by_color.items():
            panel.broken_barh(spans, (10, 8), facecolors=color)
        panel.broken_barh(compute, (0, 8), facecolors="tab:blue")
        panel.set_yticks([4, 14])
        panel.set_yticklabels(["compute", transfer_label])
        panel.set_title(f"{variant}: step {trace['seconds'] * 1e3 / dilation:.0f} ms",
                        fontsize="small", loc="left")
    panels[-1, 0].set_xlabel(
        "ms since the step's first event (worker 0)" if dilation == 1 else
        f"emulated ms since the step's first event (worker 0): host time / dilation "
        f"{dilation:g}")
    if len(operations) > 1:
        from matplotlib.patches import Patch
        panels[0, 0].legend(handles=[Patch(color=colors[o], label=o.lower())
                                     for o in operations], loc="upper right",
                            fontsize="x-small")
    figure.suptitle(title, fontsize="medium")
    figure.tight_layout()
    figure.savefig(path, dpi=120)
    plt.close(figure)
    return figure
