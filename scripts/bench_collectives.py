"""What Horovod's collectives cost on the emulated network, against the alpha-beta model.

Decoupled reduction replaces each AllReduce by a reduce-scatter and an all-gather, which
the model prices at half an AllReduce each. This measures, on ``--ranks`` namespace
hosts with links of ``--link`` (dilated: ``--dilation`` divides the rate, as the
benchmarks' emulated runs do), the median time of an AllReduce, a reduce-scatter, an
all-gather of the shards, and an all-to-all followed by a local sum (a reduce-scatter
built from Horovod's all-to-all), each of ``--sizes`` MB, over Gloo or MPI. Root; one
JSON line per size.

    sudo .venv/bin/python scripts/bench_collectives.py --ranks 8 --link 25Gbit \\
        --dilation 32 --sizes 12.5,100 --controller gloo
"""
import argparse
import json
import os
import sys
import time

REPEATS = 3


def _rank_main(sizes) -> None:
    import numpy as np
    import tensorflow as tf
    tf.compat.v1.disable_eager_execution()
    import horovod.tensorflow as hvd
    hvd.init()
    ranks = hvd.size()
    for megabytes in sizes:
        elements = int(megabytes * 1e6 / 4) // ranks * ranks
        graph = tf.Graph()
        with graph.as_default():
            whole = tf.random.uniform([elements])
            shard = tf.random.uniform([elements // ranks])
            collectives = {
                "allreduce": hvd.allreduce(whole, op=hvd.Sum, name="allreduce"),
                "reducescatter": hvd.reducescatter(whole, op=hvd.Sum, name="scatter"),
                "allgather": hvd.allgather(shard, name="gather"),
                "alltoall_sum": tf.reduce_sum(tf.reshape(
                    hvd.alltoall(whole, name="alltoall"), [ranks, -1]), 0)}
            fetches = {name: tf.reduce_sum(tensor) for name, tensor in collectives.items()}
        row = {"megabytes": megabytes, "ranks": ranks}
        with tf.compat.v1.Session(graph=graph) as session:
            for name, fetch in fetches.items():
                session.run(fetch)
                times = []
                for _ in range(REPEATS):
                    start = time.perf_counter()
                    session.run(fetch)
                    times.append(time.perf_counter() - start)
                row[name] = float(np.median(times))
        if hvd.rank() == 0:
            print(json.dumps(row), flush=True)


def main() -> int:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--ranks", type=int, default=8)
    parser.add_argument("--link", default="25Gbit")
    parser.add_argument("--dilation", type=float, default=32.0)
    parser.add_argument("--sizes", default="12.5,100", help="MB, comma-separated")
    parser.add_argument("--controller", choices=("gloo", "mpi"), default="gloo")
    args = parser.parse_args()
    sizes = [float(size) for size in args.sizes.split(",")]
    if "HOROVOD_RANK" in os.environ or "OMPI_COMM_WORLD_RANK" in os.environ:
        _rank_main(sizes)
        return 0
    sys.path.insert(0, os.path.dirname(os.path.dirname(os.path.abspath(__file__))))
    from tfoverlap.costs.network import ring_allreduce_seconds
    from tfoverlap.options import parse_options
    from tfoverlap.testbed.horovod_launch import run_horovod
    from tfoverlap.testbed.network import EmulatedNetwork
    bandwidth = parse_options({"bandwidth": args.link}).bandwidth / args.dilation
    with EmulatedNetwork(args.ranks, bandwidth=bandwidth) as network:
        mode = network.mode
        result = run_horovod(network, args.ranks,
                             [sys.executable, os.path.abspath(__file__), "--sizes", args.sizes],
                             controller=args.controller, timeout=1800)
    if result.returncode != 0:
        print("\n".join(output[-2000:] for output in result.outputs), file=sys.stderr)
        return 1
    for line in (line for output in result.outputs for line in output.splitlines()
                 if line.startswith("{")):
        row = json.loads(line)
        model = float(ring_allreduce_seconds(row["megabytes"] * 1e6, args.ranks, bandwidth,
                                             0.0))
        row.update(link=args.link, dilation=args.dilation, controller=args.controller,
                   network=mode, model_allreduce=model, model_half=model / 2)
        print(json.dumps(row))
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
