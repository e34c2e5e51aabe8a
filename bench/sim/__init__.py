"""``--engine sim``: a deterministic discrete-event simulation of the fleet, running the real planner,
controller core, scheduler, admission rules and slot bookkeeping with costs from a calibration.

Modules: ``events`` (simulated time), ``calibration`` (costs, JSON files, fitting from real logs),
``worker`` (one rank's cache), ``replica`` (the engine loop), ``controller`` (the controller actor's
event handling), ``fleet`` (router, assembly, results), ``job`` (the benchmark job's ``--engine sim`` path),
``check`` (the simulator against a real run), ``measure`` (the CPU calibration), ``scale`` (speed at fleet
scale). bench/sim/README.md says what is real, what is simulated, and what it found.
"""

from bench.sim.calibration import Calibration, fit_calibration, load_calibration
from bench.sim.fleet import ROUTERS, SimConfig, SimResult, simulate
from bench.sim.replica import StepRecord
from bench.sim.worker import LoadRecord

__all__ = ["ROUTERS", "Calibration", "LoadRecord", "SimConfig", "SimResult", "StepRecord", "fit_calibration",
           "load_calibration", "simulate"]
