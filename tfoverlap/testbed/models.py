"""Models for tests and benchmarks, built as TF1 graphs with parameters on PS tasks.

``chain_model`` (TicTac's seq-N) and ``parallel_model`` (par-N) are the synthetic models;
``keras_model`` builds a Keras application without weights. ``build_model`` picks one by
name, for the benchmark's worker processes.
"""
from __future__ import annotations

import dataclasses
from typing import Sequence

__all__ = ["PsModel", "MODEL_NAMES", "CIFAR_MODELS", "cifar_resnet", "chain_model",
           "parallel_model", "keras_model", "transformer_network", "transformer_model",
           "control_flow_model", "build_model"]

KERAS_APPLICATIONS = {"resnet50": "ResNet50", "inception_v3": "InceptionV3",
                      "vgg16": "VGG16", "resnet152": "ResNet152",
                      "mobilenet_v2": "MobileNetV2"}
#: CIFAR-sized models (32x32 images, 10 classes), built here in Keras.
CIFAR_MODELS = ("resnet20",)
#: the benchmarks' transformer: tokens per sequence, and the vocabulary.
TRANSFORMER_SEQUENCE, TRANSFORMER_VOCABULARY = 128, 8000
MODEL_NAMES = ("seq32", "par32") + tuple(KERAS_APPLICATIONS) + CIFAR_MODELS + ("transformer",)


@dataclasses.dataclass
class PsModel:
    """A built model: what to run, and which variables live where."""

    graph: object
    init: object
    loss: object
    train_op: object | None
    variables: list
    feeds: object = None    # step number -> feed_dict, for models with fed switches

    def feed(self, step: int) -> dict | None:
        return self.feeds(step) if self.feeds is not None else None

    @property
    def fetch(self):
        """What one step runs: the training op, or the loss for inference."""
        return self.train_op if self.train_op is not None else self.loss

    @property
    def parameter_bytes(self) -> int:
        return sum(v.shape.num_elements() * v.dtype.size for v in self.variables)


def _ps_devices(num_ps: int, ps_devices: Sequence[str] | None,
                worker_device: str) -> Sequence[str]:
    """Where parameters go: ``ps_devices``, else PS tasks 0..num_ps-1; 0 PS: the worker."""
    if ps_devices:
        return ps_devices
    if num_ps == 0:
        return [worker_device]
    return [f"/job:ps/task:{task}" for task in range(num_ps)]


def _finish(graph, device, loss, variables, training: bool, learning_rate: float,
            wrap_optimizer=None) -> PsModel:
    """Adds the training op (on ``device``, a name or a device function) and the init op.

    ``wrap_optimizer`` turns the plain SGD optimizer into the one that trains (a Horovod
    ``DistributedOptimizer``, for example)."""
    import tensorflow as tf
    with graph.as_default(), tf.compat.v1.device(device):
        train_op = None
        if training:
            optimizer = tf.compat.v1.train.GradientDescentOptimizer(learning_rate)
            if wrap_optimizer is not None:
                optimizer = wrap_optimizer(optimizer)
            train_op = optimizer.minimize(loss, var_list=variables)
        init = tf.compat.v1.global_variables_initializer()
    return PsModel(graph=graph, init=init, loss=loss, train_op=train_op, variables=variables)


class _LeastLoadedTask:
    """``replica_device_setter`` strategy: each variable to the PS task with fewest bytes."""

    def __init__(self, num_tasks: int):
        self.loads = [0] * num_tasks

    def __call__(self, op) -> int:
        import tensorflow as tf
        shape = tf.TensorShape(op.get_attr("shape"))
        size = (shape.num_elements() or 1) * tf.as_dtype(op.get_attr("dtype")).size
        task = self.loads.index(min(self.loads))
        self.loads[task] += size
        return task


