"""What the Horovod wrappers measure once per job, on rank 0, for every rank to plan alike:
the ring's bandwidth and latency, the host's FLOP rate, threads and Horovod cycle, and the
op times of a profiled warm-up (:mod:`tfoverlap.integrations.warmup_profile`)."""
from __future__ import annotations

import json
import os
import tempfile
import time

import numpy as np

from tfoverlap.log import logger

__all__ = ["measure_network", "measure_halves", "measure_flops", "host_facts", "warmup_profile",
           "bytes_from_rank0", "EMULATION_OPTIONS"]


def _median_seconds(run, repeats: int) -> float:
    """The median time of ``repeats`` calls of ``run``, after one untimed."""
    run()
    times = []
    for _ in range(repeats):
        began = time.perf_counter()
        run()
        times.append(time.perf_counter() - began)
    return float(np.median(times))


def _alpha_beta(small_seconds: float, large_seconds: float, small_bytes: int,
                large_bytes: int, ranks: int, steps: int,
                cycle_seconds: float = 0.0) -> tuple[float, float]:
    """(bandwidth, latency) of a ring collective of ``steps`` steps, each moving 1/ranks of
    the bytes, fitted to its times at two sizes: ``steps * latency + steps / ranks * bytes
    / bandwidth``. ``cycle_seconds``: Horovod's cycle, taken out of the small time. A lone
    request waits for the next cycle, so it takes max(cycle, ring); the plan adds the cycle
    back as its own term (:func:`tfoverlap.planning.caramel.request_latency`), which then
    counts it once, not twice."""
    latency = max((small_seconds - cycle_seconds) / steps, 1e-6)
    bandwidth = steps / ranks * (large_bytes - small_bytes) / max(
        large_seconds - small_seconds, 1e-6)
    return bandwidth, latency


