"""The Grappler config of TF2 ``tf.function`` graphs, which TensorFlow keeps in a private
per-thread context: the one place that touches TensorFlow internals with no public API."""
from __future__ import annotations

__all__ = ["get_function_config", "set_function_config"]


def get_function_config():
    """The ConfigProto that Grappler uses for tf.function graphs run from this thread."""
    from tensorflow.core.protobuf import config_pb2
    from tensorflow.python.eager import context
    config = config_pb2.ConfigProto()
    serialized = context.context().function_call_options.config_proto_serialized
    if serialized:
        config.ParseFromString(serialized)
    return config


def set_function_config(config) -> None:
    """Makes ``config`` the Grappler config of tf.function graphs run from this thread.

    TensorFlow reads it when a concrete function is first called: functions that already
    ran keep the config they were optimized with.
    """
    from tensorflow.python.eager import context
    options = context.context().function_call_options
    options.config_proto_serialized = config
    context.context().function_call_options = options