def _kernel(name: str, width: int, seed: int, use_resource: bool = True):
    """A width x width kernel, initialized with a scale that keeps activations stable."""
    import tensorflow as tf
    return tf.compat.v1.get_variable(
        name, shape=[width, width], use_resource=use_resource,
        initializer=tf.compat.v1.random_normal_initializer(stddev=1.0 / width ** 0.5,
                                                           seed=seed))


def chain_model(num_layers: int = 16, width: int = 256, batch: int = 64,
                num_ps: int = 1, worker_device: str = "/job:worker/task:0",
                ps_devices: Sequence[str] | None = None, use_resource: bool = True,
                training: bool = False,
                learning_rate: float = 0.01, seed: int = 0) -> PsModel:
    """TicTac's seq model: ``num_layers`` dense layers in a chain.

    Layer i's kernel lives on ``ps_devices[i % len(ps_devices)]`` (default: PS tasks
    0..num_ps-1 of job "ps"): the kernels are all of one size, so this is the spread by
    size of :class:`_LeastLoadedTask`. The compute runs on ``worker_device``. The input is
    a fixed synthetic batch, so losses are reproducible given ``seed``.
    """
    import tensorflow as tf
    ps_devices = _ps_devices(num_ps, ps_devices, worker_device)
    graph = tf.Graph()
    with graph.as_default():
        tf.compat.v1.set_random_seed(seed)
        weights = []
        for layer in range(num_layers):
            with tf.device(ps_devices[layer % len(ps_devices)]):
                weights.append(_kernel(f"layer{layer}/kernel", width, seed + layer,
                                       use_resource))
        with tf.device(worker_device):
            inputs = tf.random.stateless_normal([batch, width], seed=[seed, 7])
            hidden = inputs
            for weight in weights:
                hidden = tf.nn.relu(tf.matmul(hidden, weight))
            loss = tf.reduce_mean(tf.square(hidden))
    return _finish(graph, worker_device, loss, weights, training, learning_rate)


def parallel_model(num_branches: int = 32, width: int = 256, batch: int = 64,
                   num_ps: int = 1, worker_device: str = "/job:worker/task:0",
                   ps_devices: Sequence[str] | None = None, training: bool = False,
                   learning_rate: float = 0.01, seed: int = 0) -> PsModel:
    """TicTac's par model: ``num_branches`` independent two-layer branches, summed.

    Every branch can start as soon as its own two kernels arrive, so the order of the
    transfers decides how early compute starts and how much of it overlaps. Kernel k (two
    per branch, in branch order) lives on ``ps_devices[k % len(ps_devices)]``, the spread
    by size of equal kernels, as in :func:`chain_model`.
    """
    import tensorflow as tf
    ps_devices = _ps_devices(num_ps, ps_devices, worker_device)
    graph = tf.Graph()
    with graph.as_default():
        tf.compat.v1.set_random_seed(seed)
        weights = []
        for branch in range(num_branches):
            for layer in range(2):
                with tf.device(ps_devices[len(weights) % len(ps_devices)]):
                    weights.append(_kernel(f"branch{branch}/layer{layer}/kernel", width,
                                           seed + 2 * branch + layer))
        with tf.device(worker_device):
            inputs = tf.random.stateless_normal([batch, width], seed=[seed, 7])
            outputs = []
            for branch in range(num_branches):
                hidden = tf.nn.relu(tf.matmul(inputs, weights[2 * branch]))
                outputs.append(tf.matmul(hidden, weights[2 * branch + 1]))
            loss = tf.reduce_mean(tf.square(tf.add_n(outputs)))
    return _finish(graph, worker_device, loss, weights, training, learning_rate)


