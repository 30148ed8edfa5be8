"""The benchmark harness: metric math, the emulated network, its teardown, the launchers."""
import json
import math
import os
import signal
import subprocess
import sys
import time

import pytest

from tfoverlap.bench import metrics
from tfoverlap.testbed.network import EmulatedNetwork, NetworkError, leftovers

IS_ROOT = os.geteuid() == 0


def needs_root(test):
    """Network namespaces: they need root, and they take the machine-wide testbed lock, so
    they are in the slow tier (a benchmark or Horovod test running beside them holds it)."""
    skip = pytest.mark.skipif(not IS_ROOT, reason="network namespaces need root")
    return pytest.mark.slow(skip(test))


JOB = os.path.join(os.path.dirname(__file__), "jobs", "allreduce_ranks.py")


# ---------------------------------------------------------------- metrics on hand-made numbers
def test_spread_and_speedup():
    values = [1.0, 2.0, 3.0, 4.0, 5.0]
    result = metrics.spread(values)
    assert (result.median, result.count) == (3.0, 5)
    assert result.p10 == pytest.approx(1.4) and result.p90 == pytest.approx(4.6)
    ratio, low, high = metrics.speedup([2.0, 2.0, 2.0], [1.0, 1.0, 1.0])
    assert (ratio, low, high) == (2.0, 2.0, 2.0)
    ratio, low, high = metrics.speedup([2.0, 2.1, 1.9, 2.0], [1.0, 1.2, 0.9, 1.1])
    assert low <= ratio <= high and 1.5 < low and high < 2.5
    with pytest.raises(ValueError):
        metrics.speedup([], [1.0])
    with pytest.raises(ValueError):
        metrics.speedup([1.0], [0.0])


def test_round_ratios_pair_each_round_of_the_variant_with_the_baselines():
    # Round 2 ran slow for both: the ratio of its round is still 2.
    baseline = [2.0, 2.0, 4.0, 4.0]
    variant = [1.0, 1.0, 2.0, 2.0]
    assert metrics.round_ratios(baseline, variant, rounds=2) == [2.0, 2.0]
    assert metrics.round_ratios([2.0, 3.0], [2.0, 1.0], rounds=2) == [1.0, 3.0]
    with pytest.raises(ValueError, match="2 equal rounds"):
        metrics.round_ratios([1.0, 1.0, 1.0], [1.0, 1.0], rounds=2)


def test_steps_after_the_first_of_each_block_leave_the_lock_step_start_out():
    # Two blocks of three steps: the first of each (lock step) is dropped.
    assert metrics.after_first_steps([9.0, 1.0, 2.0, 8.0, 3.0, 4.0], 3) == [1.0, 2.0, 3.0, 4.0]
    with pytest.raises(ValueError, match="blocks of 2 or more"):
        metrics.after_first_steps([1.0, 2.0], 1)
    with pytest.raises(ValueError, match="3 steps in blocks of 2"):
        metrics.after_first_steps([1.0, 2.0, 3.0], 2)


def test_efficiency_bounds():
    assert metrics.efficiency(3.0, comm=1.0, comp=2.0) == 0.0   # no overlap at all
    assert metrics.efficiency(2.0, comm=1.0, comp=2.0) == 1.0   # full overlap
    assert metrics.efficiency(2.5, comm=1.0, comp=2.0) == 0.5
    assert math.isnan(metrics.efficiency(1.0, comm=0.0, comp=1.0))
    with pytest.raises(ValueError):
        metrics.efficiency(0.0, 1.0, 1.0)


def test_straggler_effect_and_order_consistency():
    assert metrics.straggler_effect([[1.0, 1.1], [2.0, 2.0], [1.0, 1.5]]) == pytest.approx(0.1)
    with pytest.raises(ValueError):
        metrics.straggler_effect([[1.0]])
    assert metrics.order_consistency([["a", "b"], ["a", "b"], ["b", "a"], ["a", "b"]]) == (
        2, 0.75)


# ---------------------------------------------------------------- the network
def test_loopback_network_gives_distinct_ports_and_no_namespaces():
    with EmulatedNetwork(3, loopback=True) as network:
        assert network.mode == "loopback"
        assert {network.address(h) for h in range(3)} == {"127.0.0.1"}
        assert len({network.port(h) for h in range(3)}) == 3
        assert network.port(1) == network.port(1)
        assert network.command(0, ["true"]) == ["true"]
    with pytest.raises(ValueError):
        EmulatedNetwork(0)
    with pytest.raises(ValueError):
        EmulatedNetwork(2, bandwidth=-1.0)


