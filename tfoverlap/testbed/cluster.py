"""Local TensorFlow parameter-server clusters: every task a real tf.distribute.Server process.

``LocalCluster`` starts the PS tasks (and optionally the workers) as child processes on
127.0.0.1, waits until they listen, and kills them (their whole process groups) on exit,
also after an exception or Ctrl-C.
"""
from __future__ import annotations

import json
import os
import signal
import socket
import subprocess
import sys
import time

__all__ = ["free_ports", "wait_listening", "LocalCluster", "serve"]


def free_ports(count: int) -> list[int]:
    """Ports that were free on 127.0.0.1 a moment ago."""
    sockets = []
    try:
        for _ in range(count):
            sock = socket.socket()
            sock.bind(("127.0.0.1", 0))
            sockets.append(sock)
        return [sock.getsockname()[1] for sock in sockets]
    finally:
        for sock in sockets:
            sock.close()


def wait_listening(host: str, port: int, process: subprocess.Popen, timeout: float) -> None:
    """Returns once ``host:port`` accepts connections; raises if ``process`` dies first."""
    deadline = time.monotonic() + timeout
    while time.monotonic() < deadline:
        if process.poll() is not None:
            raise RuntimeError(f"server process for {host}:{port} exited with code "
                               f"{process.returncode}")
        try:
            with socket.create_connection((host, port), timeout=0.5):
                return
        except OSError:
            time.sleep(0.1)
    raise TimeoutError(f"no server listening on {host}:{port} after {timeout:.0f} s")


class LocalCluster:
    """A cluster of ``num_ps`` PS tasks and ``num_workers`` workers on loopback.

    PS tasks always run as child processes. Workers run as child processes only if
    ``spawn_workers``; otherwise the caller starts them (e.g. in-process with
    :meth:`start_worker_in_process`, so that the worker's master runs in the caller).
    """

    def __init__(self, num_ps: int = 1, num_workers: int = 1, spawn_workers: bool = False,
                 start_timeout: float = 60.0):
        if num_ps < 1 or num_workers < 1:
            raise ValueError("a cluster needs at least one PS task and one worker")
        ports = free_ports(num_ps + num_workers)
        self.spec = {"ps": [f"127.0.0.1:{p}" for p in ports[:num_ps]],
                     "worker": [f"127.0.0.1:{p}" for p in ports[num_ps:]]}
        self.spawn_workers = spawn_workers
        self.start_timeout = start_timeout
        self.processes: list[subprocess.Popen] = []
        self._servers = []

    def target(self, worker: int = 0) -> str:
        return "grpc://" + self.spec["worker"][worker]

    def _spawn(self, job: str, task: int) -> subprocess.Popen:
        process = subprocess.Popen(
            [sys.executable, "-m", "tfoverlap.testbed.cluster", json.dumps(self.spec), job,
             str(task)], stdout=subprocess.DEVNULL, stderr=subprocess.STDOUT, start_new_session=True,
            env={**os.environ, "TF_CPP_MIN_LOG_LEVEL": os.environ.get("TF_CPP_MIN_LOG_LEVEL",
                                                                       "2")})
        self.processes.append(process)
        return process

    def __enter__(self) -> "LocalCluster":
        try:
            jobs = [("ps", i) for i in range(len(self.spec["ps"]))]
            if self.spawn_workers:
                jobs += [("worker", i) for i in range(len(self.spec["worker"]))]
            for job, task in jobs:
                process = self._spawn(job, task)
                port = int(self.spec[job][task].rsplit(":", 1)[1])
                wait_listening("127.0.0.1", port, process, self.start_timeout)
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
        for process in self.processes:
            if process.poll() is None:
                try:
                    os.killpg(process.pid, signal.SIGKILL)
                except ProcessLookupError:
                    pass
        for process in self.processes:
            process.wait()
        self.processes.clear()

    def __exit__(self, *exc_info) -> None:
        self.close()


def serve(spec: dict, job: str, task: int) -> None:
    """Runs one task of ``spec`` until killed; loads tfoverlap so its master can use it."""
    import tensorflow as tf
    import tfoverlap  # noqa: F401  (registers the TfOverlap optimizer in this process)
    server = tf.distribute.Server(tf.train.ClusterSpec(spec), job_name=job, task_index=task,
                                  start=True)
    server.join()


if __name__ == "__main__":
    serve(json.loads(sys.argv[1]), sys.argv[2], int(sys.argv[3]))
