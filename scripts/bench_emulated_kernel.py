"""How exactly the emulated kernel keeps its durations, and how little CPU it takes.

For each duration, a chain of kernels on one stream (each takes the one before as input)
runs in a session, in both launch modes: "ahead" (complete at launch, a stream wait on the
last one, as the emulate pass builds it) and "blocking" (each completes when it ends, so
every hop adds the executor's and the timer's latency). The step's wall time is compared
with the sum of the durations, and the process's CPU time per step is reported next to
it. A row fails when the wall time is off by more than ``--tolerance`` (relative) plus
``--slack-us`` per kernel (the timer thread's wake-up and the executor's hand-over on a
shared VM). Exit status 1 if any row fails.

    .venv/bin/python scripts/bench_emulated_kernel.py [--kernels 20] [--steps 10]
"""
import argparse
import statistics
import sys
import time

DURATIONS_US = (50, 200, 1000, 5000, 20000)


def main(argv=None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--kernels", type=int, default=20, help="kernels per chain")
    parser.add_argument("--steps", type=int, default=10)
    parser.add_argument("--tolerance", type=float, default=0.05)
    parser.add_argument("--slack-us", type=float, default=150.0)
    args = parser.parse_args(argv)

    import tensorflow as tf
    from tfoverlap.integrations.emulated_kernel import load_emulated_ops
    ops = load_emulated_ops()
    print("| launch | duration | kernels | expected ms | measured ms (p10-p90) | error | "
          "CPU ms/step | ok |")
    print("|---|---|---|---|---|---|---|---|")
    failed = 0
    for blocking, duration in [(b, d) for b in (False, True) for d in DURATIONS_US]:
        graph = tf.Graph()
        with graph.as_default():
            value = tf.constant(1.0)
            for index in range(args.kernels):
                value = ops.tf_overlap_emulated_compute(
                    [value], Tout=[tf.float32], output_shapes=[[]],
                    duration_us=float(duration), blocking=blocking, name=f"kernel{index}")[0]
            if not blocking:
                value = ops.tf_overlap_stream_wait([value], producers=[value.op.name])[0]
        with tf.compat.v1.Session(graph=graph) as session:
            session.run(value)
            walls, cpus = [], []
            for _ in range(args.steps):
                start, start_cpu = time.perf_counter(), time.process_time()
                session.run(value)
                walls.append(time.perf_counter() - start)
                cpus.append(time.process_time() - start_cpu)
        expected = duration * args.kernels * 1e-6
        measured = statistics.median(walls)
        error = measured / expected - 1
        ok = abs(measured - expected) <= args.tolerance * expected + (
            args.slack_us * 1e-6 * args.kernels)
        failed += not ok
        walls.sort()
        print(f"| {'blocking' if blocking else 'ahead'} | {duration} µs | {args.kernels} "
              f"| {expected * 1e3:.2f} | {measured * 1e3:.2f} "
              f"({walls[len(walls) // 10] * 1e3:.2f}-{walls[-1 - len(walls) // 10] * 1e3:.2f}) "
              f"| {error:+.1%} | {statistics.median(cpus) * 1e3:.2f} | "
              f"{'yes' if ok else 'NO'} |", flush=True)
    return 1 if failed else 0


if __name__ == "__main__":
    sys.exit(main())
