"""TicTac on a shaped link: PS task in a network namespace behind a tbf-shaped veth.

Needs root. Creates namespace ``tfo-ps0`` and veth ``tfo-v0``/``tfo-v1`` (addresses
10.213.0.1 here, 10.213.0.2 in the namespace, nothing else is contacted), shapes both
directions with tc tbf, starts the PS server inside the namespace and the worker server in
this process, and runs the chain model with each variant, interleaved in rounds:
TensorFlow's default, TensorFlow's ``enable_recv_scheduling``, TfOverlap TIC and TAC (TAC's
profile is taken from default steps first). Everything is torn down at exit, also after
errors or Ctrl-C; leftovers of a crashed run are removed first.

    sudo .venv/bin/python scripts/bench_shaped_link.py [--rate 1gbit] [--rounds 5]
"""
from __future__ import annotations

import argparse
import json
import os
import statistics
import subprocess
import sys
import tempfile
import time

NAMESPACE, HOST_LINK, NS_LINK = "tfo-ps0", "tfo-v0", "tfo-v1"
HOST_ADDRESS, NS_ADDRESS = "10.213.0.1", "10.213.0.2"


def sh(*command: str, check: bool = True) -> None:
    subprocess.run(command, check=check, stdout=subprocess.DEVNULL, stderr=subprocess.DEVNULL)


def teardown() -> None:
    pids = subprocess.run(["ip", "netns", "pids", NAMESPACE], capture_output=True,
                          text=True).stdout.split()
    for pid in pids:
        sh("kill", "-9", pid, check=False)
    sh("ip", "link", "del", HOST_LINK, check=False)
    sh("ip", "netns", "del", NAMESPACE, check=False)


def setup(rate: str) -> None:
    teardown()
    sh("ip", "netns", "add", NAMESPACE)
    sh("ip", "link", "add", HOST_LINK, "type", "veth", "peer", "name", NS_LINK)
    sh("ip", "link", "set", NS_LINK, "netns", NAMESPACE)
    sh("ip", "addr", "add", f"{HOST_ADDRESS}/30", "dev", HOST_LINK)
    sh("ip", "link", "set", HOST_LINK, "up")
    sh("ip", "netns", "exec", NAMESPACE, "ip", "addr", "add", f"{NS_ADDRESS}/30", "dev", NS_LINK)
    sh("ip", "netns", "exec", NAMESPACE, "ip", "link", "set", NS_LINK, "up")
    sh("ip", "netns", "exec", NAMESPACE, "ip", "link", "set", "lo", "up")
    for prefix, link in (((), HOST_LINK), (("ip", "netns", "exec", NAMESPACE), NS_LINK)):
        sh(*prefix, "tc", "qdisc", "add", "dev", link, "root", "tbf", "rate", rate,
           "burst", "256kb", "latency", "100ms")


def main(argv=None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--rate", default="1gbit")
    parser.add_argument("--layers", type=int, default=8)
    parser.add_argument("--width", type=int, default=1024)
    parser.add_argument("--batch", type=int, default=2048)
    parser.add_argument("--rounds", type=int, default=5)
    parser.add_argument("--steps", type=int, default=6, help="steps per variant per round")
    parser.add_argument("--training", action="store_true")
    args = parser.parse_args(argv)
    if os.geteuid() != 0:
        print("needs root (network namespaces and tc)", file=sys.stderr)
        return 2

    import tensorflow as tf
    import tfoverlap
    from tfoverlap.testbed.cluster import free_ports, wait_listening
    from tfoverlap.testbed.models import chain_model

    ps_port, worker_port = free_ports(2)
    spec = {"ps": [f"{NS_ADDRESS}:{ps_port}"], "worker": [f"{HOST_ADDRESS}:{worker_port}"]}
    setup(args.rate)
    ps = None
    try:
        ps = subprocess.Popen(["ip", "netns", "exec", NAMESPACE, sys.executable, "-m",
                               "tfoverlap.testbed.cluster", json.dumps(spec), "ps", "0"],
                              stdout=subprocess.DEVNULL, stderr=subprocess.DEVNULL)
        wait_listening(NS_ADDRESS, ps_port, ps, timeout=60)
        server = tf.distribute.Server(tf.train.ClusterSpec(spec), job_name="worker",
                                      task_index=0, start=True)
        model = chain_model(args.layers, width=args.width, batch=args.batch,
                            training=args.training, use_resource=True)
        fetch = model.train_op if args.training else model.loss
        base = tf.compat.v1.ConfigProto(intra_op_parallelism_threads=1)
        recv_scheduling = tf.compat.v1.ConfigProto()
        recv_scheduling.CopyFrom(base)
        recv_scheduling.graph_options.enable_recv_scheduling = True
        profile_dir = tempfile.TemporaryDirectory(prefix="tfoverlap-bench-")
        profile_path = os.path.join(profile_dir.name, "profile.json")
        with tf.compat.v1.Session(server.target, graph=model.graph, config=base) as session:
            session.run(model.init)
            tfoverlap.profile(session, fetch, steps=3, warmup=1, path=profile_path)
        variants = {
            "default": base,
            "tf recv_scheduling": recv_scheduling,
            "tic": tfoverlap.session_config(base, schedule="tic"),
            "tic consumer-gate": tfoverlap.session_config(base, schedule="tic", gate="consumer"),
            "tic window 2": tfoverlap.session_config(base, schedule="tic", window=2),
            "tac": tfoverlap.session_config(base, schedule="tac", profile=profile_path),
        }
        sessions = {name: tf.compat.v1.Session(server.target, graph=model.graph, config=config)
                    for name, config in variants.items()}
        for session in sessions.values():
            session.run(fetch)  # warm-up: graph optimization and partitioning
        times: dict[str, list[float]] = {name: [] for name in variants}
        for round_index in range(args.rounds):
            for name, session in sessions.items():
                for _ in range(args.steps):
                    start = time.perf_counter()
                    session.run(fetch)
                    times[name].append(time.perf_counter() - start)
            print(f"round {round_index + 1}/{args.rounds} done", file=sys.stderr)
        baseline = statistics.median(times["default"])
        kind = "training" if args.training else "inference (forward only)"
        print(f"\nchain of {args.layers} x {args.width}x{args.width} float layers, batch "
              f"{args.batch}, {kind}, link {args.rate} (tbf), intra-op threads 1, "
              f"{args.rounds} rounds x {args.steps} steps per variant, interleaved")
        print(f"{'variant':<20}{'median s':>10}{'p10 s':>8}{'p90 s':>8}{'speed-up':>10}")
        for name, values in times.items():
            deciles = statistics.quantiles(values, n=10)
            print(f"{name:<20}{statistics.median(values):>10.3f}{deciles[0]:>8.3f}"
                  f"{deciles[-1]:>8.3f}{baseline / statistics.median(values):>9.2f}x")
        for session in sessions.values():
            session.close()
    finally:
        if ps is not None:
            ps.kill()
            ps.wait()
        teardown()
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
