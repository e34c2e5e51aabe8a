"""The reference engine: a TP replica running LoRA-augmented layers over the worker cache's slots.

Module map: ``config`` (EngineConfig), ``workload`` (requests), ``admission`` (rules, registry),
``batching`` (rank 0's scheduler), ``model`` (one rank's layers), ``lora`` (slot tables, the kernels),
``tp`` (processes and collectives), ``rank`` (one rank's step), ``engine`` (the loop, ``run_engine``),
``timings`` (records, bench_serving summary).
"""

from workers.engine.admission import ADMISSION, AdmissionRule, Readiness, register_admission
from workers.engine.config import EngineConfig
from workers.engine.engine import EngineResult, run_engine
from workers.engine.timings import RequestRecord, format_summary, summarize
from workers.engine.workload import Request, WorkloadConfig, make_requests

__all__ = ["ADMISSION", "AdmissionRule", "EngineConfig", "EngineResult", "Readiness", "Request", "RequestRecord",
           "WorkloadConfig", "format_summary", "make_requests", "register_admission", "run_engine", "summarize"]
