"""Profiles of real steps: measuring them (``profile``), and their file format.

A profile is a versioned JSON file: per-op compute seconds (keyed by node name) and
per-transfer seconds and bytes (keyed by the name of the PS-side source node), medians over
the profiled steps. Per-op means are kept too (``op_mean_seconds``): a replay of the
profile on emulated kernels (``emulate=PROFILE``) needs each op's expected time, and on a
busy host an op's time is skewed to the right (preemptions), so the sum of medians falls
short of the step the ops made. And each op's share of the step's compute time
(``op_share_seconds``: every moment that k ops ran split among them) is what a replay takes:
ops that ran together on shared cores stretched each other, so their own durations,
replayed one at a time, count that overlap twice, and replayed side by side, take cores the
host did not have.
"""
from __future__ import annotations

import dataclasses
import json
import math
import os
import statistics
from typing import Mapping

from tfoverlap.costs.trace import (device_filter, emulated_kernels, op_durations, op_wall_shares,
                                   recv_events)

__all__ = ["PROFILE_FORMAT", "PROFILE_VERSION", "Profile", "ProfileError", "load_profile",
           "save_profile", "profile"]

PROFILE_FORMAT = "tfoverlap-profile"
PROFILE_VERSION = 1


class ProfileError(ValueError):
    """A profile file is missing, corrupt, of another version, or of another graph."""


@dataclasses.dataclass(frozen=True)
class Profile:
    op_seconds: Mapping[str, float]
    transfer_seconds: Mapping[str, float]
    transfer_bytes: Mapping[str, int] = dataclasses.field(default_factory=dict)
    steps: int = 0
    metadata: Mapping[str, str] = dataclasses.field(default_factory=dict)
    op_mean_seconds: Mapping[str, float] = dataclasses.field(default_factory=dict)
    op_share_seconds: Mapping[str, float] = dataclasses.field(default_factory=dict)

    def to_json(self) -> dict:
        return {"format": PROFILE_FORMAT, "version": PROFILE_VERSION, "steps": self.steps,
                "metadata": dict(self.metadata), "op_seconds": dict(self.op_seconds),
                "op_mean_seconds": dict(self.op_mean_seconds),
                "op_share_seconds": dict(self.op_share_seconds),
                "transfer_seconds": dict(self.transfer_seconds),
                "transfer_bytes": dict(self.transfer_bytes)}


def save_profile(profile: Profile, path: str) -> None:
    """Writes atomically (a crash never leaves a truncated profile behind)."""
    temporary = f"{path}.tmp-{os.getpid()}"
    with open(temporary, "w") as out:
        json.dump(profile.to_json(), out, indent=1, sort_keys=True)
    os.replace(temporary, path)


def _seconds_table(data: dict, key: str, path: str) -> dict[str, float]:
    table = data.get(key)
    if not isinstance(table, dict):
        raise ProfileError(f"profile {path!r}: field {key!r} is missing or not a table")
    for name, value in table.items():
        if (not isinstance(value, (int, float)) or isinstance(value, bool)
                or not math.isfinite(value) or value < 0):
            raise ProfileError(f"profile {path!r}: {key}[{name!r}] = {value!r} is not a "
                               "non-negative number of seconds")
    return {name: float(value) for name, value in table.items()}


