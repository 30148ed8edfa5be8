"""A tf.distribute.Server task that records a profiler capture of everything it runs.

argv: CLUSTER_JSON JOB TASK CAPTURE_DIR. The capture is written when CAPTURE_DIR/stop
appears; CAPTURE_DIR/done marks it complete.
"""
import json
import os
import sys
import time

import tensorflow as tf

cluster, job, task, capture = json.loads(sys.argv[1]), sys.argv[2], int(sys.argv[3]), sys.argv[4]
server = tf.distribute.Server(tf.train.ClusterSpec(cluster), job_name=job, task_index=task,
                              protocol="grpc")
tf.profiler.experimental.start(capture)
while not os.path.exists(os.path.join(capture, "stop")):
    time.sleep(0.1)
tf.profiler.experimental.stop()
open(os.path.join(capture, "done"), "w").close()
