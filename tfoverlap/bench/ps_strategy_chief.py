"""The coordinator of the PS benchmark's TF2 job (``bench.ps --api ps_strategy``).

TF2 trains with PS tasks through ``tf.distribute.experimental.ParameterServerStrategy``:
one coordinator (this process, the chief) builds the Keras model under the strategy's
scope, so its variables and the optimizer's slots live on the PS tasks (TensorFlow's own
placement, round robin), and a ``ClusterCoordinator`` schedules the training step on
whichever worker is free. The workers are plain ``tf.distribute.Server`` tasks with
tfoverlap loaded: Grappler, and so the TfOverlap pass, runs *there*, on each scheduled
function, with the config this process scheduled it under.

Every variant is its own ``tf.function`` of the same step (TensorFlow instantiates a
function once per config), scheduled under the variant's function config. The driver
(:mod:`tfoverlap.bench.ps_strategy`) speaks the protocol of
:mod:`tfoverlap.bench.ps_worker`:

- ``warmup {variant}``: schedule two steps per worker of the variant (Grappler runs);
- ``set_dilation {value}``: functions scheduled afterwards run under this dilation;
- ``steps {variant, steps}``: ``steps`` steps on every worker at once; answers the block's
  wall time divided by ``steps`` (the time of one step of each worker) and this process's
  CPU time;
- ``trace {variant, steps, task, logdir}``: one step at a time, while the profiler
  captures PS task ``task`` (TensorFlow's servers serve the profiler on their own port);
- ``comm {steps}``: steps that only move the parameters (and, when training, as much data
  back), on every worker at once;
- ``comp {steps}``: the model with its variables on worker 0, called directly: the step
  without the PS;
- ``quit``.

    python -m tfoverlap.bench.ps_strategy_chief '<json configuration>'
"""
from __future__ import annotations

import contextlib
import json
import sys
import threading
import time

from tfoverlap.bench.ps_worker import answer_commands

__all__ = ["Coordinator", "main"]


