"""The ``tf.function`` backend of the Horovod wrappers: work one step leaves pending for
the next step of the same call (tape loops, Keras ``fit`` with several steps a call), the
loop hooks that drain it before the call returns, and the sharded optimizer state."""