def load_profile(path: str) -> Profile:
    """Reads and validates a profile file.

    Raises:
      ProfileError: naming the file and what is wrong with it.
    """
    try:
        with open(path) as source:
            data = json.load(source)
    except FileNotFoundError:
        raise ProfileError(f"profile {path!r} does not exist") from None
    except (OSError, UnicodeDecodeError) as error:
        raise ProfileError(f"profile {path!r} cannot be read: {error}") from None
    except json.JSONDecodeError as error:
        raise ProfileError(f"profile {path!r} is corrupt or truncated (not valid JSON: "
                           f"{error.msg} at line {error.lineno})") from None
    if not isinstance(data, dict) or data.get("format") != PROFILE_FORMAT:
        raise ProfileError(f"profile {path!r} is not a tfoverlap profile")
    if data.get("version") != PROFILE_VERSION:
        raise ProfileError(f"profile {path!r} has version {data.get('version')!r}; this "
                           f"tfoverlap reads version {PROFILE_VERSION}: profile again")
    op_seconds = _seconds_table(data, "op_seconds", path)
    # Absent from profiles written before means (shares) were kept.
    op_mean_seconds, op_share_seconds = (
        _seconds_table(data, key, path) if key in data else {}
        for key in ("op_mean_seconds", "op_share_seconds"))
    transfer_seconds = _seconds_table(data, "transfer_seconds", path)
    transfer_bytes = {name: int(value) for name, value in
                      _seconds_table(data, "transfer_bytes", path).items()}
    steps, metadata = data.get("steps", 0), data.get("metadata", {})
    if not isinstance(steps, int) or isinstance(steps, bool) or steps < 0:
        raise ProfileError(f"profile {path!r}: steps = {steps!r} is not a number of steps")
    if not isinstance(metadata, dict):
        raise ProfileError(f"profile {path!r}: field 'metadata' is not a table")
    return Profile(op_seconds=op_seconds, transfer_seconds=transfer_seconds,
                   transfer_bytes=transfer_bytes, steps=steps,
                   metadata=metadata, op_mean_seconds=op_mean_seconds,
                   op_share_seconds=op_share_seconds)


def profile(session, fetches, feed_dict=None, steps: int = 5, warmup: int = 1,
            path: str | None = None, worker_device: str = "/job:worker") -> Profile:
    """Runs ``warmup + steps`` steps, the last ``steps`` with full tracing.

    Per-op compute times come from the worker devices' node stats, per-transfer times and
    sizes from its RecvTensor events (keyed by the PS-side source node); each is the median
    over the traced steps. An emulated-accelerator kernel (the emulate option) completes
    for the executor at launch; its time is the stream time it takes, from the graph. Run
    it with the schedule you will compare against switched off (or on: the pass adds no
    nodes, so names match). If ``path`` is given, the profile is written there for the
    ``profile=`` option.
    """
    import tensorflow as tf
    if steps < 1 or warmup < 0:
        raise ValueError("profile needs steps >= 1 and warmup >= 0")
    for _ in range(warmup):
        session.run(fetches, feed_dict=feed_dict)
    op_samples: dict[str, list[float]] = {}
    transfer_samples: dict[str, list[float]] = {}
    transfer_bytes: dict[str, int] = {}
    share_samples: dict[str, list[float]] = {}
    on_worker = device_filter(worker_device)
    options = tf.compat.v1.RunOptions(trace_level=tf.compat.v1.RunOptions.FULL_TRACE,
                                      output_partition_graphs=True)
    for _ in range(steps):
        metadata = tf.compat.v1.RunMetadata()
        session.run(fetches, feed_dict=feed_dict, options=options, run_metadata=metadata)
        stream_seconds = {name: kernel.seconds
                          for name, kernel in emulated_kernels(metadata).items()}
        # A CPU's ops have shares; emulated kernels' stream times are not CPU time.
        shares = {} if stream_seconds else op_wall_shares(metadata, worker_device)
        for name, micros in op_durations(metadata, worker_device).items():
            op_samples.setdefault(name, []).append(stream_seconds.get(name, micros * 1e-6))
            if not stream_seconds:
                share_samples.setdefault(name, []).append(shares.get(name, 0.0) * 1e-6)
        for event in recv_events(metadata):
            if on_worker(event.destination_device) and event.bytes > 0:
                transfer_samples.setdefault(event.source, []).append(
                    event.duration_micros * 1e-6)
                transfer_bytes[event.source] = event.bytes
    result = Profile(
        op_seconds={k: statistics.median(v) for k, v in op_samples.items()},
        transfer_seconds={k: statistics.median(v) for k, v in transfer_samples.items()},
        transfer_bytes=transfer_bytes, steps=steps,
        metadata={"tensorflow": tf.__version__, "worker_device": worker_device},
        op_mean_seconds={k: statistics.fmean(v) for k, v in op_samples.items()},
        op_share_seconds={k: statistics.fmean(v) for k, v in share_samples.items()})
    if path:
        save_profile(result, path)
    return result

