"""The simulator: a discrete-event engine on plain data (``engine``) and the what-if
builders that turn a PS or Horovod graph into its tasks (``ps``, ``allreduce``)."""
