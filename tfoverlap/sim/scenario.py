"""What a what-if simulation is asked (a Scenario) and what it answers (a Prediction)."""
from __future__ import annotations

import dataclasses

from tfoverlap.options import parse_options

__all__ = ["Scenario", "Prediction", "SimulationError", "ALONE", "LOCK_STEP", "DRIFTED",
           "DEDICATED", "COLOCATED", "LAYOUTS"]

#: how the workers' phases line up in a PS simulation (see tfoverlap.sim.ps): one worker
#: alone, every worker moving data in the same direction at once, or drifted apart.
ALONE, LOCK_STEP, DRIFTED = "alone", "lock step", "drifted"

#: where a PS cluster's tasks run (tfoverlap.testbed.cluster.LAYOUTS): every PS task and
#: every worker on a host of its own, or PS task i on worker i's host, sharing its link.
DEDICATED, COLOCATED = "dedicated", "colocated"
LAYOUTS = (DEDICATED, COLOCATED)


class SimulationError(ValueError):
    """The graph or the scenario cannot be simulated (no parameters, bad option, ...)."""


@dataclasses.dataclass(frozen=True)
class Scenario:
    workers: int = 2
    bandwidth: float = 312.5e6     # bytes/s per link and direction
    latency: float = 100e-6        # seconds per transfer message
    threads: int = 2               # a worker's inter-op threads
    window: int = 2                # release groups in flight (the TicTac option)
    credit: float | str = "auto"   # bytes per release group (the TicTac option)
    seeds: int = 16
    ps_devices: str = "/job:ps"
    ps_tasks: int = 0              # > 0: spread the variables over this many PS tasks
    chunk_bytes: float = 16e6      # see simulator.Problem.chunk_bytes (fitted: docs)
    layout: str = DEDICATED        # COLOCATED: PS task i runs on worker i's host (LAYOUTS)

    def validate(self) -> None:
        if self.workers < 1:
            raise SimulationError(f"workers must be >= 1, got {self.workers}")
        if not self.bandwidth > 0 or self.bandwidth == float("inf"):
            raise SimulationError(f"bandwidth must be positive, got {self.bandwidth}")
        if self.latency < 0:
            raise SimulationError(f"latency must be >= 0, got {self.latency}")
        if self.threads < 1 or self.window < 1 or self.seeds < 1:
            raise SimulationError("threads, window and seeds must be >= 1")
        if not self.chunk_bytes > 0:
            raise SimulationError(f"chunk size must be positive, got {self.chunk_bytes}")
        try:
            parse_options({"window": self.window, "credit": self.credit})
        except ValueError as error:
            raise SimulationError(str(error)) from None
        if self.ps_tasks < 0:
            raise SimulationError(f"ps tasks must be >= 1 (0: as placed), got {self.ps_tasks}")
        if self.layout not in LAYOUTS:
            raise SimulationError(f"unknown layout {self.layout!r}; choose from "
                                  f"{', '.join(LAYOUTS)}")
        if self.layout == COLOCATED and self.ps_tasks > self.workers:
            raise SimulationError(f"the colocated layout puts PS task i on worker i's host: "
                                  f"{self.ps_tasks} PS tasks need as many workers, got "
                                  f"{self.workers}")


@dataclasses.dataclass
class Prediction:
    algorithm: str
    iteration: float       # predicted seconds
    comm: float            # the same iteration with zero compute
    comp: float            # the same iteration with free transfers
    lower: float           # no schedule can beat this
    upper: float           # serial sum
    transfers: int
    phase: str = ""        # PS graphs: the workers' phases assumed (ALONE, LOCK_STEP, DRIFTED)

    @property
    def efficiency(self) -> float:
        upper, lower = self.comm + self.comp, max(self.comm, self.comp)
        return float("nan") if upper == lower else (upper - self.iteration) / (upper - lower)
