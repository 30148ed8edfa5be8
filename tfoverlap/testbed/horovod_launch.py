"""Horovod jobs on the emulated testbed: rank r on host r, started with Gloo or MPI.

- ``controller="gloo"`` does what ``horovodrun --gloo`` does, with the ranks inside the
  namespaces: it runs Horovod's own rendezvous server on the launcher host and starts
  each rank with the environment horovodrun would give it (rank, size, local and cross
  ranks, the rendezvous address and the host's interface). ``horovodrun`` itself reaches
  other hosts only by ssh, which the namespaces do not run; on plain loopback the job
  is started by ``horovodrun -np N --gloo`` itself.
- ``controller="mpi"`` runs ``mpirun`` on the launcher host; Open MPI starts one daemon
  per host through :file:`mpi_rsh_agent.sh` (``ip netns exec`` in place of ssh), and the
  ranks talk over the hosts' shaped links (``btl tcp``). On loopback it is a plain
  ``mpirun -np N``.

Every process belongs to the network, so closing the network ends the job. A rank that
fails ends it too: the others are killed :data:`FAILED_RANK_GRACE_S` seconds later.
"""
from __future__ import annotations

import dataclasses
import os
import re
import subprocess
import sys

from tfoverlap.testbed.network import SUBNET_PREFIX, EmulatedNetwork, LineChannel

__all__ = ["HorovodResult", "run_horovod", "CONTROLLERS"]

CONTROLLERS = ("gloo", "mpi")
_AGENT = os.path.join(os.path.dirname(os.path.abspath(__file__)), "mpi_rsh_agent.sh")
_MPI_TAG = re.compile(r"\[\d+,(\d+)\]<(stdout|stderr)>:")


@dataclasses.dataclass
class HorovodResult:
    returncode: int               # 0 when every rank succeeded
    #: each rank's stdout and stderr, line by line as they came (Gloo: in namespaces one
    #: pipe per rank, on loopback horovodrun's tagged lines); under mpirun its stdout
    #: alone (its tags can cut a line that stdout wrote in pieces), or the launcher's
    #: last output where a failed job printed nothing there
    outputs: list[str]
    launcher: str                 # how the job was started, for reports


def _python_env(env: dict | None) -> dict:
    return {**os.environ, "TF_CPP_MIN_LOG_LEVEL": "2", **(env or {})}


def run_horovod(network: EmulatedNetwork, num_ranks: int, argv: list[str],
                controller: str = "gloo", env: dict | None = None,
                timeout: float = 600.0) -> HorovodResult:
    """Runs ``argv`` as a Horovod job of ``num_ranks`` ranks and waits for it."""
    if controller not in CONTROLLERS:
        raise ValueError(f"controller must be one of {CONTROLLERS}, got {controller!r}")
    if not 1 <= num_ranks <= network.num_hosts:
        raise ValueError(f"{num_ranks} ranks need as many hosts; the network has "
                         f"{network.num_hosts}")
    if controller == "mpi":
        return _run_mpi(network, num_ranks, argv, env, timeout)
    if network.mode == "loopback":
        return _run_horovodrun(network, num_ranks, argv, env, timeout)
    return _run_gloo(network, num_ranks, argv, env, timeout)


def _run_gloo(network, num_ranks, argv, env, timeout) -> HorovodResult:
    server = network.spawn_launcher(
        [sys.executable, "-m", "tfoverlap.testbed.horovod_launch", "rendezvous", str(num_ranks)],
        stdout=subprocess.PIPE, stderr=subprocess.DEVNULL, text=True)
    port = int(LineChannel(server, "Gloo rendezvous server").read(120))
    ranks = []
    for rank in range(num_ranks):
        rank_env = _python_env(env)
        rank_env.update({
            "HOROVOD_GLOO_RENDEZVOUS_ADDR": network.launcher_address,
            "HOROVOD_GLOO_RENDEZVOUS_PORT": str(port),
            "HOROVOD_CONTROLLER": "gloo", "HOROVOD_CPU_OPERATIONS": "gloo",
            "HOROVOD_GLOO_IFACE": network.interface(rank),
            "HOROVOD_HOSTNAME": _host_name(rank), "HOROVOD_RANK": str(rank),
            "HOROVOD_SIZE": str(num_ranks), "HOROVOD_LOCAL_RANK": "0",
            "HOROVOD_LOCAL_SIZE": "1", "HOROVOD_CROSS_RANK": str(rank),
            "HOROVOD_CROSS_SIZE": str(num_ranks)})
        ranks.append(network.spawn(rank, list(argv), stdout=subprocess.PIPE,
                                   stderr=subprocess.STDOUT, text=True, env=rank_env))
    outputs = _collect(ranks, timeout)
    codes = [process.returncode for process in ranks]
    return HorovodResult(max(codes, key=abs), outputs,
                         f"Gloo ({num_ranks} ranks in namespaces, rendezvous on "
                         f"{network.launcher_address}:{port})")


#: seconds the other ranks get once one rank failed, before they are killed: a Horovod
#: rank whose peer died (the kernel's OOM killer, once, on 8 ranks of VGG-16) waits for
#: it in its next collective for ever
FAILED_RANK_GRACE_S = 30.0


