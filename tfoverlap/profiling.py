"""``tfoverlap.profile``: measure a few traced steps and store TAC's costs."""
from __future__ import annotations

import statistics

from tfoverlap.cost_model import Profile, save_profile
from tfoverlap.trace import op_durations, recv_events

__all__ = ["profile"]


def profile(session, fetches, feed_dict=None, steps: int = 5, warmup: int = 1,
            path: str | None = None, worker_device: str = "/job:worker") -> Profile:
    """Runs ``warmup + steps`` steps, the last ``steps`` with full tracing.

    Per-op compute times come from the worker devices' node stats, per-transfer times and
    sizes from its RecvTensor events (keyed by the PS-side source node); each is the median
    over the traced steps. Run it with the schedule you will compare against switched off
    (or on: the pass adds no nodes, so names match). If ``path`` is given, the profile is
    written there for the ``profile=`` option.
    """
    import tensorflow as tf
    if steps < 1 or warmup < 0:
        raise ValueError("profile needs steps >= 1 and warmup >= 0")
    for _ in range(warmup):
        session.run(fetches, feed_dict=feed_dict)
    op_samples: dict[str, list[float]] = {}
    transfer_samples: dict[str, list[float]] = {}
    transfer_bytes: dict[str, int] = {}
    options = tf.compat.v1.RunOptions(trace_level=tf.compat.v1.RunOptions.FULL_TRACE)
    for _ in range(steps):
        metadata = tf.compat.v1.RunMetadata()
        session.run(fetches, feed_dict=feed_dict, options=options, run_metadata=metadata)
        for name, micros in op_durations(metadata, worker_device).items():
            op_samples.setdefault(name, []).append(micros * 1e-6)
        for event in recv_events(metadata):
            if worker_device in event.destination_device and event.bytes > 0:
                transfer_samples.setdefault(event.source, []).append(
                    event.duration_micros * 1e-6)
                transfer_bytes[event.source] = event.bytes
    result = Profile(
        op_seconds={k: statistics.median(v) for k, v in op_samples.items()},
        transfer_seconds={k: statistics.median(v) for k, v in transfer_samples.items()},
        transfer_bytes=transfer_bytes, steps=steps,
        metadata={"tensorflow": tf.__version__, "worker_device": worker_device})
    if path:
        save_profile(result, path)
    return result