def cifar_resnet(depth: int = 20, classes: int = 10):
    """He et al.'s CIFAR ResNet (depth 6n+2: three stages of n basic blocks with 16, 32
    and 64 filters, batch norm, a projection shortcut where the shape changes), as a
    Keras model on 32x32x3 images."""
    import tensorflow as tf
    layers = tf.keras.layers
    if (depth - 2) % 6:
        raise ValueError(f"a CIFAR ResNet has depth 6n+2, got {depth}")
    blocks = (depth - 2) // 6

    def conv_bn(x, filters, strides=1, relu=True):
        x = layers.Conv2D(filters, 3, strides, padding="same", use_bias=False)(x)
        x = layers.BatchNormalization()(x)
        return layers.ReLU()(x) if relu else x

    images = layers.Input((32, 32, 3))
    x = conv_bn(images, 16)
    for stage, filters in enumerate((16, 32, 64)):
        for block in range(blocks):
            strides = 2 if stage > 0 and block == 0 else 1
            shortcut = x
            if strides != 1:
                shortcut = layers.Conv2D(filters, 1, strides, use_bias=False)(x)
                shortcut = layers.BatchNormalization()(shortcut)
            y = conv_bn(conv_bn(x, filters, strides), filters, relu=False)
            x = layers.ReLU()(layers.Add()([y, shortcut]))
    x = layers.GlobalAveragePooling2D()(x)
    return tf.keras.Model(images, layers.Dense(classes, activation="softmax")(x),
                          name=f"resnet{depth}")


def keras_model(application: str, batch: int = 8, image_size: int = 224, num_ps: int = 1,
                worker_device: str = "/job:worker/task:0", training: bool = False,
                learning_rate: float = 0.01, seed: int = 0, classes: int = 1000,
                wrap_optimizer=None) -> PsModel:
    """A ``tf.keras.applications`` model without weights (or ``resnet20``, CIFAR-sized:
    32x32 images and 10 classes whatever ``image_size`` and ``classes`` say), on synthetic
    images.

    Variables are spread over the PS tasks by size (each to the least loaded task), the
    compute runs on ``worker_device``. With
    ``num_ps=0`` everything runs on ``worker_device`` (the compute-only reference).
    """
    import tensorflow as tf
    graph = tf.Graph()
    with graph.as_default():
        tf.compat.v1.set_random_seed(seed)
        setter = worker_device
        if num_ps > 0:
            setter = tf.compat.v1.train.replica_device_setter(
                ps_tasks=num_ps, worker_device=worker_device,
                ps_strategy=_LeastLoadedTask(num_ps))
        with tf.compat.v1.device(setter):
            if application in CIFAR_MODELS:
                image_size, classes = 32, 10
                model = cifar_resnet(int(application.removeprefix("resnet")), classes)
            else:
                model = getattr(tf.keras.applications, KERAS_APPLICATIONS[application])(
                    weights=None, input_shape=(image_size, image_size, 3), classes=classes)
            images = tf.random.stateless_uniform([batch, image_size, image_size, 3],
                                                 seed=[seed, 1])
            labels = tf.random.stateless_uniform([batch], seed=[seed, 2], maxval=classes,
                                                 dtype=tf.int32)
            logits = model(images, training=training)
            loss = tf.reduce_mean(tf.keras.losses.sparse_categorical_crossentropy(
                labels, logits))
    return _finish(graph, setter, loss, list(model.trainable_variables), training,
                   learning_rate, wrap_optimizer)


