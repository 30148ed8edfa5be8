"""Device specs and matching: one way, everywhere, to say whether a node sits on a device.

A spec names any subset of job, replica, task and device; a device matches when every
field the spec names agrees exactly ("/job:ps/task:1" matches task 1, never task 10).
"""
from __future__ import annotations

import re
from typing import Sequence

__all__ = ["parse_device_spec", "DeviceMatcher", "task_of"]

_DEVICE_FIELD = re.compile(r"/(job|replica|task|device|cpu|gpu|CPU|GPU):?([^/]*)")


def parse_device_spec(spec: str) -> dict[str, str]:
    """Parses "/job:ps/replica:0/task:1/device:CPU:0" (any subset of fields) into a dict.

    Keys: job, replica, task, type, index. Legacy "/cpu:0" and "/gpu:0" are accepted.

    Raises:
      ValueError: the text is not a device spec.
    """
    fields: dict[str, str] = {}
    position = 0
    spec = spec.strip()
    while position < len(spec):
        match = _DEVICE_FIELD.match(spec, position)
        if match is None:
            raise ValueError(f"{spec!r} is not a device spec like '/job:ps' or "
                             "'/job:ps/task:0/device:CPU:0'")
        key, value = match.group(1), match.group(2)
        if key == "device":
            device_type, _, index = value.partition(":")
            fields["type"] = device_type.upper()
            if index:
                fields["index"] = index
        elif key.lower() in ("cpu", "gpu"):
            fields["type"] = key.upper()
            if value:
                fields["index"] = value
        else:
            fields[key] = value
        position = match.end()
    if not fields:
        raise ValueError(f"{spec!r} is not a device spec like '/job:ps'")
    return fields


def task_of(device: str) -> str:
    """"job:task" of a device name: the process (and so the network link) it lives in."""
    fields = _device_fields(device)
    return f"{fields.get('job', '')}:{fields.get('task', '0')}"


def _device_fields(device: str) -> dict[str, str]:
    """The fields of a full device name; parts that are not device fields (a trace's
    "/stream:all", "/memcpy") are ignored rather than refused."""
    try:
        return parse_device_spec(device)
    except ValueError:
        known = "/".join(part for part in device.split("/")
                         if _DEVICE_FIELD.fullmatch("/" + part))
        return parse_device_spec("/" + known) if known else {}


class DeviceMatcher:
    """Says whether a device matches any of several partial device specs: every field a
    spec names must agree exactly. The one way tfoverlap matches devices."""

    def __init__(self, specs: str | Sequence[str]):
        if isinstance(specs, str):
            specs = [s for s in specs.split(",") if s.strip()]
        self._specs = [parse_device_spec(s) for s in specs]
        self._cache: dict[str, bool] = {}

    def __call__(self, device: str) -> bool:
        if device not in self._cache:
            if not device:
                self._cache[device] = False
            else:
                fields = _device_fields(device)
                self._cache[device] = any(
                    all(fields.get(key) == value for key, value in spec.items())
                    for spec in self._specs)
        return self._cache[device]
