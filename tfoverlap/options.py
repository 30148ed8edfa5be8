"""The options of the TfOverlap passes: one validated object for the plugin, the API and the CLI.

Options arrive as Python keyword arguments (``session_config(schedule="tac")``), as the
``parameter_map`` of the Grappler custom optimizer (AttrValue protos), or as CLI flags.
All three go through :func:`parse_options`, which names the offending option in a
``ValueError``.
"""
from __future__ import annotations

import dataclasses
import re
from typing import Any, Mapping

from tfoverlap.costs.accelerators import DEVICE_MODELS, load_device_model
from tfoverlap.costs.profile import load_profile
from tfoverlap.graph.devices import parse_device_spec

__all__ = ["Options", "parse_options", "parse_bandwidth", "option_help", "OPTION_NAMES",
           "DEFAULT_BANDWIDTH", "link_bandwidth"]

#: the link rate assumed where none is given or measured: 1 Gbit/s.
DEFAULT_BANDWIDTH = 125e6

SCHEDULES = ("tic", "tac", "none")
ALLREDUCE_SCHEDULES = ("caramel", "none")
GATES = ("arrival", "consumer")
LAYOUTS = ("auto", "dedicated", "colocated")
BUCKET_CHAINS = ("issued", "finished", "none")


@dataclasses.dataclass(frozen=True)
class Options:
    """What the passes do.

    schedule:    parameter-server transfer ordering: "tic" (from the DAG alone), "tac"
                 (from profiled or estimated times) or "none".
    credit:      bytes of ordered transfers that leave a PS together (a release group):
                 consecutive transfers in the order share one gate while their bytes stay
                 within the credit, and a larger one goes alone. "auto" (default): the
                 link's bandwidth x round_trip (what keeps it busy across a gate's round
                 trip), and at least 1/32 of the bytes ordered per step (so one step pays
                 at most about 32 gate messages). 0: one transfer per group.
    window:      how many release groups may be in flight at once on each PS task's link:
                 group j leaves its PS task when that task's group j-window has arrived
                 (1 = strictly serial; 2 keeps one group in flight while the next is
                 released).
    round_trip:  seconds from a gate firing on the worker to the released transfer's first
                 byte (the control message to the PS and its response), for credit="auto".
    min_gain:    act only where the predicted gain is at least this fraction of the step
                 (0.03 = 3%); below it a pass leaves the graph unchanged and says why.
    force:       act even where the predicted gain is below min_gain.
    gate:        what releases the next transfer: "arrival" (a tiny worker-side Identity
                 that runs when the previous transfer has arrived) or "consumer" (the first
                 worker op that uses it, which also waits for its other inputs; an arrival
                 gate where no consumer outside control flow can serve).
    ps_devices:  comma-separated device specs whose nodes are parameter servers; a device
                 matches when every field the spec names agrees ("/job:ps" matches every
                 device of job ps, "/device:CPU:1" every CPU:1).
    workers:     how many workers pull from each PS task, sharing its link (TicTac's gain
                 estimate). 0 (default): the tasks that are not PS tasks in the cluster of
                 the TF_CONFIG environment variable (tf.distribute's), else 1.
    layout:      where the PS tasks run, for TicTac's gain estimate: "dedicated" (hosts of
                 their own), "colocated" (PS task i on worker i's host, sharing its link;
                 ``workers`` then counts every worker; ordered training steps are
                 predicted at the default's time, so TicTac steps aside there), or "auto"
                 (default): colocated where TF_CONFIG puts a PS task at this task's
                 address host (not loopback), else dedicated.
    profile:     a profile file written by ``tfoverlap.profile`` (TAC's costs); "" for none.
    bandwidth:   bytes per second of a link: transfer times missing from the profile, and
                 Caramel's beta (a number or a string such as "10Gbit"). "auto" (default):
                 TicTac takes the PS link that this process measured when its session
                 started (see tfoverlap.integrations.link_probe), else 1 Gbit/s; Caramel
                 takes 1 Gbit/s (the Horovod wrappers measure and give it).
    allreduce:   Horovod AllReduce scheduling: "caramel" (backward order, planned buckets,
                 split large gradients) or "none".
    bucket_chain: Caramel: how each AllReduce request waits for the one before it, so that
                 Horovod gets them in plan order: "issued" (default; it waits until the
                 inputs of the one before are ready, so both can be in flight), "finished"
                 (until the one before has been reduced: one negotiation and cycle per
                 bucket, in series) or "none" (TensorFlow's executor decides).
    ranks:       Caramel: ranks in the job; 0 reads it from Horovod (or HOROVOD_SIZE /
                 OMPI_COMM_WORLD_SIZE).
    latency:     Caramel's alpha: seconds per message of a ring step.
    split_bytes: Caramel: gradients larger than this are reduced in pieces of about this size.
    bucket_bytes: Caramel: the largest bucket of several gradients (pipelining: the
                 reduction of one bucket overlaps the copies of the next).
    flops:       FLOP/s for estimating op times when there is no profile (Caramel's ready
                 times, TicTac's gain estimate; only the relation to the network matters).
                 0 (default): TicTac measures this host once per process; Caramel, whose
                 ranks must plan alike, takes 2e10 (the Horovod wrappers give it rank 0's
                 measured value).
    threads:     Caramel: a rank's compute threads (TensorFlow's inter-op pool) in the
                 ready-time simulation; 0 takes this host's CPU count.
    cross_step:  the Horovod wrappers (graph mode, tape loops, Keras): reduce some gradients
                 under the next step's forward pass, in the order it needs them (the
                 plan's choice: those ready last, or those the forward pass needs last).
                 "auto" (default): where the plan predicts a gain of min_gain; true:
                 wherever one fits; false.
    decouple:    the Horovod wrappers (graph mode, tape loops in a tf.function, Keras fit
                 with several steps per call): reduce-scatter the gradients, update each
                 rank's shard, all-gather the parameters under the next forward pass.
                 false (default), "auto" (where the plan, with the halves measured,
                 predicts a gain of min_gain over the other plans) or true.
    cycle_ms:    Caramel: Horovod's cycle time in ms, part of each bucket's cost; 0 takes
                 HOROVOD_CYCLE_TIME, else Horovod's default of 1 ms. Ranks must plan alike:
                 the Horovod wrappers set both to rank 0's values.
    strict:      a failing pass raises PassFailure from ``optimize`` instead of a warning; in
                 a session it becomes an optimizer error status that TensorFlow logs before
                 running the unoptimized graph (tests).
    report_dir:  if set, every run writes its report there as JSON.
    emulate:     "" (off), a device model ("v100", "a100", "h100") or a device file (JSON):
                 the workers' heavy compute ops become emulated-accelerator kernels that
                 take that device's time without using the host CPU (benchmarks; the
                 results of such a graph are zeros). Runs after TicTac and Caramel.
    dilation:    emulated durations are multiplied by this (>= 1); the testbed divides
                 link rates by the same factor, so that the host's own work is small
                 against the emulated step.
    emulate_streams: emulated kernels of a device run one at a time on each of this many
                 streams, in issue order; with emulate_blocking, on this many threads,
                 each kernel on the first one free (a CPU executor's inter-op pool).
    emulate_blocking: emulated kernels complete for TensorFlow's executor when they end (a
                 CPU's semantics), instead of at launch with a wait where their results
                 leave the stream (a GPU's, the default).

    given:       not an option: the names of the options that were given (the others
                 have their defaults), as :func:`parse_options` saw them.
    """

    schedule: str = "tic"
    credit: float | str = "auto"
    window: int = 2
    round_trip: float = 1e-3
    min_gain: float = 0.03
    force: bool = False
    gate: str = "arrival"
    ps_devices: str = "/job:ps"
    workers: int = 0
    layout: str = "auto"
    profile: str = ""
    bandwidth: float = 0.0          # 0: "auto"
    allreduce: str = "none"
    bucket_chain: str = "issued"
    ranks: int = 0
    latency: float = 50e-6
    split_bytes: float = 64e6
    bucket_bytes: float = 4 * 2 ** 20
    flops: float = 0.0
    threads: int = 0
    cycle_ms: float = 0.0
    cross_step: bool | str = "auto"
    decouple: bool | str = False
    strict: bool = False
    report_dir: str = ""
    emulate: str = ""
    dilation: float = 1.0
    emulate_streams: int = 1
    emulate_blocking: bool = False
    given: frozenset[str] = dataclasses.field(default=frozenset(), compare=False, repr=False)