def _collect(processes, timeout: float) -> list[str]:
    """Reads every process's output to the end (threads, so no pipe fills up) while they
    run. Where one fails (a non-zero exit, or a signal) and others still run, those are
    killed :data:`FAILED_RANK_GRACE_S` seconds later, so that the job ends with the
    failure instead of waiting for its timeout. TimeoutError after ``timeout`` seconds."""
    import threading
    import time
    outputs = [""] * len(processes)

    def read(index):
        outputs[index] = processes[index].stdout.read()

    threads = [threading.Thread(target=read, args=(i,), daemon=True)
               for i in range(len(processes))]
    for thread in threads:
        thread.start()
    deadline, failed_at = time.monotonic() + timeout, None
    while None in [process.poll() for process in processes]:    # (polls every one)
        now = time.monotonic()
        if now > deadline:
            raise TimeoutError(f"Horovod job still running after {timeout:.0f} s")
        if failed_at is None and any(process.returncode not in (None, 0)
                                     for process in processes):
            failed_at = now
        if failed_at is not None and now - failed_at > FAILED_RANK_GRACE_S:
            for process in processes:
                if process.poll() is None:
                    process.kill()
                    process.wait()
            break
        time.sleep(0.1)
    for thread in threads:
        thread.join(timeout=10)
    return outputs


def _run_horovodrun(network, num_ranks, argv, env, timeout) -> HorovodResult:
    horovodrun = os.path.join(os.path.dirname(sys.executable), "horovodrun")
    process = network.spawn_launcher(
        [horovodrun, "-np", str(num_ranks), "-H", f"localhost:{num_ranks}", "--gloo"]
        + list(argv),
        stdout=subprocess.PIPE, stderr=subprocess.STDOUT, text=True, env=_python_env(env))
    output = _collect([process], timeout)[0]
    per_rank = [[] for _ in range(num_ranks)]
    for line in output.splitlines():
        match = re.match(r"^\[(\d+)\]<(?:stdout|stderr)>:(.*)$", line)
        if match and int(match.group(1)) < num_ranks:
            per_rank[int(match.group(1))].append(match.group(2))
    return HorovodResult(process.returncode, ["\n".join(lines) for lines in per_rank],
                         f"horovodrun -np {num_ranks} --gloo on loopback")


def _run_mpi(network, num_ranks, argv, env, timeout) -> HorovodResult:
    exported = sorted({"PATH", "TF_CPP_MIN_LOG_LEVEL"} | set(env or {})
                      | ({"PYTHONPATH"} & set(os.environ)))
    command = ["mpirun", "--allow-run-as-root", "--tag-output", "-np", str(num_ranks),
               "--bind-to", "none", "--mca", "btl", "tcp,self"]
    if network.mode == "loopback":
        command += ["--oversubscribe"]
        launcher = f"mpirun -np {num_ranks} on loopback"
    else:
        hosts = ",".join(f"{network.address(rank)}:1" for rank in range(num_ranks))
        subnet = SUBNET_PREFIX + "0/24"
        command += ["-H", hosts, "--mca", "plm_rsh_agent", _AGENT,
                    "--mca", "btl_tcp_if_include", subnet, "--mca", "oob_tcp_if_include",
                    subnet]
        launcher = f"mpirun -np {num_ranks}, one daemon per namespace"
    for name in exported:
        command += ["-x", name]
    process = network.spawn_launcher(command + list(argv), stdout=subprocess.PIPE,
                                     stderr=subprocess.STDOUT, text=True,
                                     env=_python_env(env))
    output = _collect([process], timeout)[0]
    per_rank = [""] * num_ranks
    # --tag-output puts "[job,rank]<stdout>:" before every piece a rank wrote.
    pieces = _MPI_TAG.split(output)
    for rank, stream, text in zip(pieces[1::3], pieces[2::3], pieces[3::3]):
        if stream == "stdout" and int(rank) < num_ranks:
            per_rank[int(rank)] += text
    if process.returncode != 0 and not any(per_rank):
        per_rank[0] = output[-4000:]
    return HorovodResult(process.returncode, per_rank, launcher)


def _host_name(rank: int) -> str:
    return f"tfo-h{rank}"


def serve_rendezvous(num_ranks: int) -> None:
    """Horovod's Gloo rendezvous server for ``num_ranks`` ranks, one per host; prints the
    port, then serves until killed."""
    import threading
    from horovod.runner.common.util.hosts import get_host_assignments, parse_hosts
    from horovod.runner.http.http_server import RendezvousServer
    server = RendezvousServer(verbose=0)
    port = server.start()
    hosts = parse_hosts(",".join(f"{_host_name(rank)}:1" for rank in range(num_ranks)))
    server.init(get_host_assignments(hosts, num_ranks))
    print(port, flush=True)
    threading.Event().wait()


if __name__ == "__main__":
    if sys.argv[1:2] == ["rendezvous"]:
        serve_rendezvous(int(sys.argv[2]))
    else:
        print("usage: python -m tfoverlap.testbed.horovod_launch rendezvous NUM_RANKS",
              file=sys.stderr)
        raise SystemExit(2)
