"""A Horovod job for the cross_step test: a benchmark model (argv[1]; the transformer
with argv[2] layers where given) trained 4 steps with plain Horovod and with
tfoverlap.horovod's cross_step, from the same initial weights (rank 0's, broadcast); writes
whether the losses and the weights after the flush are the same to
$CROSS_STEP_MODEL_RECORDS/rank-N.json."""
import json
import os
import sys

import numpy as np
import tensorflow as tf

tf.compat.v1.disable_eager_execution()
import horovod.tensorflow as hvd  # noqa: E402

import tfoverlap.horovod as tfo_hvd  # noqa: E402
from tfoverlap.horovod.session.deferral import deferral_summary  # noqa: E402
from tfoverlap.testbed import models  # noqa: E402

hvd.init()


def model_of(distributed):
    """argv[1] on the CPU at batch 2, its optimizer wrapped by ``distributed``."""
    def wrap(optimizer):
        return distributed.DistributedOptimizer(optimizer, sparse_as_dense=True)
    if sys.argv[2:]:
        assert sys.argv[1] == "transformer", "a layer count is the transformer's"
        return models.transformer_model(2, layers=int(sys.argv[2]), worker_device="/cpu:0",
                                        seed=0, wrap_optimizer=wrap)
    return models.build_model(sys.argv[1], 2, 0, "/cpu:0", True, seed=0, wrap_optimizer=wrap)


results, initial = {}, None
for variant in ("horovod", "cross_step"):
    if variant == "cross_step":
        # A slow compute estimate: the plan's ring has a tail to defer.
        tfo_hvd.configure(force=True, cross_step=True, bandwidth="1Gbit", flops=2e8)
        distributed = tfo_hvd
    else:
        distributed = hvd
    model = model_of(distributed)
    with model.graph.as_default():
        own = [v for v in tf.compat.v1.global_variables()
               if not v.name.startswith("tfoverlap/")]
        broadcast = hvd.broadcast_variables(own, root_rank=0)
        flush = tfo_hvd.flush_op()
    with tf.compat.v1.Session(graph=model.graph) as session:
        session.run(model.init)
        if initial is None:
            session.run(broadcast)
            initial = session.run(own)
        else:
            for variable, value in zip(own, initial):
                variable.load(value, session)
        losses = [float(session.run([model.loss, model.fetch])[0]) for _ in range(4)]
        if flush is not None:
            session.run(flush)
        results[variant] = {"losses": losses, "final": session.run(own),
                            "deferred": deferral_summary(model.graph)}
    tfo_hvd.configure()
plain, deferred = results["horovod"], results["cross_step"]
with open(os.path.join(os.environ["CROSS_STEP_MODEL_RECORDS"], f"rank-{hvd.rank()}.json"),
          "w") as stream:
    json.dump({"rank": hvd.rank(), "losses": [plain["losses"], deferred["losses"]],
               "same_losses": plain["losses"] == deferred["losses"],
               "same_final_weights": all(np.array_equal(a, b)
                                         for a, b in zip(plain["final"], deferred["final"])),
               "deferred": deferred["deferred"]}, stream)
