"""How workers share their parameter servers' links, pulls and pushes in both directions:
the step that TensorFlow's default and TicTac's order can each reach (plain numbers).

Every link is full duplex: a PS task's pulls (PS to worker) and the gradients pushed to it
(worker to PS) use its two directions independently. With ``workers`` workers each pulling
and pushing every step, a PS task's link carries ``workers`` times one worker's bytes per
step in each direction, and a worker's own link carries all its pulls and pushes.

How the workers' phases line up decides what that costs:

- *Ordered (TicTac), lock step.* Ordered transfers leave every PS task in the same order
  for every worker, so the workers pull together, compute together and push together: a
  step is ``max(pulls, forward) + max(pushes, backward)``, the pulls under the forward
  pass and the pushes under the backward pass, each direction busy only in its own phase.
- *Default, lock step.* The same phases, but in a random order the forward pass cannot
  start before most of its parameters have arrived: ``pulls + forward + max(pushes,
  backward)``.
- *Default, drifted.* Where a PS link direction is busier per step than one worker's own
  step would take alone, queues form and the workers drift apart: one worker's pushes use
  the link's other direction while the others still pull. A worker's pull then shares the
  link with the others that happen to be pulling, each for the share of the step it
  spends pulling, and likewise its push: ``p = own_p + (workers - 1) * ps_p * p / T`` (its
  own pull time ``own_p``, one worker's time on the busiest PS link ``ps_p``), and a step
  ``T = p + forward + max(q, backward)``, solved for T; at least the busier direction's
  time. Ordering pulls the workers back into lock step, where each direction idles while
  the other works: there it can lose.

*Colocated layout* (``own_task``: a PS task on every worker's host, PS task i with worker
i, both behind the host's one link). A worker reaches its own host's PS task off the link;
each host's link carries, leaving it, its PS shard's pulls by the other ``workers - 1``
workers and its worker's pushes to the other shards, and, entering it, its worker's pulls
from the other shards and the other workers' pushes to its shard. In lock step the pulls
and the pushes take turns, so each phase loads a direction with one kind only: the pull
phase's busiest direction carries ``(workers - 1) * shard`` (leaving the busiest shard's
host) or a worker's pulls from the other shards (entering its host). Drifted, both kinds
load each direction at once: no step is shorter than the busiest direction's bytes of
both kinds per step, and a worker's pull is stretched by the others' load on the busiest
direction it crosses (the other pullers and the host's own worker's pushes leaving a PS
task's host, the others' pushes to its own shard entering its own).

*Ordered, colocated, training: the workers drift anyway.* There each host's link carries,
in the direction its shard's pulls leave by, its own worker's pushes too, in bursts as the
backward pass makes gradients. Nothing holds the workers together, so they drift apart, and
a worker's order then decides little about when its pulls arrive: its later pulls, released
late, meet other hosts' push bursts. Measured on the testbed (ResNet-50, blocks of 6 steps):
at 8 hosts the ordered steps after each block's lock-step first took the default's time
(1.00x), at 4 hosts the gain was gone by the sixth step. On dedicated PS hosts, where the
pushes use the other direction, the same order kept 4 workers on 4 PS tasks in step for
12-step blocks (1.23x at every step). So there the ordered step is predicted to be the
default's: ordering gains nothing.

TicTac's gain estimate steps aside where the default it would replace is the faster one.
"""
from __future__ import annotations

import dataclasses

__all__ = ["StepPrediction", "predict_steps", "predict_steps_for_compute", "FORWARD_SHARE",
           "ordered_workers_drift"]

#: a training step's forward pass, as a share of its compute, where nothing tells it: the
#: backward pass computes two products per forward one (input and weight gradients).
FORWARD_SHARE = 1 / 3


