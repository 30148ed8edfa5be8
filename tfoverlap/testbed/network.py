"""An emulated cluster network on one machine: one Linux network namespace per host.

Layout (all of it inside namespaces this module creates, nothing in the root namespace)::

    tfo-h0 [eth0 10.213.0.1] ---veth--- [p0]
    tfo-h1 [eth0 10.213.0.2] ---veth--- [p1]  br0 10.213.0.254 in tfo-sw
    ...

The switch namespace doubles as the *launcher host*: launchers that every host must reach
(a Gloo rendezvous server, ``mpirun``) run there (:meth:`EmulatedNetwork.spawn_launcher`).

Every host link is shaped in both directions with tc ``tbf`` (the kernel here has no
netem, so bandwidth can be emulated but latency cannot). Processes started with
:meth:`EmulatedNetwork.spawn` run inside their host's namespace. ``close()`` kills them,
then every process still inside the namespaces, then deletes the namespaces (which removes
the links and qdiscs with them). It runs on exceptions and Ctrl-C (and on SIGTERM, which
is turned into ``SystemExit`` while the network is up); a run that was killed outright
leaves namespaces behind, and the next run removes them before it builds its own.

Without root or without ``ip netns`` the network falls back to plain loopback: every host
is 127.0.0.1, nothing is shaped, and ``fallback_reason`` says why.
"""
from __future__ import annotations

import fcntl
import os
import queue
import shutil
import signal
import socket
import subprocess
import sys
import threading

__all__ = ["EmulatedNetwork", "NetworkError", "LineChannel", "free_ports", "leftovers",
           "remove_leftovers"]

NAMESPACE_PREFIX = "tfo-"
SWITCH_NAMESPACE = "tfo-sw"
SUBNET_PREFIX = "10.213.0."
LAUNCHER_ADDRESS = SUBNET_PREFIX + "254"
BASE_PORT = 20000
LOCK_PATH = "/run/tfoverlap-testbed.lock"
NETNS_ETC = "/etc/netns"


class NetworkError(RuntimeError):
    """The emulated network could not be built or used."""


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


class LineChannel:
    """Talks to a child process in lines: commands to its stdin, answers from its stdout.

    A thread reads the answers, so that every wait can time out and a dead child is noticed.
    """

    def __init__(self, process: subprocess.Popen, name: str):
        self.process, self.name = process, name
        self._lines: queue.Queue = queue.Queue()
        threading.Thread(target=self._pump, daemon=True).start()

    def _pump(self) -> None:
        for line in self.process.stdout:
            self._lines.put(line)
        self._lines.put(None)

    def send(self, line: str) -> None:
        try:
            self.process.stdin.write(line.rstrip("\n") + "\n")
            self.process.stdin.flush()
        except BrokenPipeError:
            raise NetworkError(f"{self.name} exited with code {self.process.wait()}") from None

    def read(self, timeout: float) -> str:
        try:
            line = self._lines.get(timeout=timeout)
        except queue.Empty:
            raise TimeoutError(f"{self.name}: no answer after {timeout:.0f} s") from None
        if line is None:
            self._lines.put(None)
            raise NetworkError(f"{self.name} exited with code {self.process.wait()}")
        return line.rstrip("\n")


def _ip(*args: str, check: bool = True) -> subprocess.CompletedProcess:
    result = subprocess.run(("ip",) + args, capture_output=True, text=True)
    if check and result.returncode != 0:
        raise NetworkError(f"'ip {' '.join(args)}' failed: {result.stderr.strip()}")
    return result


def _namespaces() -> list[str]:
    result = _ip("netns", "list", check=False)
    return [line.split()[0] for line in result.stdout.splitlines() if line.strip()]


def leftovers() -> list[str]:
    """Namespaces of this testbed (or their /etc/netns files) that exist right now."""
    found = set()
    if shutil.which("ip") is not None:
        found.update(name for name in _namespaces() if name.startswith(NAMESPACE_PREFIX))
    if os.path.isdir(NETNS_ETC):
        found.update(name for name in os.listdir(NETNS_ETC)
                     if name.startswith(NAMESPACE_PREFIX))
    return sorted(found)


