"""TensorFlow parameter-server clusters: every task a real ``tf.distribute.Server`` process.

``PsCluster`` places PS task i on host i of an :class:`EmulatedNetwork` and worker j on
host ``num_ps + j``, starts the PS servers (and, if asked, the worker servers) as child
processes in their hosts' namespaces and waits until each says it is serving. Benchmark
workers that run their own steps are started with :meth:`PsCluster.spawn_worker`.
``LocalCluster`` is the same on plain loopback, for tests that run the worker in-process.
"""
from __future__ import annotations

import json
import sys

from tfoverlap.testbed.network import EmulatedNetwork, LineChannel

__all__ = ["PsCluster", "LocalCluster", "serve", "READY"]

READY = "tfoverlap-server-ready"


class PsCluster:
    """``num_ps`` PS tasks and ``num_workers`` workers on the hosts of ``network``."""

    def __init__(self, network: EmulatedNetwork, num_ps: int = 1, num_workers: int = 1,
                 start_timeout: float = 120.0):
        if num_ps < 1 or num_workers < 1:
            raise ValueError("a cluster needs at least one PS task and one worker")
        if network.num_hosts < num_ps + num_workers:
            raise ValueError(f"{num_ps} PS tasks and {num_workers} workers need "
                             f"{num_ps + num_workers} hosts, the network has "
                             f"{network.num_hosts}")
        self.network = network
        self.num_ps, self.num_workers = num_ps, num_workers
        self.start_timeout = start_timeout
        self.spec = {
            "ps": [self._endpoint(self.host("ps", i)) for i in range(num_ps)],
            "worker": [self._endpoint(self.host("worker", j)) for j in range(num_workers)]}
        self.processes = []

    def host(self, job: str, task: int) -> int:
        return task if job == "ps" else self.num_ps + task

    def _endpoint(self, host: int) -> str:
        return f"{self.network.address(host)}:{self.network.port(host)}"

    def target(self, worker: int = 0) -> str:
        return "grpc://" + self.spec["worker"][worker]

    def start_servers(self, jobs=("ps",)) -> None:
        """Starts every task of ``jobs`` as a server process; returns when all serve."""
        import subprocess
        started = []
        for job in jobs:
            for task in range(len(self.spec[job])):
                process = self.network.spawn(
                    self.host(job, task),
                    [sys.executable, "-m", "tfoverlap.testbed.cluster", json.dumps(self.spec),
                     job, str(task)],
                    stdout=subprocess.PIPE, stderr=subprocess.DEVNULL, text=True)
                self.processes.append(process)
                started.append((LineChannel(process, f"{job} task {task}"), job, task))
        for channel, job, task in started:
            while channel.read(self.start_timeout) != READY:
                pass

    def spawn_worker(self, task: int, argv: list[str], **popen_kwargs):
        """Starts ``argv`` on worker ``task``'s host (it runs that worker's server itself)."""
        process = self.network.spawn(self.host("worker", task), argv, **popen_kwargs)
        self.processes.append(process)
        return process


class LocalCluster(PsCluster):
    """A PS cluster on loopback whose PS tasks (and, if asked, workers) are child processes.

    Workers that are not spawned are started by the caller, e.g. in-process with
    :meth:`start_worker_in_process`, so that the worker's master runs in the caller.
    """

    def __init__(self, num_ps: int = 1, num_workers: int = 1, spawn_workers: bool = False,
                 start_timeout: float = 120.0):
        super().__init__(EmulatedNetwork(num_ps + num_workers, loopback=True).__enter__(),
                         num_ps, num_workers, start_timeout)
        self.spawn_workers = spawn_workers
        self._servers = []

    def __enter__(self) -> "LocalCluster":
        try:
            self.start_servers(("ps", "worker") if self.spawn_workers else ("ps",))
        except BaseException:
            self.close()
            raise
        return self

    def start_worker_in_process(self, task: int = 0, config=None):
        """Starts worker ``task`` as a server in this process (its master runs Grappler here)."""
        import tensorflow as tf
        server = tf.distribute.Server(tf.train.ClusterSpec(self.spec), job_name="worker",
                                      task_index=task, config=config, start=True)
        self._servers.append(server)
        return server

    def close(self) -> None:
        self.network.close()

    def __exit__(self, *exc_info) -> None:
        self.close()


def serve(spec: dict, job: str, task: int) -> None:
    """Runs one task of ``spec`` until killed; loads tfoverlap so its master can use it."""
    import tensorflow as tf

    import tfoverlap
    tfoverlap.load()     # this process may be the master of a remote client's session
    server = tf.distribute.Server(tf.train.ClusterSpec(spec), job_name=job, task_index=task,
                                  start=True)
    print(READY, flush=True)
    server.join()


if __name__ == "__main__":
    serve(json.loads(sys.argv[1]), sys.argv[2], int(sys.argv[3]))
