"""One worker of the PS benchmark, run as its own process on its own emulated host.

It serves its task of the cluster (so its master, and the TfOverlap pass, run here),
builds the model with its parameters on the PS tasks (between-graph replication: every
worker builds the same graph), and then does what the driver asks, one JSON command per
line on stdin, one JSON answer per line on stdout (prefixed with :data:`ANSWER`):

- ``init``: initialize the variables (the chief only);
- ``warmup {variant}``: open the variant's session (Grappler runs) and run two steps;
- ``set_dilation {value}``: emulated runs: sessions opened afterwards use this dilation;
- ``save_graph {path}``: write the model's GraphDef (for the simulator and the CLI);
- ``profile {steps, path}``: profile default steps for TAC (``tfoverlap.profile``);
- ``steps {variant, steps}``: timed steps, answers their wall times and this process's CPU
  time per step;
- ``trace {variant, after}``: one fully traced step, ``after`` untraced steps into a
  block started on every worker at once (0: the block's lock-step first step): the observed
  transfer order, a timeline, and when the step started (µs since the epoch, to line the
  workers' steps up);
- ``comm {steps}``: steps that only move the parameters (and, when training, gradients of
  the same size back), as the communication time of one iteration;
- ``comp {steps}``: the same model with local parameters, as its computation time;

With ``emulate`` in the configuration every session (every variant, and the local model)
runs the emulate pass with the current dilation: the heavy compute becomes emulated
accelerator kernels; times are answered in wall time (the driver divides by the dilation).
- ``quit``.

    python -m tfoverlap.bench.ps_worker '<json configuration>'
"""
from __future__ import annotations

import json
import sys
import time
import traceback

__all__ = ["ANSWER", "answer_commands", "main"]

ANSWER = "tfoverlap-bench "