class Coordinator:
    """The chief of the TF2 job: the model, its step functions per variant and dilation,
    and the driver's commands (see the module docstring)."""

    def __init__(self, config: dict):
        import tensorflow as tf

        import tfoverlap
        from tfoverlap.testbed.models import KERAS_APPLICATIONS
        self.tf, self.tfoverlap, self.config = tf, tfoverlap, config
        tfoverlap.load()
        resolver = tf.distribute.cluster_resolver.SimpleClusterResolver(
            tf.train.ClusterSpec(config["spec"]), task_type="chief", task_id=0,
            rpc_layer="grpc")
        self.strategy = tf.distribute.experimental.ParameterServerStrategy(resolver)
        self.coordinator = tf.distribute.experimental.coordinator.ClusterCoordinator(
            self.strategy)
        self.num_workers = len(config["spec"]["worker"])
        self.dilation = float(config.get("dilation") or 1.0)
        application = getattr(tf.keras.applications, KERAS_APPLICATIONS[config["model"]])
        size = config["image_size"]

        def build(device_scope):
            tf.keras.utils.set_random_seed(config["seed"])
            with device_scope:
                model = application(weights=None, input_shape=(size, size, 3), classes=1000,
                                    classifier_activation=None)     # logits
                optimizer = tf.keras.optimizers.SGD(0.01, momentum=0.9)
                if config["training"]:
                    optimizer.build(model.trainable_variables)
            return model, optimizer
        self.model, self.optimizer = build(self.strategy.scope())
        self.worker0 = "/job:worker/replica:0/task:0/device:CPU:0"
        self._local_build = lambda: build(tf.device(self.worker0))
        self.local = None
        self.parameter_bytes = sum(v.shape.num_elements() * v.dtype.size
                                   for v in self.model.variables)
        self.iterator = iter(self.coordinator.create_per_worker_dataset(self._dataset))
        self.functions: dict = {}

    def _dataset(self):
        tf, config = self.tf, self.config
        size = config["image_size"]
        images = tf.random.stateless_uniform([config["batch"], size, size, 3],
                                             seed=[config["seed"], 1])
        labels = tf.random.stateless_uniform([config["batch"]], seed=[config["seed"], 2],
                                             maxval=1000, dtype=tf.int32)
        return tf.data.Dataset.from_tensors((images, labels)).repeat()

    def _step_body(self, model, optimizer):
        tf, training = self.tf, self.config["training"]
        loss_of = tf.keras.losses.SparseCategoricalCrossentropy(
            from_logits=True, reduction=tf.keras.losses.Reduction.NONE)

        def step(images, labels):
            if not training:
                return tf.reduce_mean(model(images, training=False))
            with tf.GradientTape() as tape:
                loss = tf.reduce_mean(loss_of(labels, model(images, training=True)))
            gradients = tape.gradient(loss, model.trainable_variables)
            optimizer.apply_gradients(zip(gradients, model.trainable_variables))
            return loss
        return step

    def _options(self, variant: str) -> dict:
        options = dict(self.config["variants"][variant].get("tfoverlap") or {})
        if self.config.get("emulate"):
            options = {"schedule": "none", **options, "emulate": self.config["emulate"],
                       "dilation": self.dilation}
        return options

    def _scheduled(self, variant: str):
        """The variant's step function at the current dilation, and its options."""
        key = (variant, self.dilation)
        if key not in self.functions:
            tf, strategy, body = self.tf, self.strategy, self._step_body(self.model,
                                                                         self.optimizer)

            @tf.function
            def train_step(iterator):
                images, labels = next(iterator)
                return strategy.run(body, args=(images, labels))
            self.functions[key] = train_step
        return self.functions[key], self._options(variant)

    def _run(self, function, options: dict, closures: int, join_each: bool = False):
        with self.tfoverlap.tf_function_options(**options) if options else contextlib.nullcontext():
            for _ in range(closures):
                self.coordinator.schedule(function, args=(self.iterator,))
                if join_each:
                    self.coordinator.join()
            self.coordinator.join()

    # ------------------------------------------------------------------ commands
    def set_dilation(self, command):
        self.dilation = float(command["value"])
        return {}

    def warmup(self, command):
        function, options = self._scheduled(command["variant"])
        start = time.perf_counter()
        self._run(function, options, 2 * self.num_workers)
        return {"seconds": [(time.perf_counter() - start) / 2]}

    def steps(self, command):
        function, options = self._scheduled(command["variant"])
        start, start_cpu = time.perf_counter(), time.process_time()
        self._run(function, options, command["steps"] * self.num_workers)
        per_step = (time.perf_counter() - start) / command["steps"]
        cpu = (time.process_time() - start_cpu) / command["steps"]
        return {"times": [per_step], "cpu": [cpu]}

    def trace(self, command):
        """Runs ``steps`` steps one at a time while the profiler captures PS task ``task``
        (TensorFlow's servers serve the profiler on their own port); the capture lands
        under ``logdir``. One task per capture: with several at once, TensorFlow 2.15's
        client sometimes returned an empty capture for one."""
        tf = self.tf
        function, options = self._scheduled(command["variant"])
        address = "grpc://" + self.config["spec"]["ps"][command["task"]]
        failure = []

        def capture():
            try:
                tf.profiler.experimental.client.trace(address, command["logdir"],
                                                      int(command["capture_s"] * 1000))
            except Exception as error:      # reported with the answer
                failure.append(f"{type(error).__name__}: {error}")
        thread = threading.Thread(target=capture)
        thread.start()
        time.sleep(command.get("lead_s", 1.0))
        start = time.perf_counter()
        self._run(function, options, command["steps"], join_each=True)
        seconds = time.perf_counter() - start
        thread.join()
        return {"seconds": seconds, "capture_error": failure[0] if failure else ""}

    def comm(self, command):
        key = ("comm", self.dilation)
        if key not in self.functions:
            tf, strategy, variables = self.tf, self.strategy, self.model.variables
            training = self.config["training"]

            def move():
                sums = []
                for variable in variables:
                    arrived = tf.identity(variable.read_value())
                    sums.append(tf.reduce_sum(arrived))
                    if training:
                        variable.assign_add(arrived * 0.0)
                return tf.add_n(sums)

            @tf.function
            def comm_step(iterator):
                next(iterator)
                return strategy.run(move)
            self.functions[key] = comm_step
            self._run(comm_step, self._options("default"), self.num_workers)  # traced
        options = self._options("default")
        start = time.perf_counter()
        self._run(self.functions[key], options, command["steps"] * self.num_workers)
        return {"times": [(time.perf_counter() - start) / command["steps"]]}

    def comp(self, command):
        tf = self.tf
        key = ("comp", self.dilation)
        if self.local is None:
            self.local = self._local_build()
        if key not in self.functions:
            body = self._step_body(*self.local)
            batch = self._dataset().take(1).get_single_element()
            with tf.device(self.worker0):
                images, labels = tf.identity(batch[0]), tf.identity(batch[1])

            @tf.function
            def local_step():
                with tf.device(self.worker0):
                    return body(images, labels)
            self.functions[key] = local_step
        options = self._options("default")
        with self.tfoverlap.tf_function_options(**options) if options else contextlib.nullcontext():
            self.functions[key]().numpy()
            times = []
            for _ in range(command["steps"]):
                start = time.perf_counter()
                self.functions[key]().numpy()
                times.append(time.perf_counter() - start)
        return {"times": times}


def main(argv=None) -> int:
    argv = sys.argv[1:] if argv is None else argv
    coordinator = Coordinator(json.loads(argv[0]))
    return answer_commands(coordinator, {
        "ready": True, "variables": len(coordinator.model.variables),
        "parameter_bytes": coordinator.parameter_bytes})


if __name__ == "__main__":
    raise SystemExit(main())
