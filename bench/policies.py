"""The benchmark's five policies, at equal GPU memory, as a registry (``--policies`` picks from it).

``pipelined`` is compared with ``overlap`` and ``ondemand`` (issue 21): overlap's rule, and a request whose
adapter's copy is issued on every rank (its read done) and due before a step's last layer at the rates the
rank measured (``LOADING``, ``workers.engine.admission.CopyClock``) joins the batch about to run, layer by
layer on the copy's chunks (issue 31: never a batch held at a chunk of a load not started, still reading, or
copying too slowly).
The simulator (``bench.sim``) ends such a step no sooner than its whole compute after it starts, nor than one
layer's compute after its last load is READY (``StepRecord.chunk_wait_ms``: how much later; 0 in every named
run). ``global`` keeps ``overlap``: pipelined is not yet never worse on every named run (bench/RESULTS.md).

A policy is what the fleet does about adapters, end to end: which placement policy the controller's
planner runs (``lora_cache.planner.POLICIES``), which admission rule the engines use
(``workers.engine.admission.ADMISSION``), whether the router sends prefetch hints, and whether every
adapter is resident before the clock starts (the oracle: an infinite cache, zero load cost).

=========  =========  =========  =====  ========================================================
name       planner    admission  hints  what it stands for
=========  =========  =========  =====  ========================================================
ondemand   none       ondemand   no     engines' default: a step blocks on a cold adapter; LRU
overlap    none       overlap    no     SGLang's overlap loading: loads run beside ready requests
queue      queue      overlap    no     S-LoRA: each replica prefetches its own waiting queue
global     global     overlap    yes    lora-cache: queue + router hints + fleet-wide popularity
oracle     none       overlap    no     every adapter resident from the start (slots = adapters)
pipelined  none       pipelined  no     overlap; requests on issued copies join the batch, per layer
=========  =========  =========  =====  ========================================================
"""

from __future__ import annotations

from dataclasses import dataclass

from lora_cache.errors import ConfigError


@dataclass(frozen=True)
class BenchPolicy:
    name: str
    planner: str  # lora_cache.planner.POLICIES key
    admission: str  # workers.engine.admission.ADMISSION key
    hints: bool  # the router sends a prefetch hint ahead of each request
    oracle: bool = False  # all adapters resident before the clock starts; slots sized to hold them all


BENCH_POLICIES: dict[str, BenchPolicy] = {p.name: p for p in (
    BenchPolicy("ondemand", planner="none", admission="ondemand", hints=False),
    BenchPolicy("overlap", planner="none", admission="overlap", hints=False),
    BenchPolicy("queue", planner="queue", admission="overlap", hints=False),
    BenchPolicy("global", planner="global", admission="overlap", hints=True),
    BenchPolicy("oracle", planner="none", admission="overlap", hints=False, oracle=True),
    BenchPolicy("pipelined", planner="none", admission="pipelined", hints=False),
)}


def parse_policies(text: str) -> tuple[BenchPolicy, ...]:
    """``"ondemand,global"`` (or ``"all"``) -> the registered policies, in the given order."""
    names = list(BENCH_POLICIES) if text.strip() == "all" else [n.strip() for n in text.split(",") if n.strip()]
    if not names:
        raise ConfigError(f"policies: none given in {text!r}; pass a comma list of {', '.join(BENCH_POLICIES)} "
                          "or 'all'")
    unknown = [n for n in names if n not in BENCH_POLICIES]
    if unknown:
        raise ConfigError(f"policies: {unknown} not registered; choose from {', '.join(BENCH_POLICIES)} or 'all'")
    if len(set(names)) != len(names):
        raise ConfigError(f"policies: {text!r} names a policy twice; list each once")
    return tuple(BENCH_POLICIES[n] for n in names)
