"""The TF1 backend of the Horovod wrappers: work that a train run leaves pending for the
next ``session.run`` (cross-step's deferred reductions, decoupled reduction's all-gathers)
and the sharded optimizer state that checkpoints see whole."""
