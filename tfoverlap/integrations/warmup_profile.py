"""A profiled warm-up of a graph still being built: op times measured before training.

Caramel plans when the optimizer is built, before any step has run, so without a profile
it plans with static estimates. :func:`profile_gradients` measures the real op times
instead: it copies the graph as built so far (variables, initializers, input pipelines)
into a private graph, initializes it, and runs a few traced steps that compute the
gradients (not their reductions, which the copy never runs). Placeholders are fed zeros of
their static shapes; a dense model's op times do not depend on the values. The user's
graph and variables are not touched.
"""
from __future__ import annotations

from tfoverlap.costs.profile import Profile, profile

__all__ = ["profile_gradients", "WarmupError"]


class WarmupError(RuntimeError):
    """The copy cannot run the gradients (a placeholder without a static shape, an input
    pipeline that needs its own initialization, ...)."""


def profile_gradients(graph, gradients, steps: int, session_config=None) -> Profile:
    """Per-op times of ``steps`` traced steps (after one untraced) that compute
    ``gradients`` (tensors of ``graph``) in a private copy of ``graph``.

    Raises:
      WarmupError: naming what kept the copy from running.
    """
    import numpy as np
    import tensorflow as tf
    with graph.as_default():          # exporting needs graph mode, even from TF2 code
        meta_graph = tf.compat.v1.train.export_meta_graph(graph=graph)
    copy = tf.Graph()
    with copy.as_default():
        tf.compat.v1.train.import_meta_graph(meta_graph)
        init = [tf.compat.v1.global_variables_initializer(),
                tf.compat.v1.local_variables_initializer(),
                tf.compat.v1.tables_initializer()]
        fetches = [copy.get_tensor_by_name(tensor.name) for tensor in gradients]
        feeds = {}
        for op in _ancestors(fetches):
            if op.type != "Placeholder":
                continue
            output = op.outputs[0]
            if not output.shape.is_fully_defined():
                raise WarmupError(f"placeholder {op.name!r} has no static shape ({output.shape})"
                                  " to feed zeros of")
            feeds[output] = np.zeros(output.shape.as_list(), output.dtype.as_numpy_dtype)
    with tf.compat.v1.Session(graph=copy, config=session_config) as session:
        try:
            session.run(init)
            return profile(session, fetches, feeds, steps=steps, warmup=1, worker_device="")
        except tf.errors.OpError as error:
            raise WarmupError(f"{type(error).__name__}: {_cause(error.message)}") from None


def _ancestors(tensors) -> list:
    """The ops that computing ``tensors`` runs (data and control inputs)."""
    seen, frontier = {}, [tensor.op for tensor in tensors]
    while frontier:
        op = frontier.pop()
        if op.name in seen:
            continue
        seen[op.name] = op
        frontier.extend(tensor.op for tensor in op.inputs)
        frontier.extend(op.control_inputs)
    return list(seen.values())


def _cause(message: str) -> str:
    """TensorFlow's own line of an error message (without its "Graph execution error" and
    node traceback)."""
    lines = [line.strip() for line in (message or "").splitlines() if line.strip()]
    causes = [line for line in lines if not line.startswith(("Graph execution error",
                                                             "Detected at node", "File ",
                                                             "[[", "{{", "Node:"))]
    return causes[-1] if causes else (lines[0] if lines else "unknown error")
