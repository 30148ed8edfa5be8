"""A Horovod job for the launcher tests: every rank reports where it ran and a sum."""
import json
import os

import horovod.tensorflow as hvd
import tensorflow as tf

hvd.init()
total = hvd.allreduce(tf.constant(float(hvd.rank() + 1)), op=hvd.Sum)
print(json.dumps({"rank": hvd.rank(), "size": hvd.size(), "sum": float(total),
                  "mpi": bool(hvd.mpi_enabled()), "gloo": bool(hvd.gloo_enabled()),
                  "netns": os.readlink("/proc/self/ns/net")}), flush=True)