_RECEIVER = """
import socket, sys, time
server = socket.socket(); server.bind(("0.0.0.0", 20000)); server.listen()
print("listening", flush=True)
connection, _ = server.accept(); received = 0; start = None
while True:
    data = connection.recv(1 << 20)
    if not data:
        break
    start = start or time.perf_counter(); received += len(data)
print(received, time.perf_counter() - start, flush=True)
"""
_SENDER = """
import socket, sys
connection = socket.create_connection((sys.argv[1], 20000))
connection.sendall(b"x" * int(sys.argv[2])); connection.close()
"""


@needs_root
def test_namespaces_connect_hosts_and_shape_each_link():
    rate = 12.5e6  # 100 Mbit/s
    with EmulatedNetwork(2, bandwidth=rate, allow_fallback=False) as network:
        assert network.mode == "namespaces"
        assert set(leftovers()) == {"tfo-h0", "tfo-h1", "tfo-sw"}
        receiver = network.spawn(0, [sys.executable, "-c", _RECEIVER],
                                 stdout=subprocess.PIPE, text=True)
        assert receiver.stdout.readline().strip() == "listening"
        sender = network.spawn(1, [sys.executable, "-c", _SENDER, network.address(0),
                                   str(8_000_000)])
        assert sender.wait(timeout=60) == 0
        received, seconds = receiver.stdout.readline().split()
        assert int(received) == 8_000_000
        achieved = int(received) / float(seconds)
        assert 0.7 * rate < achieved < 1.15 * rate, f"{achieved / 1e6:.1f} MB/s"
    assert leftovers() == []


@needs_root
def test_a_second_run_is_refused_while_one_is_active():
    with EmulatedNetwork(1):
        with pytest.raises(NetworkError, match="another testbed run is active"):
            with EmulatedNetwork(1):
                pass
    assert leftovers() == []


# The holder restores Python's Ctrl-C handler: a test run started in the background by a
# non-interactive shell inherits SIGINT as ignored. It sleeps in short naps: a signal the
# kernel hands to another of its threads does not cut the main thread's sleep short, and
# Python runs the handler only when that sleep ends (in a full run the holder dumped
# its stack in time.sleep(1000) 30 s after SIGINT, then raised KeyboardInterrupt).
_HOLDER = """
import faulthandler, signal, subprocess, sys, time
signal.signal(signal.SIGINT, signal.default_int_handler)
faulthandler.register(signal.SIGUSR1)   # where it hangs, if it does
from tfoverlap.testbed.network import EmulatedNetwork
with EmulatedNetwork(2, bandwidth=12.5e6) as network:
    child = network.spawn(1, ["sleep", "1000"])
    print(child.pid, flush=True)
    while True:
        time.sleep(0.1)
"""


def _start_holder():
    holder = subprocess.Popen([sys.executable, "-c", _HOLDER], stdout=subprocess.PIPE,
                              text=True)
    child_pid = int(holder.stdout.readline())
    return holder, child_pid


def _alive(pid: int) -> bool:
    try:
        os.kill(pid, 0)
    except ProcessLookupError:
        return False
    with open(f"/proc/{pid}/stat") as stat:
        return stat.read().split()[2] != "Z"


@needs_root
def test_leftovers_of_a_killed_run_are_removed_by_the_next_run():
    holder, child_pid = _start_holder()
    holder.kill()  # SIGKILL: no chance to clean up
    holder.wait()
    assert "tfo-h1" in leftovers() and _alive(child_pid)
    with EmulatedNetwork(1) as network:
        assert "tfo-h1" in network.removed_leftovers
    assert leftovers() == []
    deadline = time.monotonic() + 5
    while _alive(child_pid) and time.monotonic() < deadline:
        time.sleep(0.05)
    assert not _alive(child_pid)


@needs_root
@pytest.mark.parametrize("signum", [signal.SIGINT, signal.SIGTERM])
def test_interrupted_run_tears_everything_down(signum):
    holder, child_pid = _start_holder()
    holder.send_signal(signum)
    try:
        assert holder.wait(timeout=30) != 0
    finally:
        if holder.poll() is None:       # never leave a holder with the lock behind
            holder.send_signal(signal.SIGUSR1)  # its threads' stacks, to the test's stderr
            time.sleep(1)
            holder.kill()
            holder.wait()
    assert leftovers() == []
    assert not _alive(child_pid)