def measure_network(small_bytes: int = 4096, large_bytes: int = 8 << 20,
                    repeats: int = 5, warm_bytes: int = 384 << 20,
                    warm_seconds: float = 30.0,
                    largest_bytes: int = 128 << 20) -> tuple[float, float]:
    """(bandwidth bytes/s, latency s) of the ring AllReduce, fitted to the median times of
    ``repeats`` AllReduces of two sizes; rank 0's values, broadcast to every rank. The
    latency includes Horovod's negotiation but not its cycle, which the plan adds itself
    (rank 0's HOROVOD_CYCLE_TIME).

    The ring is first warmed with ``warm_bytes`` of large AllReduces, untimed: a job's
    connections are slow for their first hundreds of MB (8 emulated ranks at 25 Gbit/s:
    8 MB took 650 ms at first and 200 ms from about the 25th call on, and stayed there
    after 3 s idle; measured after 24 warm calls the bandwidth read 73-85 MB/s, after 48
    108, of a link of 98), and a plan made from a cold ring priced every bucket at up to
    twice its time. On a slow link the warm-up stops after about ``warm_seconds``: rank 0
    counts the calls that fit from its first, and every rank makes that many (they are
    collectives).

    Back-to-back requests take max(cycle, ring) each: where the large size took less than
    twice the small one (a fast link, a long HOROVOD_CYCLE_TIME), its ring time is hidden
    in the cycle, and the size grows fourfold, up to ``largest_bytes``, until it shows."""
    import horovod.tensorflow as hvd
    import tensorflow as tf

    from tfoverlap.planning.caramel import horovod_cycle_seconds
    ranks = hvd.size()
    if ranks < 2:
        return 125e6, 50e-6

    def fitted(run_small, run_large) -> list[float]:
        """``run_large(nbytes)``: one AllReduce of ``nbytes``."""
        began = time.perf_counter()
        run_large(large_bytes)
        fit = warm_seconds / max(time.perf_counter() - began, 1e-9)
        calls = _from_rank0([min(warm_bytes // large_bytes, fit)], "tfoverlap_measure_warm")
        for _ in range(int(calls[0]) - 1):
            run_large(large_bytes)
        small_seconds = _median_seconds(run_small, repeats)
        size = large_bytes
        while True:
            large_seconds = _median_seconds(lambda: run_large(size), repeats)
            hidden = large_seconds < 2 * small_seconds and 4 * size <= largest_bytes
            if not _from_rank0([float(hidden)], "tfoverlap_measure_grow")[0]:
                break
            size *= 4
        return _from_rank0(list(_alpha_beta(small_seconds, large_seconds, small_bytes, size,
                                            ranks, 2 * (ranks - 1),
                                            horovod_cycle_seconds(0.0))),
                           "tfoverlap_measure_result")

    made: dict = {}

    def ones(nbytes: int):
        """``nbytes`` of ones, made once: a copy made in each call would be timed."""
        if nbytes not in made:
            made[nbytes] = (tf.ones([nbytes // 4], tf.float32) if tf.executing_eagerly()
                            else np.ones(nbytes // 4, np.float32))
        return made[nbytes]

    if tf.executing_eagerly():
        bandwidth, latency = fitted(
            lambda: hvd.allreduce(ones(small_bytes), op=hvd.Sum, name="tfoverlap_measure_s"),
            lambda nbytes: hvd.allreduce(ones(nbytes), op=hvd.Sum,
                                         name="tfoverlap_measure_l"))
    else:
        # Fed, not constant: Grappler would fold (run) an AllReduce of constants once, at
        # optimization time.
        with tf.Graph().as_default() as graph:
            inputs = [tf.compat.v1.placeholder(tf.float32, [None]) for _ in range(2)]
            small_op, large_op = (tf.reduce_sum(hvd.allreduce(fed, op=hvd.Sum, name=name))
                                  for fed, name in zip(inputs, ("tfoverlap_measure_s",
                                                                "tfoverlap_measure_l")))
        with tf.compat.v1.Session(graph=graph) as session:
            bandwidth, latency = fitted(
                lambda: session.run(small_op, {inputs[0]: ones(small_bytes)}),
                lambda nbytes: session.run(large_op, {inputs[1]: ones(nbytes)}))
    return bandwidth, latency


def measure_halves(small_bytes: int = 4096, large_bytes: int = 64 << 20,
                   repeats: int = 5) -> dict:
    """{"scatter": (bandwidth, latency), "gather": ...} of Horovod's reduce-scatter and
    all-gather, fitted like :func:`measure_network` with n - 1 steps each, the bytes
    counted whole; rank 0's, on every rank. Decoupled reduction plans with them: a
    library's halves need not cost half an AllReduce each (Gloo's reduce-scatter is not a
    ring). ``large_bytes`` is a bucket's size: Gloo's reduce-scatter is slower per byte
    there than at a few MB (fitted at 8 MB, it priced ResNet-50's buckets at a third)."""
    import horovod.tensorflow as hvd
    import tensorflow as tf
    ranks = hvd.size()
    if ranks < 2:
        return {"scatter": (250e6, 50e-6), "gather": (250e6, 50e-6)}
    sizes = [max(ranks, size // 4 // ranks * ranks) for size in (small_bytes, large_bytes)]
    with tf.Graph().as_default() as graph:
        wholes = [tf.compat.v1.placeholder(tf.float32, [size]) for size in sizes]
        shards = [tf.compat.v1.placeholder(tf.float32, [size // ranks]) for size in sizes]
        scatters = [tf.reduce_sum(hvd.reducescatter(tensor, op=hvd.Sum,
                                                    name=f"tfoverlap_measure_scatter{i}"))
                    for i, tensor in enumerate(wholes)]
        gathers = [tf.reduce_sum(hvd.allgather(tensor, name=f"tfoverlap_measure_gather{i}"))
                   for i, tensor in enumerate(shards)]
    fits = []
    with tf.compat.v1.Session(graph=graph) as session:
        for ops, fed in ((scatters, wholes), (gathers, shards)):
            seconds = [_median_seconds(
                lambda op=op, tensor=tensor: session.run(
                    op, {tensor: np.ones(tensor.shape.as_list(), np.float32)}), repeats)
                for op, tensor in zip(ops, fed)]
            fits.extend(_alpha_beta(*seconds, 4 * sizes[0], 4 * sizes[1], ranks, ranks - 1))
    result = _from_rank0(fits, "tfoverlap_measure_halves")
    return {"scatter": (float(result[0]), float(result[1])),
            "gather": (float(result[2]), float(result[3]))}


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


def bytes_from_rank0(payload: bytes, name: str) -> bytes:
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
    except Exception as error:  # noqa: BLE001 - a warm-up never stops training
        why = (f"cannot run: {error}" if isinstance(error, WarmupError)
               else f"failed ({type(error).__name__}: {error})")
        logger.warning("tfoverlap: the profiled warm-up (profile_steps=%d) %s", steps, why)
        payload = b""
    shared = bytes_from_rank0(payload, "tfoverlap_warmup_profile")
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

