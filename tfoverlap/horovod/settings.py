"""The options the Horovod wrappers plan with: what :func:`configure` was given, else
what was measured once (:mod:`tfoverlap.horovod.measure`)."""
from __future__ import annotations

from tfoverlap.horovod.measure import (host_facts, measure_flops, measure_halves,
                                       measure_network)
from tfoverlap.log import logger

__all__ = ["configure", "network_model", "caramel_options", "wrapper_option",
           "wrapper_options", "decoupled_network"]

_configured: dict = {}
_configured_wrapper: dict = {}
_measured: dict = {}


def configure(profile_steps: int = 0, cross_step: bool | str = "auto",
              decouple: bool | str = False, **options) -> None:
    """Options for the Caramel pass the wrappers run (:class:`tfoverlap.options.Options`:
    bandwidth, latency, split_bytes, flops, profile, ...), validated here, and the
    wrappers' own (docs/horovod.md):

    ``profile_steps=N``: graph-mode optimizers plan with the op times of N traced warm-up
    steps (rank 0's; every rank configures alike), else with static estimates and a
    warning saying why. ``cross_step``: the reductions the plan picks go under the
    next step's forward pass, in the order it needs them (graph mode; Keras ``fit`` and
    tape loops within a call): "auto" (the default) where the plan predicts ``min_gain``
    over its in-step plan, True wherever one fits, False never. ``decouple``: reduce-scatter, sharded
    update and all-gather under the next forward pass: True wherever the program allows
    it, "auto" where the plan predicts ``min_gain`` over the best of the others, False
    (the default) never."""
    from tfoverlap.options import parse_options
    if (not isinstance(profile_steps, int) or isinstance(profile_steps, bool)
            or not 0 <= profile_steps <= 100):
        raise ValueError(f"profile_steps must be an integer from 0 to 100, not "
                           f"{profile_steps!r}")
    for name, value in (("cross_step", cross_step), ("decouple", decouple)):
        if not (value is True or value is False or isinstance(value, str) and value == "auto"):
            raise ValueError(f"{name} must be True, False or \"auto\", not {value!r}")
    if profile_steps and options.get("profile"):
        raise ValueError("give either profile (a profile file) or profile_steps (a "
                           "profiled warm-up), not both")
    parse_options({**options, "allreduce": "caramel"})
    _configured.clear()
    _configured.update(options)
    _configured_wrapper.clear()
    if profile_steps:
        _configured_wrapper["profile_steps"] = profile_steps
    if cross_step != "auto":
        _configured_wrapper["cross_step"] = cross_step
    if decouple is not False:
        _configured_wrapper["decouple"] = decouple


def wrapper_option(name: str, default=None):
    """A wrapper option given to :func:`configure` (profile_steps, cross_step, decouple)."""
    return _configured_wrapper.get(name, default)


def wrapper_options() -> dict:
    """The wrapper options :func:`configure` was given explicitly."""
    return dict(_configured_wrapper)


def network_model() -> dict:
    """The bandwidth, latency and FLOP rate the wrappers plan with (configured or measured)."""
    return {key: _configured.get(key, _measured.get(key))
            for key in ("bandwidth", "latency", "flops")}


def caramel_options() -> dict:
    """The options the wrappers pass to the Caramel pass (measuring the network once if
    neither bandwidth nor latency was configured)."""
    options = {"allreduce": "caramel", "schedule": "none", **_configured}
    if "bandwidth" not in options and "latency" not in options:
        if "bandwidth" not in _measured:
            bandwidth, latency = measure_network()
            _measured.update(bandwidth=bandwidth, latency=latency)
            logger.info("tfoverlap: measured AllReduce bandwidth %.3g B/s, latency %.3g s",
                        bandwidth, latency)
        options.update(bandwidth=_measured["bandwidth"], latency=_measured["latency"])
    if "flops" not in options and "profile" not in options:
        if "flops" not in _measured:
            _measured["flops"] = measure_flops()
            logger.info("tfoverlap: measured %.3g FLOP/s", _measured["flops"])
        options["flops"] = _measured["flops"]
    if "threads" not in options or "cycle_ms" not in options:
        if "threads" not in _measured:
            _measured.update(host_facts())
        options.setdefault("threads", _measured["threads"])
        options.setdefault("cycle_ms", _measured["cycle_ms"])
    return options


def decoupled_network() -> dict | None:
    """{"scatter": (bandwidth, latency), "gather": ...}: what decoupled reduction plans its
    reduce-scatters and all-gathers with, measured once (:func:`measure_halves`); None
    where the network was configured (then each is half the configured AllReduce)."""
    if "bandwidth" in _configured or "latency" in _configured:
        return None
    if "halves" not in _measured:
        _measured["halves"] = measure_halves()
        logger.info("tfoverlap: measured reduce-scatter %.3g B/s, %.3g s; all-gather "
                    "%.3g B/s, %.3g s", *_measured["halves"]["scatter"],
                    *_measured["halves"]["gather"])
    return _measured["halves"]
