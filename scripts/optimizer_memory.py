"""Optimizer state per rank, plain Horovod against decoupled reduction (sharded updates).

Runs one Horovod job of ``--ranks`` ranks over Gloo on loopback. Each rank builds each
model with Adam, once wrapped by Horovod's DistributedOptimizer and once by
tfoverlap.horovod's with ``configure(decouple=True)``, trains ``--steps`` steps (batch 2,
CPU), and counts the bytes of the optimizer's state variables (Adam's moments; the
scalar beta powers left out) that live on the rank. Prints one JSON line: per model,
Horovod's bytes, the decoupled bytes on each rank, the ratio, and the largest bucket.

    .venv/bin/python scripts/optimizer_memory.py --ranks 8 --models resnet50,transformer
"""
import argparse
import json
import os
import sys


def _rank_main(models, steps: int) -> None:
    import tensorflow as tf
    tf.compat.v1.disable_eager_execution()
    import horovod.tensorflow as hvd

    import tfoverlap.horovod as tfo_hvd
    from tfoverlap.horovod.session.decoupling import decoupling_summary
    from tfoverlap.testbed.models import build_model
    hvd.init()
    rows = {}
    for name in models:
        row = {}
        for variant in ("horovod", "decoupled"):
            distributed = hvd
            if variant == "decoupled":
                tfo_hvd.configure(decouple=True, cross_step=False, force=True,
                                  bandwidth="25Gbit", latency=50e-6, flops=1e13)
                distributed = tfo_hvd
            optimizers = []

            def wrap(_, distributed=distributed):
                optimizers.append(distributed.DistributedOptimizer(
                    tf.compat.v1.train.AdamOptimizer(1e-4), sparse_as_dense=True))
                return optimizers[-1]

            model = build_model(name, 2, 0, "/cpu:0", True, seed=0, wrap_optimizer=wrap)
            tfo_hvd.configure()
            with model.graph.as_default():     # its slots (shards, decoupled), not the powers
                state = [v for v in optimizers[0].variables() if v.shape.num_elements() > 1]
            with tf.compat.v1.Session(graph=model.graph) as session:
                session.run(model.init)
                for _ in range(steps):
                    session.run(model.fetch)
            row[variant] = sum(v.shape.num_elements() * v.dtype.size for v in state)
            row["parameter_bytes"] = model.parameter_bytes
            if variant == "decoupled":
                summary = decoupling_summary(model.graph)
                row["buckets"] = len(summary.get("buckets", []))
                row["decoupled_gradients"] = summary.get("decoupled", 0)
        rows[name] = row
    with open(os.path.join(os.environ["OPTIMIZER_MEMORY_RECORDS"],
                           f"rank-{hvd.rank()}.json"), "w") as stream:
        json.dump(rows, stream)


def _summary(models, records) -> dict:
    result = {}
    for name in models:
        per_rank = [rows[name]["decoupled"] for rows in records]
        plain = records[0][name]["horovod"]
        result[name] = {"ranks": len(records), "horovod_bytes": plain,
                        "decoupled_bytes_per_rank": per_rank,
                        "largest_ratio": max(per_rank) / plain if plain else None,
                        "parameter_bytes": records[0][name]["parameter_bytes"],
                        "buckets": records[0][name]["buckets"],
                        "decoupled_gradients": records[0][name]["decoupled_gradients"]}
    return result


def main() -> int:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--ranks", type=int, default=8)
    parser.add_argument("--models", default="resnet50,transformer")
    parser.add_argument("--steps", type=int, default=2)
    args = parser.parse_args()
    models = args.models.split(",")
    if "HOROVOD_RANK" in os.environ:
        _rank_main(models, args.steps)
        return 0
    sys.path.insert(0, os.path.dirname(os.path.dirname(os.path.abspath(__file__))))
    import tempfile

    from tfoverlap.testbed.horovod_launch import run_horovod
    from tfoverlap.testbed.network import EmulatedNetwork
    with tempfile.TemporaryDirectory() as records, \
            EmulatedNetwork(args.ranks, loopback=True) as network:
        result = run_horovod(network, args.ranks, [sys.executable, os.path.abspath(__file__),
                                                   "--models", args.models,
                                                   "--steps", str(args.steps)],
                             controller="gloo", timeout=1800,
                             env={"OPTIMIZER_MEMORY_RECORDS": records})
        if result.returncode != 0:
            print("\n".join(output[-2000:] for output in result.outputs), file=sys.stderr)
            return 1
        rows = []
        for rank in range(args.ranks):
            with open(os.path.join(records, f"rank-{rank}.json")) as stream:
                rows.append(json.load(stream))
    print(json.dumps(_summary(models, rows)))
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
