"""Drop-in Horovod wrappers that train with Caramel's schedule.

``import tfoverlap.horovod as tfo_hvd`` and use ``tfo_hvd.DistributedOptimizer`` /
``tfo_hvd.DistributedGradientTape`` where the program used Horovod's: same arguments, same
results, with the backward order fixed and the gradients reduced in planned buckets.

- *Graph mode* (``tf.compat.v1`` optimizers): the gradients are reduced by plain
  ``HorovodAllreduce`` ops (Horovod's own wrapper hides them in a cond that only
  Grappler folds), the Caramel pass is run on the graph as it stands and its rewrite is
  applied to the graph in place (:mod:`tfoverlap.integrations.live_graph`). Sessions need no flag.
- *TF2* (``tf.function`` training steps, Keras optimizers, the tape): Horovod's wrapper is
  used as is and the TfOverlap optimizer is switched on for the ``tf.function`` graphs of
  this thread (:func:`tfoverlap.enable_for_tf_function`), where Grappler has folded the cond.
  Eagerly executed steps have no graph to schedule and run as plain Horovod.

The network model (alpha, beta) is what :func:`configure` was given, else it is measured
once with a few AllReduces of two sizes. Op times come from a profile (``profile=``), from
a profiled warm-up of the graph being built (``profile_steps=N``, graph mode: N traced
steps of the gradients in a private copy of the graph,
:mod:`tfoverlap.integrations.warmup_profile`), else from TensorFlow's FLOP counts over a
measured matrix-product rate. Rank 0's measurements, profile and host facts (compute
threads, Horovod's cycle) are used by every rank so that all ranks plan alike.
"""
from __future__ import annotations

import json
import logging
import os
import tempfile
import time

import numpy as np

from tfoverlap.log import logger

__all__ = ["DistributedOptimizer", "DistributedGradientTape", "configure", "measure_network",
           "measure_flops", "host_facts", "network_model", "caramel_options", "flush_op"]

_configured: dict = {}
_configured_wrapper: dict = {}
_measured: dict = {}


def configure(profile_steps: int = 0, cross_step: bool | str = "auto", **options) -> None:
    """Options for the Caramel pass the wrappers run (see :class:`tfoverlap.options.Options`:
    bandwidth, latency, split_bytes, flops, profile, ...). Validated here.

    ``profile_steps=N``: graph-mode optimizers plan with op times measured by N traced
    warm-up steps of the gradients (rank 0's; every rank must configure alike) instead of
    static estimates. Where the warm-up cannot run, a warning says why and the estimates
    are used.

    ``cross_step``: graph-mode optimizers reduce the gradients that become ready last
    under the next step's forward pass (:mod:`tfoverlap.horovod.deferred`; every value a
    run returns, every checkpoint and the final weights are plain Horovod's). "auto" (the
    default): where Caramel's plan predicts a step at least ``min_gain`` faster than its
    in-step plan's; True: wherever a reduction fits under the forward pass; False:
    never."""
    from tfoverlap.options import parse_options
    if (not isinstance(profile_steps, int) or isinstance(profile_steps, bool)
            or not 0 <= profile_steps <= 100):
        raise ValueError(f"profile_steps must be an integer from 0 to 100, not "
                           f"{profile_steps!r}")
    if not (cross_step is True or cross_step is False
            or isinstance(cross_step, str) and cross_step == "auto"):
        raise ValueError(f"cross_step must be True, False or \"auto\", not {cross_step!r}")
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


