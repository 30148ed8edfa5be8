"""The Keras optimizer of each cross-step pattern, shared by the Horovod test jobs of
tests/test_cross_step.py (imported from the job's directory)."""
import tensorflow as tf


def optimizer_for(pattern):
    keras = tf.keras.optimizers
    if pattern == "sgd":
        return keras.SGD(0.05)
    if pattern == "adam":
        return keras.Adam(0.01)
    if pattern == "adamw":
        return keras.AdamW(0.01, weight_decay=0.05)
    if pattern == "legacy_momentum":
        return keras.legacy.SGD(0.05, momentum=0.9)
    if pattern == "legacy_adam":
        return keras.legacy.Adam(0.01)
    if pattern == "schedule":
        return keras.SGD(keras.schedules.ExponentialDecay(0.1, 1, 0.7), momentum=0.9)
    if pattern == "clipnorm":
        return keras.SGD(0.05, momentum=0.9, global_clipnorm=1.0)
    return keras.SGD(0.05, momentum=0.9)
