"""The fleet-wide placement planner: plain Python, no Ray, no torch (lifecycle steps 1-4).

Its files, and how inputs flow through them into commands: lora_cache/planner/README.md.
"""

from lora_cache.planner.commands import Plan, WorkerCommands
from lora_cache.planner.config import PlannerConfig
from lora_cache.planner.errors import (
    PlannerInputError,
    UnknownAdapterError,
    UnknownReplicaError,
    UnknownWorkerError,
)
from lora_cache.planner.fleet_view import FleetView
from lora_cache.planner.planner import Planner
from lora_cache.planner.policies import POLICIES, PlacementPolicy
from lora_cache.planner.records import (
    AdapterInfo,
    Capacity,
    Hint,
    QueueEntry,
    ReplicaSpec,
    Residency,
    ResidencyEntry,
    SlotState,
)
from lora_cache.planner.replan import PlannerStats
from lora_cache.planner.view import ReplicaView, Target

__all__ = [
    "POLICIES",
    "AdapterInfo",
    "Capacity",
    "FleetView",
    "Hint",
    "PlacementPolicy",
    "Plan",
    "Planner",
    "PlannerConfig",
    "PlannerInputError",
    "PlannerStats",
    "QueueEntry",
    "ReplicaSpec",
    "ReplicaView",
    "Residency",
    "ResidencyEntry",
    "SlotState",
    "Target",
    "UnknownAdapterError",
    "UnknownReplicaError",
    "UnknownWorkerError",
    "WorkerCommands",
]