@dataclasses.dataclass(frozen=True)
class StepPrediction:
    """Predicted step seconds of each schedule, and the figures behind them."""

    ordered: float          # TicTac's order, workers in lock step
    default_lock: float     # TensorFlow's random order, workers in lock step
    default_drift: float    # TensorFlow's random order, workers drifted apart
    pull_seconds: float     # the busiest link's pull direction per step
    push_seconds: float     # the busiest link's push direction per step
    alone_seconds: float    # one worker's step with the links to itself
    workers: int
    link_seconds: float = 0.0   # the busiest link direction's bytes of every kind per step
    ordered_drifts: bool = False  # ordered workers drift too: ``ordered`` is the default's

    @property
    def saturated(self) -> bool:
        """A link direction is busier per step than a worker alone: the workers drift.

        Colocated, a direction's bytes of both kinds count (``link_seconds``), and only
        where they exceed a worker's own step: a balanced cluster without compute loads
        each direction exactly as much as a worker's own step, which lock step keeps busy
        all step long (pulls, then pushes)."""
        return (max(self.pull_seconds, self.push_seconds) >= self.alone_seconds
                or self.link_seconds > self.alone_seconds * (1 + 1e-9))

    @property
    def default(self) -> float:
        return self.default_drift if self.saturated else self.default_lock

    @property
    def gain(self) -> float:
        """The share of the default's step that ordering saves (negative: it loses)."""
        return (self.default - self.ordered) / self.default if self.default > 0 else 0.0

    def describe(self) -> str:
        phase = ("the workers drift apart (a PS link direction is busier than a worker's "
                 "own step)" if self.saturated else "the workers move in lock step")
        if self.ordered_drifts:
            phase += (", and ordered ones drift apart too (each host's link carries its "
                      "worker's pushes beside its shard's pulls), so the order gains nothing")
        workers = "one worker" if self.workers == 1 else f"{self.workers} workers"
        return (f"pulls {self.pull_seconds * 1e3:.3g} ms and pushes "
                f"{self.push_seconds * 1e3:.3g} ms per step on the busiest link direction "
                f"with {workers}, a worker alone {self.alone_seconds * 1e3:.3g} ms; "
                f"{phase}: default {self.default * 1e3:.3g} ms, ordered "
                f"{self.ordered * 1e3:.3g} ms")


def predict_steps(pull_bytes: dict[str, float], push_bytes: dict[str, float], workers: int,
                  bandwidth: float, forward_seconds: float, backward_seconds: float,
                  own_task: str | None = None) -> StepPrediction:
    """The step of each schedule for one worker that pulls ``pull_bytes[task]`` from and
    pushes ``push_bytes[task]`` to each PS task per step, ``workers`` workers alike, every
    link ``bandwidth`` bytes/s in each direction (the PS tasks' and the worker's own).

    ``own_task``: the colocated layout, every PS task on a worker's host and this one on
    this worker's (it may hold no variables: then it is in neither dict); its transfers
    cross no link."""
    if workers < 1 or bandwidth <= 0:
        raise ValueError(f"predict_steps needs workers >= 1 and bandwidth > 0, got "
                         f"{workers} and {bandwidth}")
    if own_task is not None:
        return _colocated_steps(pull_bytes, push_bytes, workers, bandwidth, forward_seconds,
                                backward_seconds, own_task)

    def busiest(per_task: dict[str, float], sharing: int) -> float:
        """The busier of the busiest PS link and the worker's own link, in seconds."""
        return max(sharing * max(per_task.values(), default=0.0),
                   sum(per_task.values())) / bandwidth

    pulls, pushes = busiest(pull_bytes, workers), busiest(push_bytes, workers)
    own_pulls, own_pushes = busiest(pull_bytes, 1), busiest(push_bytes, 1)
    alone = own_pulls + forward_seconds + max(own_pushes, backward_seconds)
    others = workers - 1
    drifted = _drifted_step(own_pulls, own_pushes,
                            others * max(pull_bytes.values(), default=0.0) / bandwidth,
                            others * max(push_bytes.values(), default=0.0) / bandwidth,
                            forward_seconds, backward_seconds)
    return StepPrediction(
        ordered=max(pulls, forward_seconds) + max(pushes, backward_seconds),
        default_lock=pulls + forward_seconds + max(pushes, backward_seconds),
        default_drift=max(pulls, pushes, drifted),
        pull_seconds=pulls, push_seconds=pushes, alone_seconds=alone, workers=workers,
        link_seconds=max(pulls, pushes))


