"""TensorFlow parameter-server clusters: every task a real ``tf.distribute.Server`` process.

``PsCluster`` places the tasks on the hosts of an :class:`EmulatedNetwork` in one of two
:data:`LAYOUTS`: "dedicated" puts PS task i on host i and worker j on host ``num_ps + j``,
so every PS link carries only parameter traffic; "colocated" (TF1's usual layout, with a
PS task on every worker host) puts PS task i and worker i on host i, two servers on two
ports of one address, so each host's link carries its worker's pulls and pushes and its PS
shard's traffic (the worker reaches its own host's PS off the link). It starts the PS
servers (and, if asked, the worker servers) as child processes in their hosts' namespaces
and waits until each says it is serving. Benchmark workers that run their own steps are
started with :meth:`PsCluster.spawn_worker`. ``LocalCluster`` is the same on plain
loopback, for tests that run the worker in-process.
"""
from __future__ import annotations

import json
import sys

from tfoverlap.testbed.network import EmulatedNetwork, LineChannel

__all__ = ["PsCluster", "LocalCluster", "LAYOUTS", "hosts_needed", "resident_bytes", "serve",
           "READY"]

READY = "tfoverlap-server-ready"
LAYOUTS = ("dedicated", "colocated")


def hosts_needed(num_ps: int, num_workers: int, layout: str = "dedicated") -> int:
    """How many hosts the layout takes; ValueError where it cannot hold the tasks."""
    if layout not in LAYOUTS:
        raise ValueError(f"unknown layout {layout!r}; choose from {', '.join(LAYOUTS)}")
    if num_ps < 1 or num_workers < 1:
        raise ValueError("a cluster needs at least one PS task and one worker")
    if layout == "dedicated":
        return num_ps + num_workers
    if num_ps != num_workers:
        raise ValueError(f"the colocated layout runs one PS task and one worker on every "
                         f"host: it needs as many PS tasks as workers, got {num_ps} PS "
                         f"tasks and {num_workers} workers")
    return num_workers


def resident_bytes(pid: int) -> int:
    """The resident memory of process ``pid`` (VmRSS of /proc/<pid>/status)."""
    with open(f"/proc/{pid}/status") as status:
        for line in status:
            if line.startswith("VmRSS:"):
                return int(line.split()[1]) * 1024
    raise ProcessLookupError(f"process {pid} has exited (it has no resident memory)")


class PsCluster:
    """``num_ps`` PS tasks and ``num_workers`` workers on the hosts of ``network``, placed
    as ``layout`` says (one of :data:`LAYOUTS`)."""

    def __init__(self, network: EmulatedNetwork, num_ps: int = 1, num_workers: int = 1,
                 start_timeout: float = 120.0, layout: str = "dedicated"):
        needed = hosts_needed(num_ps, num_workers, layout)
        if network.num_hosts < needed:
            raise ValueError(f"{num_ps} PS tasks and {num_workers} workers, {layout}, need "
                             f"{needed} hosts, the network has {network.num_hosts}")
        self.network = network
        self.num_ps, self.num_workers, self.layout = num_ps, num_workers, layout
        self.start_timeout = start_timeout
        self.spec = {job: [self._endpoint(job, task) for task in range(count)]
                     for job, count in (("ps", num_ps), ("worker", num_workers))}
        self.processes: dict = {}       # (job, task) -> the process that runs it

    def host(self, job: str, task: int) -> int:
        if self.layout == "colocated" or job == "ps":
            return task
        return self.num_ps + task

    def _endpoint(self, job: str, task: int) -> str:
        host = self.host(job, task)
        # Colocated, the host's worker serves on the port next to its PS task's.
        slot = 1 if self.layout == "colocated" and job == "worker" else 0
        return f"{self.network.address(host)}:{self.network.port(host, slot)}"

    def target(self, worker: int = 0) -> str:
        return "grpc://" + self.spec["worker"][worker]

    def start_servers(self, jobs=("ps",), log_dir: str | None = None) -> None:
        """Starts every task of ``jobs`` as a server process; returns when all serve.
        ``log_dir``: each server's stderr goes to ``<job><task>.log`` there (else nowhere),
        so a server that went away says why."""
        import contextlib
        import os
        import subprocess
        started = []
        for job in jobs:
            for task in range(len(self.spec[job])):
                log = (contextlib.nullcontext(subprocess.DEVNULL) if log_dir is None
                       else open(os.path.join(log_dir, f"{job}{task}.log"), "w"))
                with log as stderr:
                    process = self.network.spawn(
                        self.host(job, task),
                        [sys.executable, "-m", "tfoverlap.testbed.cluster",
                         json.dumps(self.spec), job, str(task)],
                        stdout=subprocess.PIPE, stderr=stderr, text=True)
                self.processes[job, task] = process
                started.append((LineChannel(process, f"{job} task {task}"), job, task))
        for channel, job, task in started:
            while channel.read(self.start_timeout) != READY:
                pass

    def spawn_worker(self, task: int, argv: list[str], **popen_kwargs):
        """Starts ``argv`` on worker ``task``'s host (it runs that worker's server itself)."""
        process = self.network.spawn(self.host("worker", task), argv, **popen_kwargs)
        self.processes["worker", task] = process
        return process

    def resident_memory(self) -> dict[str, list[int]]:
        """Job -> the resident bytes of each of its tasks that this cluster started, in
        task order."""
        memory: dict[str, list[int]] = {"ps": [], "worker": []}
        for (job, _), process in sorted(self.processes.items()):
            memory[job].append(resident_bytes(process.pid))
        return memory


class LocalCluster(PsCluster):
    """A PS cluster on loopback whose PS tasks (and, if asked, workers) are child processes.

    Workers that are not spawned are started by the caller, e.g. in-process with
    :meth:`start_worker_in_process`, so that the worker's master runs in the caller.
    """

    def __init__(self, num_ps: int = 1, num_workers: int = 1, spawn_workers: bool = False,
                 start_timeout: float = 120.0, layout: str = "dedicated"):
        network = EmulatedNetwork(hosts_needed(num_ps, num_workers, layout), loopback=True)
        super().__init__(network.__enter__(), num_ps, num_workers, start_timeout, layout)
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