def control_flow_model(parts: Sequence[str] = ("lstm", "loop", "batchnorm", "cond"),
                       batch: int = 8,
                       time_steps: int = 6, width: int = 32,
                       worker_device: str = "/job:worker/task:0",
                       ps_device: str = "/job:ps/task:0", use_resource: bool = True,
                       training: bool = False, learning_rate: float = 0.05,
                       seed: int = 0, wrap_optimizer=None,
                       control_flow_v2: bool = True) -> PsModel:
    """A model made of the control flow real programs have, parameters on ``ps_device``:

    ``lstm``: an LSTM unrolled by ``tf.compat.v1.nn.dynamic_rnn`` (a while loop);
    ``loop``: a ``tf.while_loop`` whose body reads a parameter in every iteration;
    ``batchnorm``: Keras batch norm whose learning phase is a placeholder (a cond);
    ``cond``: a ``tf.cond`` head whose branch alternates between steps (fed, see ``feed``);
    then a dense layer. ``parts`` picks any of them, in this order. ``control_flow_v2=False``
    builds TF1 control flow (Switch, Merge, Enter, Exit in the graph itself) instead of the
    functional ``If``/``While`` that TensorFlow lowers before Grappler sees them.
    """
    from tensorflow.python.ops import control_flow_util
    enabled = control_flow_util.ENABLE_CONTROL_FLOW_V2
    control_flow_util.ENABLE_CONTROL_FLOW_V2 = control_flow_v2
    try:
        return _control_flow_model(parts, batch, time_steps, width, worker_device, ps_device,
                                   use_resource, training, learning_rate, seed, wrap_optimizer)
    finally:
        control_flow_util.ENABLE_CONTROL_FLOW_V2 = enabled


def _control_flow_model(parts, batch, time_steps, width, worker_device, ps_device,
                        use_resource, training, learning_rate, seed, wrap_optimizer):
    import tensorflow as tf
    variable_ops = ("VariableV2", "VarHandleOp", "Variable")

    def place(op):
        return ps_device if op.type in variable_ops else worker_device

    graph = tf.Graph()
    with graph.as_default(), tf.compat.v1.device(place):
        tf.compat.v1.set_random_seed(seed)
        initializer = tf.compat.v1.glorot_uniform_initializer(seed=seed)
        with tf.compat.v1.variable_scope("model", initializer=initializer,
                                         use_resource=use_resource):
            hidden = tf.random.stateless_normal([batch, time_steps, width], seed=[seed, 3])
            phase = tf.compat.v1.placeholder_with_default(False, [], name="learning_phase")
            branch = tf.compat.v1.placeholder_with_default(True, [], name="branch")
            updates = []
            if "lstm" in parts:
                cell = tf.compat.v1.nn.rnn_cell.LSTMCell(width, name="lstm")
                outputs, _ = tf.compat.v1.nn.dynamic_rnn(cell, hidden, dtype=tf.float32)
                hidden = outputs[:, -1]
            else:
                hidden = tf.reduce_mean(hidden, axis=1)
            if "loop" in parts:
                recurrent = tf.compat.v1.get_variable("recurrent", [width, width])
                # TensorFlow cannot capture a ref variable in a while loop: read it before.
                outside = None if use_resource else tf.identity(recurrent)
                _, hidden = tf.while_loop(
                    lambda i, h: i < 3,
                    lambda i, h: (i + 1, tf.nn.tanh(tf.matmul(
                        h, recurrent.read_value() if outside is None else outside))),
                    [tf.constant(0), hidden])
            if "batchnorm" in parts:
                norm = tf.keras.layers.BatchNormalization(name="bn")
                hidden = norm(hidden, training=phase)
                updates = list(norm.updates)
            if "cond" in parts:
                even = tf.compat.v1.get_variable("head_even", [width, width])
                odd = tf.compat.v1.get_variable("head_odd", [width, width])
                hidden = tf.cond(branch, lambda: tf.nn.relu(tf.matmul(hidden, even)),
                                 lambda: tf.nn.tanh(tf.matmul(hidden, odd)))
            output = tf.compat.v1.get_variable("output", [width, 1])
            loss = tf.reduce_mean(tf.square(tf.matmul(hidden, output) - 1.0))
            variables = tf.compat.v1.trainable_variables()
    model = _finish(graph, place, loss, variables, training, learning_rate, wrap_optimizer)
    if updates and model.train_op is not None:
        with graph.as_default():
            model.train_op = tf.group(model.train_op, *updates)
    model.feeds = lambda step: {phase: training, branch: step % 2 == 0}
    return model