OPTION_NAMES = tuple(field.name for field in dataclasses.fields(Options)
                     if field.name != "given")


def option_help() -> dict[str, str]:
    """Each option's description, from the :class:`Options` docstring (one source for the
    API's documentation and the command line's help)."""
    described: dict[str, list[str]] = {}
    current = None
    for line in (Options.__doc__ or "").splitlines():
        entry = re.match(r"^    (\w+):\s+(.*)$", line)
        if entry:
            current = entry.group(1)
            described[current] = [entry.group(2).strip()]
        elif current and line.startswith(" " * 8) and line.strip():
            described[current].append(line.strip())
        else:
            current = None
    return {name: " ".join(described.get(name, [])) for name in OPTION_NAMES}


def link_bandwidth(options: Options) -> float:
    """The bandwidth option, or DEFAULT_BANDWIDTH where it says "auto"."""
    return options.bandwidth or DEFAULT_BANDWIDTH

_BANDWIDTH_UNITS = {
    "": 1.0, "b": 1.0, "bps": 1 / 8, "bit": 1 / 8,
    "kbit": 1e3 / 8, "mbit": 1e6 / 8, "gbit": 1e9 / 8,
    "kb": 1e3, "mb": 1e6, "gb": 1e9,
}


def parse_bandwidth(value: Any) -> float:
    """Bytes per second from a number (bytes/s) or a string such as "10Gbit" or "125MB"."""
    if isinstance(value, bool):
        raise ValueError(f"bandwidth must be a number or a string like '10Gbit', got {value!r}")
    if isinstance(value, (int, float)):
        rate = float(value)
    else:
        match = re.fullmatch(r"\s*([0-9]*\.?[0-9]+(?:[eE][-+]?[0-9]+)?)\s*([A-Za-z]*)(?:/s)?\s*",
                             str(value))
        unit = match.group(2).lower() if match else None
        if match is None or unit not in _BANDWIDTH_UNITS:
            raise ValueError(f"bandwidth {value!r} is not understood; use bytes/s or a value "
                             "like '100Mbit', '10Gbit', '125MB'")
        rate = float(match.group(1)) * _BANDWIDTH_UNITS[unit]
    if not rate > 0 or rate == float("inf"):
        raise ValueError(f"bandwidth must be positive and finite, got {value!r}")
    return rate