# ---------------------------------------------------------------- the Horovod launchers
# In namespaces only: loopback ranks, under Gloo and MPI, are what every job of
# tests/test_contract_matrix.py and of the cross-step and decoupled suites runs on.
@pytest.mark.slow
@pytest.mark.skipif(not IS_ROOT, reason="ranks in namespaces need root")
@pytest.mark.parametrize("controller", ["gloo", "mpi"])
def test_horovod_launcher_runs_one_rank_per_host(controller):
    from tfoverlap.testbed.horovod_launch import run_horovod
    with EmulatedNetwork(2, bandwidth=125e6) as network:
        result = run_horovod(network, 2, [sys.executable, JOB], controller=controller,
                             timeout=180)
    assert result.returncode == 0, result.outputs
    reports = [json.loads(output.strip().splitlines()[-1]) for output in result.outputs]
    assert [r["rank"] for r in reports] == [0, 1]
    assert all(r["size"] == 2 and r["sum"] == 3.0 for r in reports)
    assert all(r[controller] for r in reports)
    assert reports[0]["netns"] != reports[1]["netns"]
    assert leftovers() == []


_DIES_OR_WAITS = """
import os, signal, time
import horovod.tensorflow as hvd
hvd.init()
if hvd.rank() == 1:
    os.kill(os.getpid(), signal.SIGKILL)     # as the kernel's OOM killer does
time.sleep(600)     # a rank that never notices (rank 0 of such a job spun for 12 min)
"""


@pytest.mark.slow
@pytest.mark.skipif(not IS_ROOT, reason="ranks in namespaces need root")
def test_a_rank_that_dies_ends_the_job_instead_of_leaving_the_others_waiting(monkeypatch):
    """Rank 1 is killed after Horovod's start-up; rank 0 goes on as if nothing happened:
    the launcher kills rank 0 once the grace after the first failure has passed, and the
    job ends with the failure, long before its timeout."""
    from tfoverlap.testbed import horovod_launch
    monkeypatch.setattr(horovod_launch, "FAILED_RANK_GRACE_S", 2.0)
    start = time.monotonic()
    with EmulatedNetwork(2, bandwidth=125e6) as network:
        result = horovod_launch.run_horovod(network, 2, [sys.executable, "-c", _DIES_OR_WAITS],
                                            controller="gloo", timeout=300)
    assert result.returncode == -signal.SIGKILL, result.outputs
    assert time.monotonic() - start < 120
    assert leftovers() == []


# Both ranks end well: horovodrun stops the others once one fails, maybe before they
# have written anything.
_WRITES_TO_BOTH_STREAMS = """
import os, sys
rank = os.environ["HOROVOD_RANK"]
print('{"rank": ' + rank + '}', flush=True)
print("rank " + rank + " says why it would fail", file=sys.stderr, flush=True)
"""


def test_a_loopback_job_returns_each_ranks_stdout_and_stderr():
    """horovodrun's path keeps both streams of each rank (a failed job's reason is on
    stderr), each rank's alone."""
    from tfoverlap.testbed import horovod_launch
    with EmulatedNetwork(2, loopback=True) as network:
        result = horovod_launch.run_horovod(network, 2, [sys.executable, "-c",
                                                         _WRITES_TO_BOTH_STREAMS],
                                            controller="gloo", timeout=120)
    assert result.returncode == 0, result.outputs
    for rank, output in enumerate(result.outputs):
        assert f'{{"rank": {rank}}}' in output.splitlines(), output
        assert f"rank {rank} says why it would fail" in output, output
        assert f"rank {1 - rank} says" not in output, output


_RUNS_ON = """
import os, time
with open(os.path.join(os.environ["PIDS"], os.environ["HOROVOD_RANK"]), "w") as pid:
    pid.write(str(os.getpid()))
while True:
    time.sleep(0.1)
"""