def measure_network(small_bytes: int = 4096, large_bytes: int = 8 << 20,
                    repeats: int = 5) -> tuple[float, float]:
    """(bandwidth bytes/s, latency s) of the ring AllReduce, fitted to the median times of
    ``repeats`` AllReduces of two sizes; rank 0's values, broadcast to every rank. The
    latency includes Horovod's per-request cost (negotiation, its cycle)."""
    import horovod.tensorflow as hvd
    import tensorflow as tf
    ranks = hvd.size()
    if ranks < 2:
        return 125e6, 50e-6
    steps = 2 * (ranks - 1)

    def measure(run_small, run_large, agree):
        timed = []
        for run in (run_small, run_large):
            times = []
            for _ in range(repeats + 1):
                began = time.perf_counter()
                run()
                times.append(time.perf_counter() - began)
            timed.append(float(np.median(times[1:])))
        small, large = timed
        latency = max(small / steps, 1e-6)
        bandwidth = steps / ranks * (large_bytes - small_bytes) / max(large - small, 1e-6)
        return agree(np.array([bandwidth, latency]))

    small = np.ones(small_bytes // 4, np.float32)
    large = np.ones(large_bytes // 4, np.float32)
    if tf.executing_eagerly():
        result = measure(
            lambda: hvd.allreduce(tf.constant(small), op=hvd.Sum, name="tfoverlap_measure_s"),
            lambda: hvd.allreduce(tf.constant(large), op=hvd.Sum, name="tfoverlap_measure_l"),
            lambda values: hvd.broadcast(tf.constant(values), 0,
                                         name="tfoverlap_measure_result").numpy())
    else:
        # Fed, not constant: Grappler would fold (run) an AllReduce of constants once, at
        # optimization time.
        with tf.Graph().as_default() as graph:
            inputs = [tf.compat.v1.placeholder(tf.float32, data.shape) for data in (small, large)]
            small_op, large_op = (tf.reduce_sum(hvd.allreduce(tensor, op=hvd.Sum, name=name))
                                  for tensor, name in zip(inputs, ("tfoverlap_measure_s",
                                                                   "tfoverlap_measure_l")))
            values = tf.compat.v1.placeholder(tf.float64, [2])
            agreed = hvd.broadcast(values, 0, name="tfoverlap_measure_result")
        with tf.compat.v1.Session(graph=graph) as session:
            result = measure(lambda: session.run(small_op, {inputs[0]: small}),
                             lambda: session.run(large_op, {inputs[1]: large}),
                             lambda found: session.run(agreed, {values: found}))
    return float(result[0]), float(result[1])


def _array_from_rank0(values: np.ndarray, name: str) -> np.ndarray:
    """Rank 0's ``values`` (a 1-D array of the same length and dtype on every rank), on
    every rank (fed, so that Grappler cannot fold the broadcast)."""
    import horovod.tensorflow as hvd
    import tensorflow as tf
    with tf.Graph().as_default() as graph:
        fed = tf.compat.v1.placeholder(tf.as_dtype(values.dtype), [len(values)])
        agreed = hvd.broadcast(fed, 0, name=name)
    with tf.compat.v1.Session(graph=graph) as session:
        return session.run(agreed, {fed: values})


def _from_rank0(values: list[float], name: str) -> list[float]:
    """Rank 0's ``values``, on every rank."""
    return [float(v) for v in _array_from_rank0(np.array(values, np.float64), name)]


def _bytes_from_rank0(payload: bytes, name: str) -> bytes:
    """Rank 0's ``payload``, on every rank (whatever the others hold)."""
    length = int(_from_rank0([float(len(payload))], name + "_length")[0])
    if not length:
        return b""
    mine = np.frombuffer(payload, np.uint8) if len(payload) == length else np.zeros(
        length, np.uint8)
    return _array_from_rank0(mine, name).tobytes()


def measure_flops() -> float:
    """This host's FLOP/s (:func:`tfoverlap.costs.host.measure_flops`), for Caramel's op
    time estimates when nothing was profiled; rank 0's value, broadcast to every rank."""
    from tfoverlap.costs.host import measure_flops as measure_this_host
    return _from_rank0([measure_this_host()], "tfoverlap_measure_flops")[0]


def host_facts() -> dict:
    """Rank 0's compute threads and Horovod cycle (ms), which Caramel plans with: every rank
    must plan alike, however its host differs."""
    from tfoverlap.planning.caramel import horovod_cycle_seconds
    threads, cycle_ms = _from_rank0([float(os.cpu_count() or 1),
                                     horovod_cycle_seconds(0.0) * 1e3], "tfoverlap_host_facts")
    return {"threads": int(threads), "cycle_ms": cycle_ms}


def network_model() -> dict:
    """The bandwidth, latency and FLOP rate the wrappers plan with (configured or
    measured)."""
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


def _reduce_without_cond(grads, device_dense, device_sparse, compression, sparse_as_dense,
                         op, gradient_predivide_factor, process_set):
    """Horovod's gradient reduction as plain ops (what Horovod's cond holds)."""
    import horovod.tensorflow as hvd
    import tensorflow as tf
    if op == hvd.Average and gradient_predivide_factor != 1.0:
        prescale, postscale = 1.0 / gradient_predivide_factor, gradient_predivide_factor
    else:
        prescale = postscale = 1.0
    reduced = []
    for grad in grads:
        if grad is None:
            reduced.append(None)
            continue
        if sparse_as_dense and isinstance(grad, tf.IndexedSlices):
            grad = tf.convert_to_tensor(grad)
        reduced.append(hvd.allreduce(grad, device_dense=device_dense,
                                     device_sparse=device_sparse, compression=compression,
                                     op=op, prescale_factor=prescale,
                                     postscale_factor=postscale, process_set=process_set))
    return reduced


EMULATION_OPTIONS = ("emulate", "dilation", "emulate_streams", "emulate_blocking")


def warmup_profile(graph, gradients, steps: int, options: dict) -> str:
    """Every rank runs the profiled warm-up (so that the ranks contend for the host as in
    training); rank 0's profile is written to a file of this rank and its path returned,
    or "" (with a warning) where rank 0's warm-up could not run."""
    from tfoverlap.costs.profile import load_profile
    from tfoverlap.integrations.warmup_profile import WarmupError, profile_gradients
    config = None
    if options.get("emulate"):
        from tfoverlap.api import session_config
        config = session_config(schedule="none", **{name: options[name]
                                                     for name in EMULATION_OPTIONS
                                                     if name in options})
    began = time.perf_counter()
    try:
        measured = profile_gradients(graph, gradients, steps, config)
        payload = json.dumps(measured.to_json()).encode()
    except WarmupError as error:
        logger.warning("tfoverlap: the profiled warm-up (profile_steps=%d) cannot run: %s",
                       steps, error)
        payload = b""
    except Exception as error:  # noqa: BLE001 - a warm-up never stops training
        logger.warning("tfoverlap: the profiled warm-up (profile_steps=%d) failed (%s: %s)",
                       steps, type(error).__name__, error)
        payload = b""
    shared = _bytes_from_rank0(payload, "tfoverlap_warmup_profile")
    if not shared:
        logger.warning("tfoverlap: no profiled warm-up on rank 0; Caramel plans with static "
                       "estimates")
        return ""
    handle, path = tempfile.mkstemp(prefix="tfoverlap-warmup-", suffix=".json")
    with os.fdopen(handle, "wb") as stream:     # rank 0's profile file, as it wrote it
        stream.write(shared)
    loaded = load_profile(path)           # validated like any profile file
    logger.info("tfoverlap: profiled warm-up: %d steps, %d ops timed in %.1f s (rank 0's)",
                loaded.steps, len(loaded.op_seconds), time.perf_counter() - began)
    return path


def _schedule_in_place(graph, gradients=(), cross_step: dict | None = None) -> None:
    """Runs the Caramel pass on ``graph`` as built so far and applies it in place.

    With ``profile_steps`` configured it plans with the op times of a profiled warm-up of
    ``gradients``. With ``emulate`` configured Caramel plans with the emulated op times,
    and the emulation itself, which replaces ops (a graph being built cannot have ops
    replaced), is left to the sessions: every session created afterwards runs the emulate
    pass."""
    from tfoverlap.api import enable_for_sessions
    from tfoverlap.integrations.live_graph import apply_rewrite
    from tfoverlap.options import parse_options
    from tfoverlap.passes.base import REPORTS, PassContext
    from tfoverlap.passes.pipeline import run_pipeline
    options = caramel_options()
    steps = _configured_wrapper.get("profile_steps", 0)
    profiled = warmup_profile(graph, gradients, steps, options) if steps and gradients else ""
    if profiled:
        options["profile"] = profiled
    before = graph.as_graph_def()
    context = PassContext(options=parse_options(options), skip=("emulate",))
    try:
        after, report = run_pipeline(before, context)
    finally:
        if profiled:
            os.remove(profiled)
    if options.get("emulate"):
        enable_for_sessions(schedule="none", **{name: options[name]
                                                for name in EMULATION_OPTIONS if name in options})
    if report.modified:
        apply_rewrite(graph, before, after)
    if cross_step is not None:
        for result in report.passes:
            if result.name == "caramel":
                result.summary["cross_step"] = cross_step
    REPORTS.append(report)
    logger.info("%s", report)


def keeps_horovods_reduction(groups, num_groups: int, backward_passes_per_step: int,
                             op) -> bool:
    """Whether an optimizer wrapper must leave the reduction to Horovod (explicit groups,
    gradient accumulation, Adasum), saying so in one warning."""
    import horovod.tensorflow as hvd
    unsupported = [reason for reason, present in (
        ("explicit groups", groups is not None or num_groups),
        ("backward_passes_per_step > 1", backward_passes_per_step > 1),
        ("Adasum", op == hvd.Adasum)) if present]
    if unsupported:
        logger.warning("tfoverlap: %s: Horovod's own reduction is used, without Caramel",
                       ", ".join(unsupported))
    return bool(unsupported)


def DistributedOptimizer(optimizer, name=None, use_locking=False, device_dense="",
                         device_sparse="", compression=None, sparse_as_dense=False,
                         backward_passes_per_step=1, op=None, gradient_predivide_factor=1.0,
                         average_aggregated_gradients=False, num_groups=0, groups=None,
                         process_set=None, scale_local_gradients=True):
    """``hvd.DistributedOptimizer`` with Caramel's schedule (same arguments).

    Explicit ``groups``, gradient accumulation (``backward_passes_per_step > 1``) and
    Adasum keep Horovod's own reduction (Caramel's buckets would replace the first, and
    the others reduce differently), with a warning.
    """
    import horovod.tensorflow as hvd
    import tensorflow as tf
    compression = hvd.Compression.none if compression is None else compression
    op = hvd.Average if op is None else op
    process_set = hvd.global_process_set if process_set is None else process_set
    wrapped = hvd.DistributedOptimizer(
        optimizer, name=name, use_locking=use_locking, device_dense=device_dense,
        device_sparse=device_sparse, compression=compression, sparse_as_dense=sparse_as_dense,
        backward_passes_per_step=backward_passes_per_step, op=op,
        gradient_predivide_factor=gradient_predivide_factor,
        average_aggregated_gradients=average_aggregated_gradients, num_groups=num_groups,
        groups=groups, process_set=process_set, scale_local_gradients=scale_local_gradients)
    if keeps_horovods_reduction(groups, num_groups, backward_passes_per_step, op):
        return wrapped
    if not isinstance(optimizer, tf.compat.v1.train.Optimizer):
        _enable_for_functions()
        return wrapped
    if tf.executing_eagerly():
        logger.warning("tfoverlap: a tf.compat.v1 optimizer run eagerly has no graph to "
                       "schedule; plain Horovod is used")
        return wrapped

    pending: dict = {}      # cross_step: what apply_gradients defers once the updates exist

    def reduce_and_schedule(grads, variables=None, use_generic_names=False):
        reduced = _reduce_without_cond(grads, device_dense, device_sparse, compression,
                                       sparse_as_dense, op, gradient_predivide_factor,
                                       process_set)
        if process_set.size() < 2:
            return reduced
        from tfoverlap.horovod.deferred import deferral_refused, reducing_allreduce
        allreduces = [reducing_allreduce(r) if isinstance(r, tf.Tensor) else None
                      for r in reduced]
        # The rewrite re-points the consumers of each reduced tensor: these Identities.
        reduced = [tf.identity(r) if isinstance(r, tf.Tensor) else r for r in reduced]
        dense = [r for r in reduced if isinstance(r, tf.Tensor)]
        if not dense:
            return reduced
        gradients = [g for g in grads if isinstance(g, tf.Tensor)]
        mode = _configured_wrapper.get("cross_step", "auto")
        decision = None
        if mode:
            refused = (deferral_refused(optimizer, variables, reduced, compression)
                       if variables is not None else "Horovod did not name the variables")
            if not refused:
                pending.update(grads=list(grads), variables=list(variables),
                               reduced=reduced, allreduces=allreduces, gradients=gradients,
                               mode=mode)
                return reduced
            # Asked for: a warning; on by default: one INFO line.
            logger.log(logging.WARNING if mode is True else logging.INFO,
                       "tfoverlap: cross_step: %s; the step is planned on its own", refused)
            decision = {"mode": "on" if mode is True else "auto", "deferred": 0,
                        "reason": refused}
        _schedule_in_place(dense[0].graph, gradients, cross_step=decision)
        return reduced

    original_apply = wrapped.apply_gradients

    def apply_and_defer(grads_and_vars, global_step=None, name=None):
        if not pending:
            return original_apply(grads_and_vars, global_step=global_step, name=name)
        deferrable = dict(pending)
        pending.clear()
        return _defer_and_schedule(
            optimizer, list(grads_and_vars),
            lambda pairs: original_apply(pairs, global_step=global_step, name=name),
            **deferrable)

    wrapped._allreduce_grads = reduce_and_schedule  # noqa: SLF001 - Horovod's hook
    wrapped.apply_gradients = apply_and_defer
    return wrapped


def _defer_and_schedule(optimizer, grads_and_vars, apply_in_step, mode, grads, variables,
                        reduced, allreduces, gradients):
    """cross_step: builds the step with the updates of the gradients that become ready
    last deferred to the next step (:mod:`tfoverlap.horovod.deferred`), then plans the
    rest of the step; returns the train op. ``mode`` "auto" defers where the predicted
    step gains at least min_gain over the in-step plan's; True wherever a reduction fits
    under the forward pass."""
    from tfoverlap.costs.network import ring_allreduce_seconds
    from tfoverlap.horovod.deferred import defer_updates
    from tfoverlap.options import link_bandwidth, parse_options
    from tfoverlap.planning.caramel import (deferred_chunks, deferred_step,
                                            horovod_cycle_seconds, plan_for_graph,
                                            request_latency)
    graph = grads_and_vars[0][1].graph
    # Pair i of grads_and_vars is entry reduced_at[i] of what the reduction returned.
    reduced_at = [next((j for j, variable in enumerate(variables) if variable is pair[1]),
                       None) for pair in grads_and_vars]
    options = parse_options(caramel_options())
    decision = {"mode": "auto" if mode == "auto" else "on", "deferred": 0}
    chunks = []
    try:
        plan, inputs = plan_for_graph(graph.as_graph_def(), options)
        latency = request_latency(options.latency, inputs.ranks,
                                  horovod_cycle_seconds(options.cycle_ms))
        rings = [float(ring_allreduce_seconds(size, inputs.ranks, link_bandwidth(options),
                                              0.0)) for size in plan.sizes]
        request = float(ring_allreduce_seconds(0, inputs.ranks, 1.0, latency))
        pair_of = {allreduces[j].name: i for i, j in enumerate(reduced_at)
                   if j is not None and allreduces[j] is not None}
        # The plan may hold other optimizers' reductions: this one defers its own.
        positions = [[p for p in chunk if plan.model.names[plan.nodes[p]] in pair_of]
                     for chunk in deferred_chunks(plan, rings, request_seconds=request)]
        positions = [chunk for chunk in positions if chunk]
        in_step = min(plan.predicted_step, plan.baseline_step)
        predicted = deferred_step(plan, rings, positions, request)
        gain = 1.0 - predicted / in_step if in_step > 0 else 0.0
        decision.update(in_step_ms=round(in_step * 1e3, 3),
                        predicted_step_ms=round(predicted * 1e3, 3),
                        predicted_gain=round(gain, 4))
        chunks = [[pair_of[plan.model.names[plan.nodes[p]]] for p in chunk]
                  for chunk in positions]
        if not chunks:
            decision["reason"] = ("no reduction of the plan's tail fits under the forward "
                                  "pass")
        elif mode == "auto" and gain < options.min_gain:
            decision["reason"] = (f"deferring would take the step from {in_step * 1e3:.3g} "
                                  f"to {predicted * 1e3:.3g} ms ({gain:+.1%}), below "
                                  f"min_gain {options.min_gain:.1%}")
            chunks = []
    except Exception as error:  # noqa: BLE001 - nothing is changed yet: train as planned
        logger.warning("tfoverlap: cross_step: no plan to defer with (%s: %s); nothing "
                       "deferred", type(error).__name__, error)
        decision["reason"] = f"no plan ({type(error).__name__}: {error})"
    if chunks:
        train = defer_updates(optimizer, grads_and_vars, _aligned(grads, reduced_at),
                              _aligned(reduced, reduced_at), _aligned(allreduces, reduced_at),
                              chunks, apply_in_step)
        from tfoverlap.horovod.deferred import deferral_summary
        decision["deferred"] = deferral_summary(graph).get("deferred", 0)
        if not decision["deferred"]:
            decision["reason"] = "outside the contract (see the warning)"
    else:
        logger.info("tfoverlap: cross_step: nothing deferred: %s", decision.get("reason"))
        train = apply_in_step(grads_and_vars)
    _schedule_in_place(graph, gradients, cross_step=decision)
    return train


def _aligned(values, indices):
    """``values`` reordered by ``indices`` (None where an index is None)."""
    return [None if index is None else values[index] for index in indices]


def flush_op(graph=None):
    """cross_step: the op that applies every pending deferred update (optional: any run
    that uses a deferred variable applies its update first); None where nothing was
    deferred."""
    from tfoverlap.horovod.deferred import flush_op as deferred_flush
    return deferred_flush(graph)


def _enable_for_functions() -> None:
    from tfoverlap.api import enable_for_tf_function
    if _configured_wrapper:
        logger.warning("tfoverlap: %s applies to graph-mode (tf.compat.v1) optimizers; "
                       "tf.function steps are planned when first traced, within the step, "
                       "with static estimates or a profile file (profile=)",
                       " and ".join(sorted(_configured_wrapper)))
    enable_for_tf_function(**caramel_options())


def DistributedGradientTape(gradtape, device_dense="", device_sparse="", compression=None,
                            sparse_as_dense=False, op=None, gradient_predivide_factor=1.0,
                            num_groups=0, groups=None, process_set=None,
                            scale_local_gradients=True):
    """``hvd.DistributedGradientTape`` with Caramel's schedule for ``tf.function`` steps
    (same arguments)."""
    import horovod.tensorflow as hvd
    compression = hvd.Compression.none if compression is None else compression
    op = hvd.Average if op is None else op
    process_set = hvd.global_process_set if process_set is None else process_set
    if groups is None and not num_groups:
        _enable_for_functions()
    else:
        logger.warning("tfoverlap: explicit groups: Horovod's own reduction is used, "
                       "without Caramel")
    return hvd.DistributedGradientTape(
        gradtape, device_dense=device_dense, device_sparse=device_sparse,
        compression=compression, sparse_as_dense=sparse_as_dense, op=op,
        gradient_predivide_factor=gradient_predivide_factor, num_groups=num_groups,
        groups=groups, process_set=process_set, scale_local_gradients=scale_local_gradients)
