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

TicTac's gain estimate steps aside where the default it would replace is the faster one.
"""
from __future__ import annotations

import dataclasses

__all__ = ["StepPrediction", "predict_steps", "predict_steps_for_compute", "FORWARD_SHARE"]

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

    @property
    def saturated(self) -> bool:
        """A link direction is busier per step than a worker alone: the workers drift."""
        return max(self.pull_seconds, self.push_seconds) >= self.alone_seconds

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
        workers = "one worker" if self.workers == 1 else f"{self.workers} workers"
        return (f"pulls {self.pull_seconds * 1e3:.3g} ms and pushes "
                f"{self.push_seconds * 1e3:.3g} ms per step on the busiest link direction "
                f"with {workers}, a worker alone {self.alone_seconds * 1e3:.3g} ms; "
                f"{phase}: default {self.default * 1e3:.3g} ms, ordered "
                f"{self.ordered * 1e3:.3g} ms")


def predict_steps(pull_bytes: dict[str, float], push_bytes: dict[str, float], workers: int,
                  bandwidth: float, forward_seconds: float, backward_seconds: float
                  ) -> StepPrediction:
    """The step of each schedule for one worker that pulls ``pull_bytes[task]`` from and
    pushes ``push_bytes[task]`` to each PS task per step, ``workers`` workers alike, every
    link ``bandwidth`` bytes/s in each direction (the PS tasks' and the worker's own)."""
    if workers < 1 or bandwidth <= 0:
        raise ValueError(f"predict_steps needs workers >= 1 and bandwidth > 0, got "
                         f"{workers} and {bandwidth}")

    def busiest(per_task: dict[str, float], sharing: int) -> float:
        """The busier of the busiest PS link and the worker's own link, in seconds."""
        return max(sharing * max(per_task.values(), default=0.0),
                   sum(per_task.values())) / bandwidth

    pulls, pushes = busiest(pull_bytes, workers), busiest(push_bytes, workers)
    own_pulls, own_pushes = busiest(pull_bytes, 1), busiest(push_bytes, 1)
    alone = own_pulls + forward_seconds + max(own_pushes, backward_seconds)
    drifted = _drifted_step(own_pulls, own_pushes,
                            max(pull_bytes.values(), default=0.0) / bandwidth,
                            max(push_bytes.values(), default=0.0) / bandwidth,
                            workers, forward_seconds, backward_seconds)
    return StepPrediction(
        ordered=max(pulls, forward_seconds) + max(pushes, backward_seconds),
        default_lock=pulls + forward_seconds + max(pushes, backward_seconds),
        default_drift=max(pulls, pushes, drifted),
        pull_seconds=pulls, push_seconds=pushes, alone_seconds=alone, workers=workers)


def predict_steps_for_compute(pull_bytes: dict[str, float], push_bytes: dict[str, float],
                              workers: int, bandwidth: float, compute_seconds: float
                              ) -> StepPrediction:
    """:func:`predict_steps` where only a step's whole compute is known: a step that pushes
    gradients (training) spends FORWARD_SHARE of it in the forward pass, one that does not
    (inference) all of it."""
    forward = compute_seconds * (FORWARD_SHARE if any(push_bytes.values()) else 1.0)
    return predict_steps(pull_bytes, push_bytes, workers, bandwidth, forward,
                         compute_seconds - forward)


def _drifted_step(own_pull: float, own_push: float, ps_pull: float, ps_push: float,
                  workers: int, forward: float, backward: float) -> float:
    """The step T of drifted workers: T = p(T) + forward + max(q(T), backward), where a
    pull of ``own_pull`` seconds alone takes p = own_pull / (1 - (workers-1) ps_pull / T)
    among the others' pulls (and a push likewise). The right side falls as T grows, so
    the one solution is found by bisection."""
    if not (own_pull or own_push or forward or backward):
        return 0.0
    others = workers - 1

    def stretched(alone: float, share: float, step: float) -> float:
        return alone / (1.0 - others * share / step) if alone > 0 else 0.0

    def excess(step: float) -> float:
        return (stretched(own_pull, ps_pull, step) + forward
                + max(stretched(own_push, ps_push, step), backward) - step)

    low = others * max(ps_pull, ps_push)
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
