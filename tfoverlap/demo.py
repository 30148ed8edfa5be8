"""``make demo``: the smallest real end-to-end run of tfoverlap.

A parameter-server cluster on loopback (the PS task in its own process, the worker's
server in this one), a 16-layer chain model, and the same steps with TensorFlow's default
and with the TfOverlap flag (TIC): what the pass did, and the transfer orders observed.
"""
from __future__ import annotations

import argparse
import statistics
import time


def _run_steps(session, model, steps):
    import tensorflow as tf
    from tfoverlap.trace import observed_transfer_order
    orders, seconds = [], []
    options = tf.compat.v1.RunOptions(trace_level=tf.compat.v1.RunOptions.FULL_TRACE)
    for _ in range(steps):
        metadata = tf.compat.v1.RunMetadata()
        start = time.perf_counter()
        session.run(model.loss, options=options, run_metadata=metadata)
        seconds.append(time.perf_counter() - start)
        orders.append(tuple(observed_transfer_order(metadata)))
    return orders, seconds


def main(argv=None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--layers", type=int, default=16)
    parser.add_argument("--steps", type=int, default=10)
    args = parser.parse_args(argv)

    import tensorflow as tf
    import tfoverlap
    from tfoverlap.testbed.cluster import LocalCluster
    from tfoverlap.testbed.models import chain_model

    print(f"tfoverlap {tfoverlap.__version__} with TensorFlow {tf.__version__}")
    with LocalCluster(num_ps=1, num_workers=1) as cluster:
        cluster.start_worker_in_process(0)
        print(f"cluster: ps={cluster.spec['ps']} (child process {cluster.processes[0].pid}), "
              f"worker={cluster.spec['worker']} (this process)")
        model = chain_model(args.layers, width=512, batch=64)
        results = {}
        for label, config in (("default", tf.compat.v1.ConfigProto()),
                              ("tfoverlap tic", tfoverlap.session_config(schedule="tic"))):
            with tf.compat.v1.Session(cluster.target(), graph=model.graph,
                                      config=config) as session:
                session.run(model.init)
                session.run(model.loss)
                results[label] = _run_steps(session, model, args.steps)
                if label != "default":
                    report = next(r for r in reversed(tfoverlap.recent_reports())
                                  if r.modified)
                    print("\nWhat the TfOverlap pass did in the worker's master:")
                    print(report)
    print(f"\nObserved parameter transfers ({args.steps} traced steps each):")
    print(f"{'variant':<15} {'distinct orders':>15} {'median step':>12}  first transfers of "
          "step 1")
    for label, (orders, seconds) in results.items():
        first = ", ".join(name.split("/")[0] for name in orders[0][:4])
        print(f"{label:<15} {len(set(orders)):>15} {statistics.median(seconds) * 1e3:>10.1f}ms"
              f"  {first}, ...")
    print("\nOn loopback the link is not a bottleneck, so step times are about equal; the "
          "speed-ups on a shaped link are measured by scripts/bench_shaped_link.py (README, \"Measured so far\").")
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