def transformer_network(tokens, layers: int = 12, width: int = 256, heads: int = 4,
                        vocabulary: int = TRANSFORMER_VOCABULARY):
    """A BERT-style encoder (Keras layers) applied to ``tokens`` (a tensor or a
    ``tf.keras.Input``): the logits of the first position, and the trainable variables in
    the order the layers were made (embedding; per layer attention, two layer norms,
    feed-forward; the output layer). Many small tensors: 16 per layer."""
    import tensorflow as tf
    embedding = tf.keras.layers.Embedding(vocabulary, width)
    hidden = embedding(tokens)
    made = [embedding]
    for _ in range(layers):
        attention = tf.keras.layers.MultiHeadAttention(heads, width // heads)
        norms = [tf.keras.layers.LayerNormalization() for _ in range(2)]
        feed = [tf.keras.layers.Dense(4 * width, activation="gelu"),
                tf.keras.layers.Dense(width)]
        hidden = norms[0](hidden + attention(hidden, hidden))
        hidden = norms[1](hidden + feed[1](feed[0](hidden)))
        made.extend([attention] + norms + feed)
    output_layer = tf.keras.layers.Dense(vocabulary)
    logits = output_layer(hidden[:, 0])
    made.append(output_layer)
    return logits, [variable for layer in made for variable in layer.trainable_variables]


def transformer_model(batch: int = 8, layers: int = 12, width: int = 256, heads: int = 4,
                      sequence: int = TRANSFORMER_SEQUENCE,
                      vocabulary: int = TRANSFORMER_VOCABULARY,
                      worker_device: str = "/job:worker/task:0", training: bool = True,
                      learning_rate: float = 0.01, seed: int = 0,
                      wrap_optimizer=None) -> PsModel:
    """:func:`transformer_network` on synthetic tokens, for the AllReduce benchmarks.
    Parameters on ``worker_device``."""
    import tensorflow as tf
    graph = tf.Graph()
    with graph.as_default(), tf.compat.v1.device(worker_device):
        tf.compat.v1.set_random_seed(seed)
        tokens = tf.random.stateless_uniform([batch, sequence], seed=[seed, 1],
                                             maxval=vocabulary, dtype=tf.int32)
        output, variables = transformer_network(tokens, layers, width, heads, vocabulary)
        labels = tf.random.stateless_uniform([batch], seed=[seed, 2], maxval=vocabulary,
                                             dtype=tf.int32)
        loss = tf.reduce_mean(tf.keras.losses.sparse_categorical_crossentropy(
            labels, output, from_logits=True))
    return _finish(graph, worker_device, loss, variables, training, learning_rate,
                   wrap_optimizer)


def build_model(name: str, batch: int, num_ps: int, worker_device: str, training: bool,
                image_size: int = 224, width: int = 1024, seed: int = 0,
                wrap_optimizer=None) -> PsModel:
    """One of :data:`MODEL_NAMES`: ``seqN``/``parN`` with ``width``, a Keras application,
    or the transformer (``wrap_optimizer``: Keras models and the transformer)."""
    if name.startswith("seq") and name[3:].isdigit():
        return chain_model(int(name[3:]), width=width, batch=batch, num_ps=num_ps,
                           worker_device=worker_device, training=training, seed=seed)
    if name.startswith("par") and name[3:].isdigit():
        return parallel_model(int(name[3:]), width=width, batch=batch, num_ps=num_ps,
                              worker_device=worker_device, training=training, seed=seed)
    if name in KERAS_APPLICATIONS or name in CIFAR_MODELS:
        return keras_model(name, batch=batch, image_size=image_size, num_ps=num_ps,
                           worker_device=worker_device, training=training, seed=seed,
                           wrap_optimizer=wrap_optimizer)
    if name == "transformer":
        return transformer_model(batch=batch, worker_device=worker_device, training=training,
                                 seed=seed, wrap_optimizer=wrap_optimizer)
    raise ValueError(f"unknown model {name!r}; choose from {', '.join(MODEL_NAMES)}")
