"""What the Horovod wrappers decided, in one form for every API: :class:`Decision`, and one
registry (:func:`decisions`) of each wrapped object's mechanisms' decision dicts (the
Caramel report's ``cross_step``/``decouple`` entries), made into a :class:`Decision` when
asked, so that figures that grow later (a Keras fit's drains) are current."""
from __future__ import annotations

import dataclasses
import threading

__all__ = ["Decision", "planned", "record", "decisions", "recent_decisions"]

#: the mechanisms, in the order a wrapper tries them
MECHANISMS = ("decouple", "cross_step")
_lock = threading.Lock()
_entries: dict = {}         # key -> {"api", "name", "plans": {mechanism: dict or callable}}


@dataclasses.dataclass(frozen=True)
class Decision:
    """What one wrapped optimizer (graph), tape step or Keras train function runs.

    ``mechanism``: "decouple", "cross_step" or "in_step" (Caramel's plan within the step);
    ``deferred`` (``deferred_mb``): the gradients reduced after their step; the predicted
    step with the mechanism and in-step; ``declined``: why, per mechanism not used."""
    api: str
    name: str
    mechanism: str
    mode: str
    deferred: int
    deferred_mb: float | None
    predicted_step_ms: float | None
    in_step_ms: float | None
    declined: dict
    plan: dict

    @property
    def reason(self) -> str:
        """Why nothing was deferred or decoupled ("" where something was)."""
        return "" if self.mechanism != "in_step" else "; ".join(
            f"{mechanism}: {why}" for mechanism, why in self.declined.items())


def planned(mechanism: str, mode, reason: str = "") -> dict:
    """A mechanism's decision dict before its plan fills it in: its ``mode``, nothing
    deferred or decoupled yet, and the ``reason`` where it was declined."""
    plan = {"mode": "auto" if mode == "auto" else "on",
            "decoupled" if mechanism == "decouple" else "deferred": 0}
    if reason:
        plan["reason"] = reason
    return plan


def record(plan, api: str, key=None, name: str = "", mechanism: str | None = None) -> None:
    """Keeps ``plan`` (a decision dict, or a callable that returns the current one) as what
    ``mechanism`` (by default: the one the plan counts) decided for the wrapped object
    ``key``; a later plan of the same key and mechanism replaces it."""
    if mechanism is None:
        mechanism = "decouple" if "decoupled" in _current(plan) else "cross_step"
    if mechanism not in MECHANISMS:
        raise ValueError(f"unknown mechanism {mechanism!r}")
    with _lock:
        entry = _entries.setdefault(key if key is not None else object(),
                                    {"api": api, "name": name, "plans": {}})
        entry["plans"][mechanism] = plan
        if name:
            entry["name"] = name


def _current(plan, last: dict | None = None, mechanism: str = "") -> dict:
    """The plan's dict now; for a callable whose object is gone (None), the last one."""
    current = plan() if callable(plan) else plan
    if last is None:
        return dict(current or {})
    if current is not None:
        last[mechanism] = dict(current)
    return dict(last.get(mechanism) or {})


def _decision(entry: dict) -> Decision:
    plans = {mechanism: _current(plan, entry.setdefault("last", {}), mechanism)
             for mechanism, plan in entry["plans"].items()}
    used = next((mechanism for mechanism in MECHANISMS
                 if plans.get(mechanism, {}).get("decoupled" if mechanism == "decouple"
                                                 else "deferred")), None)
    shown = plans[used] if used else next(plans[m] for m in MECHANISMS if m in plans)
    declined = {mechanism: plan.get("reason") or "not used"
                for mechanism, plan in plans.items() if mechanism != used}
    count = shown.get("decoupled" if used == "decouple" else "deferred", 0) if used else 0
    return Decision(api=entry["api"], name=entry["name"], mechanism=used or "in_step",
                    mode=shown.get("mode", "on"), deferred=int(count or 0),
                    deferred_mb=shown.get("deferred_mb"),
                    predicted_step_ms=shown.get("predicted_step_ms"),
                    in_step_ms=shown.get("in_step_ms"), declined=declined, plan=shown)


def decisions() -> list[Decision]:
    """What was decided for every wrapped optimizer (graph mode), tape step and Keras train
    function of this process, oldest first (one entry each, from its first trace)."""
    with _lock:
        entries = list(_entries.values())
    return [_decision(entry) for entry in entries]


def recent_decisions() -> list[dict]:
    """Every mechanism's decision dict (with its ``api``), oldest first: what ``tfoverlap
    run``'s summary line counts."""
    with _lock:
        entries = list(_entries.values())
    return [dict(_current(plan, entry.setdefault("last", {}), mechanism), api=entry["api"])
            for entry in entries for mechanism, plan in entry["plans"].items()]