def test_a_test_job_whose_network_is_closed_ends_with_no_rank_left(tmp_path):
    """What the test session does with a Horovod job still running when it ends early
    (-x, Ctrl-C): it closes the job's network from its own thread, which kills the ranks
    (horovodrun's too); the job fails instead of training on, orphaned."""
    import threading
    from tests.helpers import run_jobs_in_sequence
    script, pids = tmp_path / "runs_on.py", tmp_path / "pids"
    script.write_text(_RUNS_ON)
    pids.mkdir()
    networks, errors = [], []

    def job():
        try:
            run_jobs_in_sequence(2, [(str(script), {"PIDS": str(pids)})], timeout=300,
                                 networks=networks)
        except BaseException as error:  # noqa: BLE001 - the test reads it
            errors.append(error)
    thread = threading.Thread(target=job, daemon=True)
    thread.start()
    deadline, ranks = time.monotonic() + 120, []
    while len(ranks) < 2 and thread.is_alive() and time.monotonic() < deadline:
        time.sleep(0.1)
        texts = [path.read_text() for path in pids.iterdir()]
        ranks = [int(text) for text in texts if text]
    assert len(ranks) == 2, (ranks, errors)
    assert len(networks) == 1
    networks[0].close()
    thread.join(60)
    assert not thread.is_alive() and len(errors) == 1
    assert isinstance(errors[0], AssertionError)        # the job's non-zero exit
    for pid in ranks:
        with pytest.raises(ProcessLookupError):
            os.kill(pid, 0)


_WAITS_FOR_A_PEER = """
import sys, time
def wait_in_a_collective_no_peer_joins():
    while True:
        time.sleep(0.1)
print("started", flush=True)
wait_in_a_collective_no_peer_joins()
"""


def test_a_job_script_past_its_timeout_prints_its_stacks_and_ends_its_job(tmp_path):
    """A script whose ranks wait in different collectives (an error caught on one rank
    alone) would hold its whole test job until the job's timeout, the sum of its scripts':
    past its own timeout each rank prints every thread's stack and exits with 1. A script
    done in time leaves no watchdog behind for the scripts after it."""
    scripts = {name: tmp_path / f"{name}.py" for name in ("in_time", "unwatched", "waits")}
    scripts["in_time"].write_text("import time; time.sleep(1.5); print('in time')\n")
    scripts["unwatched"].write_text("import time; time.sleep(1.5); print('unwatched')\n")
    scripts["waits"].write_text(_WAITS_FOR_A_PEER)
    from tests.helpers import IN_SEQUENCE
    began = time.monotonic()
    result = subprocess.run(
        [sys.executable, IN_SEQUENCE, "IN_SEQUENCE_TIMEOUT=2", str(scripts["in_time"]), ";",
         str(scripts["unwatched"]), ";", "IN_SEQUENCE_TIMEOUT=2", str(scripts["waits"])],
        capture_output=True, text=True, timeout=120)
    assert result.returncode == 1, (result.returncode, result.stdout, result.stderr)
    assert "in time\nunwatched\nstarted\n" in result.stdout, result.stdout
    assert "Timeout (0:00:02)!" in result.stdout, result.stdout
    assert "wait_in_a_collective_no_peer_joins" in result.stdout, result.stdout
    assert time.monotonic() - began < 60


# ---------------------------------------------------------------- PS cluster layouts
def test_layouts_say_how_many_hosts_they_take():
    from tfoverlap.testbed.cluster import LocalCluster, hosts_needed
    assert hosts_needed(2, 3) == 5
    assert hosts_needed(4, 4, "colocated") == 4
    with pytest.raises(ValueError, match="as many PS tasks as workers"):
        hosts_needed(2, 3, "colocated")
    with pytest.raises(ValueError, match="unknown layout"):
        hosts_needed(1, 1, "stacked")
    cluster = LocalCluster(num_ps=2, num_workers=2, layout="colocated")
    try:
        assert cluster.network.num_hosts == 2
        endpoints = cluster.spec["ps"] + cluster.spec["worker"]
        assert len(set(endpoints)) == 4
    finally:
        cluster.close()


@pytest.mark.parametrize("name", ["seq7", "par5", "resnet20"])
def test_models_spread_their_variables_over_the_ps_tasks_by_size(name):
    """Greedy by bytes, as TF1's load-balancing replica_device_setter: no PS task holds
    more than the largest variable beyond the least loaded one."""
    import tensorflow as tf
    from tfoverlap.testbed.models import build_model
    model = build_model(name, batch=2, num_ps=3, worker_device="/job:worker/task:0",
                        training=True, width=64)
    held, sizes = [0, 0, 0], []
    for op in model.graph.get_operations():
        if op.type == "VarHandleOp":
            sizes.append(tf.TensorShape(op.get_attr("shape")).num_elements()
                         * tf.as_dtype(op.get_attr("dtype")).size)
            held[tf.DeviceSpec.from_string(op.device).task] += sizes[-1]
    assert min(held) > 0 and max(held) - min(held) <= max(sizes), held


