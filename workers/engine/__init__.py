"""The reference engine: a TP replica running LoRA-augmented layers over the worker cache's slots.

Its files, and how a round flows through them: workers/engine/README.md.
"""

from workers.attach.versions import Readiness
from workers.engine.admission import ADMISSION, AdmissionRule, register_admission
from workers.engine.config import EngineConfig
from workers.engine.engine import EngineResult, run_engine
from workers.engine.timings import RequestRecord, format_summary, summarize
from workers.engine.workload import Request, WorkloadConfig, make_requests

__all__ = ["ADMISSION", "AdmissionRule", "EngineConfig", "EngineResult", "Readiness", "Request", "RequestRecord",
           "WorkloadConfig", "format_summary", "make_requests", "register_admission", "run_engine", "summarize"]