def _kill_namespace_processes(namespace: str) -> None:
    pids = _ip("netns", "pids", namespace, check=False).stdout.split()
    for pid in pids:
        try:
            os.kill(int(pid), signal.SIGKILL)
        except (ProcessLookupError, ValueError):
            pass


def remove_leftovers() -> list[str]:
    """Kills the processes in, and deletes, every namespace of this testbed. Returns them."""
    found = leftovers()
    for namespace in found:
        _kill_namespace_processes(namespace)
        _ip("netns", "del", namespace, check=False)
    if os.path.isdir(NETNS_ETC):
        for name in os.listdir(NETNS_ETC):
            if name.startswith(NAMESPACE_PREFIX):
                shutil.rmtree(os.path.join(NETNS_ETC, name), ignore_errors=True)
    return found


def _tbf_arguments(bytes_per_second: float) -> list[str]:
    bits = int(bytes_per_second * 8)
    # The bucket must hold at least one timer tick of traffic (HZ >= 100) and a TSO segment.
    burst = max(256 * 1024, int(bytes_per_second / 100))
    return ["tbf", "rate", f"{bits}bit", "burst", str(burst), "latency", "100ms"]


class EmulatedNetwork:
    """``num_hosts`` hosts on one switch, each link shaped to ``bandwidth`` bytes/s.

    Use as a context manager. ``bandwidth=None`` leaves the links unshaped. With
    ``allow_fallback=False`` a machine without namespaces raises instead of falling back;
    ``loopback=True`` asks for plain loopback.
    """

    def __init__(self, num_hosts: int, bandwidth: float | None = None,
                 allow_fallback: bool = True, loopback: bool = False):
        if num_hosts < 1:
            raise ValueError("an emulated network needs at least one host")
        if bandwidth is not None and not bandwidth > 0:
            raise ValueError(f"bandwidth must be positive, got {bandwidth}")
        self.num_hosts = num_hosts
        self.bandwidth = bandwidth
        self.allow_fallback = allow_fallback
        self.loopback = loopback
        self.mode = "down"
        self.fallback_reason = ""
        self.processes: list[subprocess.Popen] = []
        self.removed_leftovers: list[str] = []
        self._lock_file = None
        self._previous_sigterm = None
        self._loopback_ports: dict[tuple[int, int], int] = {}

    # ------------------------------------------------------------------ naming
    def namespace(self, host: int) -> str:
        return f"{NAMESPACE_PREFIX}h{host}"

    def address(self, host: int) -> str:
        if self.mode == "loopback":
            return "127.0.0.1"
        return f"{SUBNET_PREFIX}{host + 1}"

    def interface(self, host: int) -> str:
        """The host's network interface (for Gloo's and MPI's interface options)."""
        return "lo" if self.mode == "loopback" else "eth0"

    def port(self, host: int, slot: int = 0) -> int:
        """A port for service ``slot`` on ``host``, free when first asked for."""
        if self.mode != "loopback":
            return BASE_PORT + slot
        key = (host, slot)
        if key not in self._loopback_ports:
            taken = set(self._loopback_ports.values())
            self._loopback_ports[key] = next(p for p in free_ports(8) if p not in taken)
        return self._loopback_ports[key]

    def describe(self) -> str:
        if self.mode == "loopback":
            return f"loopback, unshaped ({self.fallback_reason})"
        rate = ("unshaped" if self.bandwidth is None
                else f"{self.bandwidth * 8 / 1e9:g} Gbit/s tbf per link, both directions")
        return f"{self.num_hosts} network namespaces on one bridge, {rate}"

    # ------------------------------------------------------------------ life cycle
    def __enter__(self) -> "EmulatedNetwork":
        if self.loopback:
            self.mode, self.fallback_reason = "loopback", "loopback requested"
            return self
        reason = self._namespaces_unavailable()
        if reason:
            if not self.allow_fallback:
                raise NetworkError(f"network namespaces unavailable: {reason}")
            self.mode, self.fallback_reason = "loopback", reason
            print(f"tfoverlap testbed: network emulation unavailable ({reason}); running on "
                  "loopback without shaping", file=sys.stderr)
            return self
        self._acquire_lock()
        self._install_sigterm_handler()
        try:
            self.removed_leftovers = remove_leftovers()
            if self.removed_leftovers:
                print("tfoverlap testbed: removed leftovers of an earlier run: "
                      + ", ".join(self.removed_leftovers), file=sys.stderr)
            self.mode = "namespaces"
            self._build()
        except BaseException:
            self.close()
            raise
        return self

    def __exit__(self, *exc_info) -> None:
        self.close()

    @staticmethod
    def _namespaces_unavailable() -> str:
        if os.geteuid() != 0:
            return "not root"
        if shutil.which("ip") is None or shutil.which("tc") is None:
            return "iproute2 (ip, tc) is not installed"
        probe = f"{NAMESPACE_PREFIX}probe{os.getpid()}"
        result = _ip("netns", "add", probe, check=False)
        if result.returncode != 0:
            return f"cannot create a network namespace: {result.stderr.strip()}"
        _ip("netns", "del", probe, check=False)
        return ""

    def _acquire_lock(self) -> None:
        self._lock_file = open(LOCK_PATH, "a+")
        try:
            fcntl.flock(self._lock_file, fcntl.LOCK_EX | fcntl.LOCK_NB)
        except BlockingIOError:
            self._lock_file.seek(0)
            holder = self._lock_file.read().strip() or "unknown"
            self._lock_file.close()
            self._lock_file = None
            raise NetworkError(f"another testbed run is active (pid {holder}); wait for it "
                               "or kill it") from None
        self._lock_file.seek(0)
        self._lock_file.truncate()
        self._lock_file.write(str(os.getpid()))
        self._lock_file.flush()

    def _install_sigterm_handler(self) -> None:
        if threading.current_thread() is not threading.main_thread():
            return

        def on_sigterm(signum, frame):
            raise SystemExit(128 + signum)

        self._previous_sigterm = signal.signal(signal.SIGTERM, on_sigterm)

    def _build(self) -> None:
        _ip("netns", "add", SWITCH_NAMESPACE)
        _ip("-n", SWITCH_NAMESPACE, "link", "add", "br0", "type", "bridge")
        _ip("-n", SWITCH_NAMESPACE, "addr", "add", f"{LAUNCHER_ADDRESS}/24", "dev", "br0")
        _ip("-n", SWITCH_NAMESPACE, "link", "set", "br0", "up")
        _ip("-n", SWITCH_NAMESPACE, "link", "set", "lo", "up")
        for host in range(self.num_hosts):
            namespace, port = self.namespace(host), f"p{host}"
            _ip("netns", "add", namespace)
            _ip("-n", namespace, "link", "add", "eth0", "type", "veth", "peer", "name", port,
                "netns", SWITCH_NAMESPACE)
            _ip("-n", SWITCH_NAMESPACE, "link", "set", port, "master", "br0")
            _ip("-n", SWITCH_NAMESPACE, "link", "set", port, "up")
            _ip("-n", namespace, "addr", "add", f"{self.address(host)}/24", "dev", "eth0")
            _ip("-n", namespace, "link", "set", "eth0", "up")
            self._write_hosts_file(host)
            _ip("-n", namespace, "link", "set", "lo", "up")
            if self.bandwidth is not None:
                for where, link in ((namespace, "eth0"), (SWITCH_NAMESPACE, port)):
                    self._tc(where, "qdisc", "add", "dev", link, "root",
                             *_tbf_arguments(self.bandwidth))

    def set_bandwidth(self, bandwidth: float) -> None:
        """Reshapes every link, both directions, to ``bandwidth`` bytes/s (a network built
        with shaped links; loopback stays unshaped)."""
        if not bandwidth > 0:
            raise ValueError(f"bandwidth must be positive, got {bandwidth}")
        if self.bandwidth is None:
            raise NetworkError("the links were built unshaped; build the network with a "
                               "bandwidth to reshape it")
        if self.mode == "namespaces":
            for host in range(self.num_hosts):
                for where, link in ((self.namespace(host), "eth0"),
                                    (SWITCH_NAMESPACE, f"p{host}")):
                    self._tc(where, "qdisc", "change", "dev", link, "root",
                             *_tbf_arguments(bandwidth))
        self.bandwidth = bandwidth

    def _write_hosts_file(self, host: int) -> None:
        """The host's own names resolve to its address inside its namespace.

        ``ip netns exec`` mounts /etc/netns/NAME/hosts over /etc/hosts. Without it the
        machine's name resolves to 127.0.0.1 everywhere, and Horovod's Gloo contexts for
        process sets (which bind to the host name's address, not HOROVOD_GLOO_IFACE)
        would advertise an address the other hosts cannot reach.
        """
        directory = os.path.join(NETNS_ETC, self.namespace(host))
        os.makedirs(directory, exist_ok=True)
        with open(os.path.join(directory, "hosts"), "w") as hosts:
            hosts.write(f"127.0.0.1 localhost\n{self.address(host)} {self.namespace(host)} "
                        f"{socket.gethostname()}\n")

    @staticmethod
    def _tc(namespace: str, *args: str) -> None:
        result = subprocess.run(("ip", "netns", "exec", namespace, "tc") + args,
                                capture_output=True, text=True)
        if result.returncode != 0:
            raise NetworkError(f"'tc {' '.join(args)}' in {namespace} failed: "
                               f"{result.stderr.strip()}")

    def command(self, host: int, argv: list[str]) -> list[str]:
        """``argv`` prefixed so that it runs inside ``host``'s namespace."""
        if self.mode == "loopback":
            return list(argv)
        return ["ip", "netns", "exec", self.namespace(host)] + list(argv)

    @property
    def launcher_address(self) -> str:
        """Where processes started by :meth:`spawn_launcher` are reached from every host."""
        return "127.0.0.1" if self.mode == "loopback" else LAUNCHER_ADDRESS

    def spawn(self, host: int, argv: list[str], **popen_kwargs) -> subprocess.Popen:
        """Starts ``argv`` on ``host`` in its own process group; ``close()`` kills it."""
        if not 0 <= host < self.num_hosts:
            raise ValueError(f"host {host} is not in 0..{self.num_hosts - 1}")
        return self._start(self.command(host, argv), popen_kwargs)

    def spawn_launcher(self, argv: list[str], **popen_kwargs) -> subprocess.Popen:
        """Starts ``argv`` on the launcher host (the switch), reachable from every host."""
        if self.mode == "loopback":
            return self._start(list(argv), popen_kwargs)
        return self._start(["ip", "netns", "exec", SWITCH_NAMESPACE] + list(argv),
                           popen_kwargs)

    def _start(self, argv: list[str], popen_kwargs: dict) -> subprocess.Popen:
        if self.mode == "down":
            raise NetworkError("the network is not up (use it as a context manager)")
        process = subprocess.Popen(argv, start_new_session=True, **popen_kwargs)
        self.processes.append(process)
        return process

    def close(self) -> None:
        """Kills every spawned process and removes the namespaces. Safe to call twice."""
        for process in self.processes:
            if process.poll() is None:
                try:
                    os.killpg(process.pid, signal.SIGKILL)
                except ProcessLookupError:
                    pass
        for process in self.processes:
            try:
                process.wait(timeout=10)
            except subprocess.TimeoutExpired:
                pass
        self.processes.clear()
        if self.mode == "namespaces":
            remove_leftovers()
        self.mode = "down"
        if self._previous_sigterm is not None:
            signal.signal(signal.SIGTERM, self._previous_sigterm)
            self._previous_sigterm = None
        if self._lock_file is not None:
            self._lock_file.close()
            self._lock_file = None