# Runs in host 0's namespace: builds the model once per worker (between-graph replication),
# runs one traced training step on each, and says where the variables went and what moved.
_TRAIN_TWO_TRACED_STEPS_ON_EACH_WORKER = """
import json, sys
import tensorflow as tf
from tfoverlap.costs.trace import recv_events
from tfoverlap.testbed.models import build_model
spec = json.loads(sys.argv[1])
def place(device):
    parsed = tf.DeviceSpec.from_string(device)
    return [parsed.job, parsed.task]
answer = {"variables": [], "moved": []}
for worker, address in enumerate(spec["worker"]):
    model = build_model("resnet20", batch=2, num_ps=len(spec["ps"]),
                        worker_device=f"/job:worker/task:{worker}", training=True)
    if worker == 0:
        answer["variables"] = [place(v.device) + [v.shape.num_elements() * v.dtype.size]
                               for v in model.variables]
    full = tf.compat.v1.RunOptions(trace_level=tf.compat.v1.RunOptions.FULL_TRACE)
    with tf.compat.v1.Session("grpc://" + address, graph=model.graph) as session:
        if worker == 0:
            session.run(model.init)
        # Two traced steps: in one full test run a push from worker 1 to its own host's
        # PS task was missing from the one traced step (cause not found; it did not recur
        # in runs of this test alone).
        for _ in range(2):
            metadata = tf.compat.v1.RunMetadata()
            session.run(model.fetch, options=full, run_metadata=metadata)
            answer["moved"] += [place(e.source_device) + place(e.destination_device)
                                + [e.source] for e in recv_events(metadata)]
print(json.dumps(answer))
"""


@needs_root
def test_colocated_hosts_run_a_worker_and_a_ps_task_and_share_the_model_by_size():
    from tfoverlap.testbed.cluster import PsCluster
    with EmulatedNetwork(2, bandwidth=125e6, allow_fallback=False) as network:
        cluster = PsCluster(network, num_ps=2, num_workers=2, layout="colocated")
        for host in range(2):
            assert (cluster.spec["ps"][host].split(":")[0]
                    == cluster.spec["worker"][host].split(":")[0] == network.address(host))
        cluster.start_servers(("ps", "worker"))
        for (job, task), process in cluster.processes.items():
            where = subprocess.run(["ip", "netns", "identify", str(process.pid)],
                                   capture_output=True, text=True).stdout.strip()
            assert where == f"tfo-h{task}", (job, task)
            with open(f"/proc/{process.pid}/cmdline") as cmdline:
                assert f"\0{job}\0{task}\0" in cmdline.read()    # the server, not `ip`
        memory = cluster.resident_memory()
        assert len(memory["ps"]) == len(memory["worker"]) == 2
        assert min(memory["ps"] + memory["worker"]) > 50e6     # a TensorFlow server each
        client = network.spawn(0, [sys.executable, "-c", _TRAIN_TWO_TRACED_STEPS_ON_EACH_WORKER,
                                   json.dumps(cluster.spec)],
                               stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True)
        output, errors = client.communicate(timeout=240)
        assert client.returncode == 0, errors[-3000:]
    answer = json.loads(output.strip().splitlines()[-1])
    shard = [0, 0]
    for job, task, size in answer["variables"]:
        assert job == "ps"
        shard[task] += size
    largest = max(size for _, _, size in answer["variables"])
    assert min(shard) > 0 and max(shard) - min(shard) <= largest, shard
    # Every worker read from both PS tasks (at least one read per variable there) and
    # pushed gradients to both.
    for worker in range(2):
        for ps in range(2):
            reads = {source for *edge, source in answer["moved"]
                     if edge == ["ps", ps, "worker", worker] and "ReadVariableOp" in source}
            pushes = [source for *edge, source in answer["moved"]
                      if edge == ["worker", worker, "ps", ps]]
            held = sum(1 for _, task, _ in answer["variables"] if task == ps)
            assert len(reads) >= held, (worker, ps, len(reads), held)
            assert pushes, (worker, ps)
    assert leftovers() == []
