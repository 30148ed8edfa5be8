"""Costs for the schedulers: profiles of real steps, and estimates where they are missing.

A profile is a versioned JSON file: per-op compute seconds (keyed by node name) and
per-transfer seconds and bytes (keyed by the name of the PS-side source node), medians over
the profiled steps. ``tfoverlap.profiling`` writes them from traced steps.
"""
from __future__ import annotations

import dataclasses
import json
import math
import os
from typing import Mapping

__all__ = ["PROFILE_FORMAT", "PROFILE_VERSION", "Profile", "ProfileError", "load_profile",
           "save_profile", "ring_allreduce_seconds"]

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

    def to_json(self) -> dict:
        return {"format": PROFILE_FORMAT, "version": PROFILE_VERSION, "steps": self.steps,
                "metadata": dict(self.metadata), "op_seconds": dict(self.op_seconds),
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
    transfer_seconds = _seconds_table(data, "transfer_seconds", path)
    transfer_bytes = {name: int(value) for name, value in
                      _seconds_table(data, "transfer_bytes", path).items()}
    return Profile(op_seconds=op_seconds, transfer_seconds=transfer_seconds,
                   transfer_bytes=transfer_bytes, steps=int(data.get("steps", 0)),
                   metadata=data.get("metadata", {}))


def estimate_transfer_seconds(num_bytes: int | None, bandwidth: float) -> float:
    """bytes / bandwidth; an unknown size counts as one 4-byte scalar."""
    return (num_bytes if num_bytes is not None else 4) / bandwidth


def ring_allreduce_seconds(num_bytes, ranks: int, bandwidth: float, latency: float):
    """Time of a ring AllReduce of ``num_bytes`` over ``ranks`` ranks (alpha-beta model):
    ``2 (n-1) latency + 2 (n-1)/n * bytes / bandwidth``; 0 for one rank. Works elementwise
    on numpy arrays of sizes."""
    if ranks <= 1:
        return num_bytes * 0.0
    return 2 * (ranks - 1) / ranks * num_bytes / bandwidth + 2 * (ranks - 1) * latency