def _as_bool(name: str, value: Any) -> bool:
    if isinstance(value, bool):
        return value
    if isinstance(value, int) and value in (0, 1):
        return bool(value)
    if isinstance(value, str) and value.lower() in ("true", "false", "1", "0"):
        return value.lower() in ("true", "1")
    raise ValueError(f"option {name!r} must be true or false, got {value!r}")


def _as_int(name: str, value: Any) -> int:
    if isinstance(value, bool):
        raise ValueError(f"option {name!r} must be an integer, got {value!r}")
    try:
        number = int(value) if not isinstance(value, float) or value.is_integer() else None
    except (TypeError, ValueError):
        number = None
    if number is None:
        raise ValueError(f"option {name!r} must be an integer, got {value!r}")
    return number


def _as_float(name: str, value: Any) -> float:
    if isinstance(value, bool):
        raise ValueError(f"option {name!r} must be a number, got {value!r}")
    try:
        number = float(value)
    except (TypeError, ValueError):
        raise ValueError(f"option {name!r} must be a number, got {value!r}") from None
    if number != number or number in (float("inf"), float("-inf")):
        raise ValueError(f"option {name!r} must be finite, got {value!r}")
    return number


def _parse_credit(value: Any) -> float | str:
    """"auto" or bytes: a number or a size such as "4MB", "512KB", "1MiB"."""
    if isinstance(value, str) and value.strip().lower() == "auto":
        return "auto"
    text = str(value).strip()
    match = re.fullmatch(r"([0-9]*\.?[0-9]+(?:[eE][-+]?[0-9]+)?)\s*([KMG]i?B|B)?", text,
                         re.IGNORECASE)
    if isinstance(value, bool) or match is None:
        raise ValueError(f"option 'credit' must be 'auto' or bytes (a number, or a size like "
                         f"'4MB'), got {value!r}")
    unit = (match.group(2) or "B").upper()
    scale = {"B": 1, "KB": 1e3, "MB": 1e6, "GB": 1e9,
             "KIB": 2 ** 10, "MIB": 2 ** 20, "GIB": 2 ** 30}[unit]
    credit = float(match.group(1)) * scale
    if credit == float("inf"):
        raise ValueError(f"option 'credit' must be finite, got {value!r}")
    return credit


