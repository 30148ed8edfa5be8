"""The Horovod wrappers' core, shared by every API and both mechanisms, as plain data:
the reduction rules, the decisions, the plans, the bucket layout, and the one way to hook
TensorFlow, Keras or Horovod."""