class Worker:
    def __init__(self, config: dict):
        import tensorflow as tf
        import tfoverlap
        from tfoverlap.testbed.models import build_model
        self.tf, self.tfoverlap, self.config = tf, tfoverlap, config
        self.task = config["task"]
        self.device = f"/job:worker/task:{self.task}"
        self.base = tf.compat.v1.ConfigProto(
            intra_op_parallelism_threads=config["intra_op"],
            inter_op_parallelism_threads=config["inter_op"])
        self.server = tf.distribute.Server(tf.train.ClusterSpec(config["spec"]),
                                           job_name="worker", task_index=self.task,
                                           config=self.base, start=True)
        num_ps = len(config["spec"]["ps"])
        self.model = build_model(config["model"], batch=config["batch"], num_ps=num_ps,
                                 worker_device=self.device, training=config["training"],
                                 image_size=config["image_size"], width=config["width"],
                                 seed=config["seed"])
        self.comm_fetch = self._communication_only()
        self.dilation = float(config.get("dilation") or 1.0)
        self.sessions: dict = {}
        self.local_sessions: dict = {}

    def _communication_only(self):
        """Moves every parameter to this worker (and, training, as much data back)."""
        tf = self.tf
        with self.model.graph.as_default():
            sums, updates = [], []
            for variable in self.model.variables:
                with tf.device(self.device):
                    arrived = tf.identity(variable)
                    sums.append(tf.reduce_sum(arrived))
                    if self.config["training"]:
                        zeros = arrived * 0.0
                if self.config["training"]:
                    with tf.compat.v1.colocate_with(variable):
                        updates.append(tf.compat.v1.assign_add(variable, zeros).op)
            with tf.device(self.device):
                return tf.group(tf.add_n(sums), *updates)

    def session_config(self, variant: str):
        spec = self.config["variants"][variant]
        config = self.tf.compat.v1.ConfigProto()
        config.CopyFrom(self.base)
        if spec.get("recv_scheduling"):
            config.graph_options.enable_recv_scheduling = True
        options = dict(spec.get("tfoverlap") or {})
        if self.config.get("emulate"):
            options = {"schedule": "none", **options, **self.emulation()}
        if options:
            config = self.tfoverlap.session_config(config, **options)
        return config

    def emulation(self) -> dict:
        return {"emulate": self.config["emulate"], "dilation": self.dilation}

    def session(self, variant: str):
        key = (variant, self.dilation)
        if key not in self.sessions:
            self.sessions[key] = self.tf.compat.v1.Session(
                self.server.target, graph=self.model.graph, config=self.session_config(variant))
        return self.sessions[key]

    def timed(self, session, fetch, steps: int, cpu: list | None = None) -> list[float]:
        """Wall times of ``steps`` steps; with ``cpu``, appends this process's CPU time of
        each step to it."""
        times = []
        for _ in range(steps):
            start, start_cpu = time.perf_counter(), time.process_time()
            session.run(fetch)
            times.append(time.perf_counter() - start)
            if cpu is not None:
                cpu.append(time.process_time() - start_cpu)
        return times

    # ------------------------------------------------------------------ commands
    def set_dilation(self, command):
        self.dilation = float(command["value"])
        return {}

    def init(self, command):
        self.session("default").run(self.model.init)
        return {}

    def warmup(self, command):
        mark = self.tfoverlap.report_count()
        seconds = self.timed(self.session(command["variant"]), self.model.fetch, 2)
        summary = {}
        if self.config["variants"][command["variant"]].get("tfoverlap") is not None:
            summary = self._pass_summary(mark)
        return {"seconds": seconds, "pass": summary}

    def _pass_summary(self, mark: int) -> dict:
        """What the pass did in the reports recorded after ``mark`` (a report count)."""
        reports = self.tfoverlap.recent_reports(since=mark)
        for report in reversed(reports):
            for entry in report.passes:
                if entry.summary.get("transfers"):
                    # Grappler's second round re-plans the same edges: "unchanged" there.
                    return {"transfers": entry.summary["transfers"],
                            "ordering_edges": entry.summary.get("ordering_edges", 0),
                            "gates": entry.summary.get("gates", 0),
                            "predicted_gain": entry.summary.get("predicted_gain"),
                            "declined": entry.summary.get("declined", ""),
                            "link": entry.summary.get("link", ""),
                            "modified": any(r.modified for r in reports)}
        return {"transfers": 0, "ordering_edges": 0, "modified": False}

    def save_graph(self, command):
        """Writes what one step runs: the model's GraphDef (as built, before Grappler)
        pruned to the step's fetch, for the simulator and the CLI."""
        graph_def = self.tf.compat.v1.graph_util.extract_sub_graph(
            self.model.graph.as_graph_def(), [self.model.fetch.name.split(":")[0]])
        with open(command["path"], "wb") as stream:
            stream.write(graph_def.SerializeToString())
        return {"fetch": self.model.fetch.name.split(":")[0]}

    def profile(self, command):
        self.tfoverlap.profile(self.session("default"), self.model.fetch,
                               steps=command["steps"], warmup=command.get("warmup", 1),
                               path=command["path"])
        return {}

    def steps(self, command):
        cpu: list = []
        times = self.timed(self.session(command["variant"]), self.model.fetch,
                           command["steps"], cpu)
        return {"times": times, "cpu": cpu}

    def trace(self, command):
        from tfoverlap.costs.trace import observed_transfer_order, step_timeline
        tf = self.tf
        metadata = tf.compat.v1.RunMetadata()
        options = tf.compat.v1.RunOptions(trace_level=tf.compat.v1.RunOptions.FULL_TRACE,
                                          output_partition_graphs=bool(self.config.get(
                                              "emulate")))
        session = self.session(command["variant"])
        for _ in range(command.get("after", 0)):
            session.run(self.model.fetch)
        started_us = time.time() * 1e6
        start = time.perf_counter()
        session.run(self.model.fetch, options=options, run_metadata=metadata)
        seconds = time.perf_counter() - start
        timeline = step_timeline(metadata, self.device)
        return {"seconds": seconds, "started_us": started_us,
                "order": observed_transfer_order(metadata), **timeline}

    def comm(self, command):
        session = self.session("default")
        session.run(self.comm_fetch)
        return {"times": self.timed(session, self.comm_fetch, command["steps"])}

    def comp(self, command):
        from tfoverlap.testbed.models import build_model
        if self.dilation not in self.local_sessions:
            config = self.config
            local = build_model(config["model"], batch=config["batch"], num_ps=0,
                                worker_device="/cpu:0", training=config["training"],
                                image_size=config["image_size"], width=config["width"],
                                seed=config["seed"])
            session_config = self.base
            if config.get("emulate"):
                session_config = self.tfoverlap.session_config(self.base, schedule="none",
                                                               **self.emulation())
            session = self.tf.compat.v1.Session(graph=local.graph, config=session_config)
            session.run(local.init)
            session.run(local.fetch)
            self.local_sessions[self.dilation] = (session, local.fetch)
        session, fetch = self.local_sessions[self.dilation]
        return {"times": self.timed(session, fetch, command["steps"])}


def answer_commands(handler, ready: dict) -> int:
    """Prints ``ready``, then answers the driver's commands (one JSON object per line on
    stdin, ``{"cmd": name, ...}``) with ``handler``'s method of that name until ``quit``."""
    print(ANSWER + json.dumps(ready), flush=True)
    for line in sys.stdin:
        command = json.loads(line)
        if command["cmd"] == "quit":
            break
        try:
            answer = getattr(handler, command["cmd"])(command)
        except Exception as error:  # reported to the driver, which stops the run
            answer = {"error": f"{type(error).__name__}: {error}",
                      "traceback": traceback.format_exc(limit=5)}
        print(ANSWER + json.dumps(answer), flush=True)
    return 0


def main(argv=None) -> int:
    argv = sys.argv[1:] if argv is None else argv
    worker = Worker(json.loads(argv[0]))
    return answer_commands(worker, {
        "ready": True, "nodes": len(worker.model.graph.as_graph_def().node),
        "variables": len(worker.model.variables),
        "parameter_bytes": worker.model.parameter_bytes})


if __name__ == "__main__":
    raise SystemExit(main())