def _validate_ps_devices(value: str) -> str:
    specs = [spec.strip() for spec in value.split(",") if spec.strip()]
    if not specs:
        raise ValueError("option 'ps_devices' must name at least one device spec, e.g. '/job:ps'")
    for spec in specs:
        parse_device_spec(spec)
    return ",".join(specs)


def parse_options(values: Mapping[str, Any] | None = None, *,
                  check_files: bool = True) -> Options:
    """Validates raw option values and returns an :class:`Options`.

    Raises:
      ValueError: an unknown option, or a value out of range, naming the option. With
        ``check_files`` a profile that is missing, corrupt or of another format is
        reported here, at config time; the plugin passes False, since the pass that uses
        the profile reads (and checks) it anyway.
    """
    values = dict(values or {})
    unknown = sorted(set(values) - set(OPTION_NAMES))
    if unknown:
        raise ValueError(f"unknown tfoverlap option {unknown[0]!r}; known options: "
                         f"{', '.join(OPTION_NAMES)}")
    parsed: dict[str, Any] = {}
    for name, value in values.items():
        if name == "schedule":
            value = str(value).lower()
            if value not in SCHEDULES:
                raise ValueError(f"option 'schedule' must be one of {SCHEDULES}, got {value!r}")
        elif name in ("gate", "bucket_chain", "layout"):
            value = str(value).lower()
            choices = {"gate": GATES, "bucket_chain": BUCKET_CHAINS, "layout": LAYOUTS}[name]
            if value not in choices:
                raise ValueError(f"option {name!r} must be one of {choices}, got {value!r}")
        elif name == "allreduce":
            value = str(value).lower()
            if value not in ALLREDUCE_SCHEDULES:
                raise ValueError(f"option 'allreduce' must be one of {ALLREDUCE_SCHEDULES}, "
                                 f"got {value!r}")
        elif name in ("ranks", "threads", "workers"):
            value = _as_int(name, value)
            if value < 0:
                asked = "TF_CONFIG" if name == "workers" else "the host"
                raise ValueError(f"option {name!r} must be 0 (ask {asked}) or more, "
                                 f"got {value}")
        elif name in ("latency", "split_bytes", "bucket_bytes", "flops", "cycle_ms",
                      "round_trip", "min_gain"):
            value = _as_float(name, value)
            lowest = ("positive" if name in ("split_bytes", "bucket_bytes") else
                      "non-negative")
            if value < 0 or (lowest == "positive" and value == 0):
                raise ValueError(f"option {name!r} must be {lowest}, got {value}")
        elif name in ("window", "emulate_streams"):
            value = _as_int(name, value)
            if value < 1:
                raise ValueError(f"option {name!r} must be at least 1, got {value}")
        elif name == "dilation":
            value = _as_float(name, value)
            if value < 1:
                raise ValueError(f"option 'dilation' must be at least 1, got {value}")
        elif name == "emulate":
            value = "" if value is None else str(value).strip()
        elif name == "ps_devices":
            value = _validate_ps_devices(str(value))
        elif name in ("profile", "report_dir"):
            value = "" if value is None else str(value)
        elif name == "bandwidth":
            try:
                auto = value == 0 or (isinstance(value, str) and value.strip().lower() == "auto")
                value = 0.0 if auto and not isinstance(value, bool) else parse_bandwidth(value)
            except ValueError as error:
                raise ValueError(f"option 'bandwidth': {error}") from None
        elif name == "credit":
            value = _parse_credit(value)
        elif name in ("strict", "force", "emulate_blocking"):
            value = _as_bool(name, value)
        elif name in ("cross_step", "decouple"):
            if isinstance(value, str) and value.strip().lower() == "auto":
                value = "auto"
            else:
                try:
                    value = _as_bool(name, value)
                except ValueError:
                    raise ValueError(f"option {name!r} must be true, false or auto, got "
                                     f"{value!r}") from None
        parsed[name] = value
    options = Options(**parsed, given=frozenset(parsed))
    if check_files and options.profile:
        load_profile(options.profile)
    if options.emulate and (check_files or options.emulate.lower() in DEVICE_MODELS
                            or not options.emulate.lower().endswith(".json")):
        load_device_model(options.emulate)
    return options