def _colocated_steps(pull_bytes: dict[str, float], push_bytes: dict[str, float],
                     workers: int, bandwidth: float, forward: float, backward: float,
                     own_task: str) -> StepPrediction:
    """:func:`predict_steps` in the colocated layout (see the module's docstring)."""
    tasks = sorted(set(pull_bytes) | set(push_bytes) | {own_task})
    if len(tasks) > workers:
        raise ValueError(f"the colocated layout puts every PS task on a worker's host: "
                         f"{len(tasks)} PS tasks need as many workers, got {workers}")
    pull = {task: pull_bytes.get(task, 0.0) for task in tasks}
    push = {task: push_bytes.get(task, 0.0) for task in tasks}
    if len(tasks) < workers:      # hosts that run a worker only: no shard, no bytes of it
        pull[None] = push[None] = 0.0
    pulled, pushed = sum(pull.values()), sum(push.values())
    others = workers - 1
    # Leaving host k: its shard to the other workers, its worker's pushes to the other
    # shards; entering it: its worker's pulls from the other shards, the others' pushes.
    leaving_pulls = {k: others * pull[k] for k in pull}
    entering_pushes = {k: others * push[k] for k in push}
    entering_pulls = {k: pulled - pull[k] for k in pull}
    leaving_pushes = {k: pushed - push[k] for k in push}
    pulls = max(max(leaving_pulls.values()), max(entering_pulls.values())) / bandwidth
    pushes = max(max(entering_pushes.values()), max(leaving_pushes.values())) / bandwidth
    link = max(max(leaving_pulls[k] + leaving_pushes[k] for k in pull),
               max(entering_pulls[k] + entering_pushes[k] for k in pull)) / bandwidth
    own_pulls, own_pushes = entering_pulls[own_task] / bandwidth, leaving_pushes[own_task] / (
        bandwidth)
    alone = own_pulls + forward + max(own_pushes, backward)
    # The others' load on the busiest direction each of this worker's transfers crosses:
    # a pull leaves shard k's host (the other pullers, that host's worker's pushes) and
    # enters this host (the others' pushes to its shard); a push the other way round.
    remote = [k for k in tasks if k != own_task]
    others_pull = max([(others - 1) * pull[k] + leaving_pushes[k] for k in remote]
                      + [entering_pushes[own_task]]) / bandwidth
    others_push = max([(others - 1) * push[k] + entering_pulls[k] for k in remote]
                      + [leaving_pulls[own_task]]) / bandwidth
    drifted = _drifted_step(own_pulls, own_pushes, others_pull, others_push, forward,
                            backward)
    steps = StepPrediction(
        ordered=max(pulls, forward) + max(pushes, backward),
        default_lock=pulls + forward + max(pushes, backward),
        default_drift=max(link, drifted),
        pull_seconds=pulls, push_seconds=pushes, alone_seconds=alone, workers=workers,
        link_seconds=link)
    if ordered_workers_drift(workers, pushed > 0, colocated=True):
        steps = dataclasses.replace(steps, ordered=steps.default, ordered_drifts=True)
    return steps


def ordered_workers_drift(workers: int, training: bool, colocated: bool) -> bool:
    """Whether ordered workers drift apart as the default's do, so that ordering gains
    nothing: in training on the colocated layout, with others to drift from (see the
    module's docstring for what was measured)."""
    return colocated and training and workers > 1


def predict_steps_for_compute(pull_bytes: dict[str, float], push_bytes: dict[str, float],
                              workers: int, bandwidth: float, compute_seconds: float,
                              own_task: str | None = None) -> StepPrediction:
    """:func:`predict_steps` where only a step's whole compute is known: a step that pushes
    gradients (training) spends FORWARD_SHARE of it in the forward pass, one that does not
    (inference) all of it."""
    forward = compute_seconds * (FORWARD_SHARE if any(push_bytes.values()) else 1.0)
    return predict_steps(pull_bytes, push_bytes, workers, bandwidth, forward,
                         compute_seconds - forward, own_task)


def _drifted_step(own_pull: float, own_push: float, others_pull: float, others_push: float,
                  forward: float, backward: float) -> float:
    """The step T of drifted workers: T = p(T) + forward + max(q(T), backward), where a
    pull of ``own_pull`` seconds alone takes p = own_pull / (1 - others_pull / T) among
    the others' ``others_pull`` seconds per step on the busiest link direction it crosses
    (and a push likewise). The right side falls as T grows, so the one solution is found
    by bisection."""
    if not (own_pull or own_push or forward or backward):
        return 0.0

    def stretched(alone: float, others: float, step: float) -> float:
        return alone / (1.0 - others / step) if alone > 0 else 0.0

    def excess(step: float) -> float:
        return (stretched(own_pull, others_pull, step) + forward
                + max(stretched(own_push, others_push, step), backward) - step)

    low = max(others_pull, others_push)
    high = max(low, 1e-12) * 2 + own_pull + forward + max(own_push, backward)
    while excess(high) > 0:
        high *= 2
    low = max(low * (1 + 1e-12), 1e-15)
    for _ in range(100):
        middle = (low + high) / 2
        if excess(middle) > 0:
            low = middle
        else:
            high = middle
    return high
