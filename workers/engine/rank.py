"""One TP rank of a replica: its worker cache, model shard, KV cache and LoRA op; runs the planned steps.

Every rank runs the same plan (rank 0 schedules). A step: ``acquire`` the batch's adapters (and the running
requests', so a load never evicts them), start the plan's prefetches, run the layers on the compute stream,
``release`` (lifecycle step 9), then wait for the step's tokens like an engine that samples them.
"""

from __future__ import annotations

import contextlib
import hashlib
import time
from collections.abc import Mapping
from concurrent.futures import FIRST_COMPLETED, Future, wait
from dataclasses import dataclass, field
from typing import Any, NamedTuple

import torch

from lora_cache.adapters.catalog import AdapterCatalog
from lora_cache.adapters.peft import KnownVersion
from lora_cache.adapters.refs import base_name
from lora_cache.errors import CapacityError, ConfigError, LoraCacheError
from lora_cache.runtime import heap
from lora_cache.vocab import AdapterKey, ReadinessRecord
from workers.attach.seam import EngineCache
from workers.attach.versions import RankVersions
from workers.cache import WorkerCache, WorkerConfig
from workers.engine.admission import ADMISSION, CopyClock
from workers.engine.arrivals import Arrivals
from workers.engine.catalog import load_catalog
from workers.engine.config import EngineConfig
from workers.engine.graphs import DecodeGraphs
from workers.engine.kv_rows import borrowed_rows, kv_report, plan_adapters
from workers.engine.lora import LoraOp
from workers.engine.model import KVCache, KVStore, Rope, ShardedModel, StepInputs, build_model, prompt_states
from workers.engine.releases import Releases
from workers.engine.scheduler import PREFILL, WAIT, Item, StepPlan
from workers.engine.tp import Comm
from workers.gpu.acquire import AdapterRef, Batch, resolve
from workers.gpu.chunk_waits import ChunkWaits


def _key_or_none(catalog: AdapterCatalog, ref: AdapterRef) -> AdapterKey | None:
    try:
        return resolve(catalog, ref)
    except LoraCacheError:
        return None


# one-prompt prefill lengths run at warm-up: 1, odd and multiple-of-16 lengths in every token tile size
WARM_PROMPTS = (1, 7, 16, 31, 32, 48, 63, 64, 65, 127, 128, 255, 256, 500, 1024)
ISSUE_POLL_S = 5e-4  # a waiting engine whose rule runs LOADING adapters looks for issued copies this often


class StepAudit(NamedTuple):
    """What one step computed with on this rank (``EngineConfig.audit_steps``): per item, in the step's
    order, the adapter version it acquired, and a digest of each such slot's bytes while the step held it."""

    kind: str
    rids: tuple[int, ...]
    keys: tuple[str, ...]  # "name@version" per item ("" for the base model, "!" + ref if not held here)
    digests: dict[str, str]  # "name@version" -> blake2b of the slot's shard bytes (see ``slot_digest``)


def slot_digest(pool_row: torch.Tensor) -> str:
    """A digest of a shard's bytes (a slot's first ``layout.numel`` elements, or a staged shard)."""
    return hashlib.blake2b(pool_row.detach().contiguous().cpu().view(torch.uint8).numpy().tobytes(),
                           digest_size=16).hexdigest()


class StepResult(NamedTuple):
    start_s: float  # perf_counter when the step began
    end_s: float  # perf_counter when its tokens were ready
    load_wait_s: float  # of it, blocked in acquire on adapters not ready on this rank
    outputs: dict[int, torch.Tensor] | None  # rid -> output hidden state (record_outputs)


class StepLog(NamedTuple):
    """One executed step, for calibrating the simulator (``bench.sim``): its shape and wall time."""

    kind: str  # prefill or decode
    items: int  # requests in the step
    tokens: int  # tokens computed (prompt tokens in a prefill, one per request in a decode)
    adapters: int  # distinct adapters among the items
    ms: float  # start to tokens ready, including any wait on a load
    load_wait_ms: float  # of it, blocked in acquire on loads
    gap_ms: float | None  # the previous step's end to this one's start, rounds back to back (None: a WAIT
    # round or none before): the engine loop's host work between steps (scheduling, reports, readiness)
    readiness_ms: float  # of the gap, in the readiness exchange (0: the admission rule does not prefetch)
    wall_s: float  # time.time() at its start: to line steps up with loads (ReadinessRecord times) across ranks
    gc_ms: float = 0.0  # of ``ms``, stopped for the cyclic garbage collector (lora_cache/runtime/heap.py)


@dataclass
class RankStats:
    """What one rank saw; ``unready_items`` counts items run while their adapter was not READY here."""

    rank: int
    steps: int = 0
    prefill_steps: int = 0
    unready_items: int = 0
    cache: dict[str, Any] = field(default_factory=dict)  # WorkerCache.stats() at the end
    gc: dict[str, float] = field(default_factory=dict)  # heap.Pauses.summary() over the engine's life
    step_log: list[StepLog] = field(default_factory=list)
    audit: list[StepAudit] = field(default_factory=list)  # per step, if the config audits steps
    kv: dict[str, Any] = field(default_factory=dict)  # borrowed KV rows (``BorrowedRows.summary``), if any


class RankEngine:
    """Everything one TP rank owns."""

    def __init__(self, config: EngineConfig, comm: Comm, cache: EngineCache | None = None,
                 known: Mapping[str, KnownVersion] | None = None) -> None:
        """``cache``: run over an existing rank's cache (a worker actor's ``WorkerCache``, or an attached
        process's ``Attachment``, the public seam; the controller drives either) and its catalog and compute
        stream; None: make one from ``config``, its catalog taking the driver's ``known`` versions."""
        self.config, self.comm = config, comm
        self.owns_cache = cache is None
        if cache is None:
            cuda = config.device_kind() == "cuda"
            self.device = torch.device("cuda", comm.rank) if cuda else torch.device("cpu")
            self.dtype = config.torch_dtype()
            self.stream: Any = torch.cuda.Stream(self.device) if cuda else None  # the compute stream
            self.catalog = load_catalog(config, known)
            self.cache: EngineCache = self._make_cache()
        else:
            self.device, self.dtype, self.catalog, self.cache = cache.device, cache.dtype, cache.catalog, cache
            self.stream = getattr(cache.streams, "compute_stream", None)
            if cache.worker.max_batch < config.max_running + config.max_adapters:
                raise ConfigError(f"the worker cache's max_batch ({cache.worker.max_batch}) is below the engine's "
                                  f"max_running + max_adapters ({config.max_running + config.max_adapters}); "
                                  "start the workers with a larger max_batch")
            if cache.worker.tp != config.tp or cache.worker.tp_rank != comm.rank:
                raise ConfigError(f"engine TP {config.tp} rank {comm.rank} does not match its worker cache's "
                                  f"TP {cache.worker.tp} rank {cache.worker.tp_rank}; start the engine on the "
                                  "replica's own workers, rank k on worker k")
        rule = ADMISSION[config.admission]
        self.pipelined = rule.pipelined  # steps wait per layer on chunks of loads
        self.prefetching = rule.prefetch  # loads for waiting requests start before admission (``arrived`` too)
        self.loading = rule.loading or rule.idle  # the rule reads LOADING: copies issued are reported too
        self._names_generation = self.catalog.generation  # rank 0: the catalog generation its names were read at
        self.versions = RankVersions(self.catalog, self.catalog.names())  # this rank's part of the version exchange
        self.lora = LoraOp(self.cache, max(config.max_prefill_tokens, config.max_running), config.max_running)
        self.pad_row = config.kv_rows or config.max_running  # one past the own KV rows: the graphs' padding
        with self._on_stream():
            self.kv_lend = borrowed_rows(config, self.cache, self.device)  # kv_rows: the KV cache in the pool
            self.model = self._make_model()
            self.last = torch.zeros(config.max_running + 1, self.model.shape.hidden_size, dtype=self.dtype,
                                    device=self.device)  # each KV row's last output: its request's next input
        self.graphs = (DecodeGraphs(self.model, self.lora, self.last, self.stream, max_running=config.max_running,
                                    max_seq_len=config.max_seq_len, kv_block=config.graph_kv_block,
                                    pad_row=self.pad_row)
                       if config.cuda_graphs and self.stream is not None else None)
        self._sync()
        self.stats = RankStats(comm.rank)
        self._pinned: Batch | None = None  # adapters kept resident for admission (overlap): READY, held
        self._loads: dict[AdapterRef, Future[ReadinessRecord]] = {}  # last prefetch per adapter (failures: once)
        # pipelined: this rank's measured copies (its prefetches' records) and steps; a copy issued here is
        # reported LOADING only if it lands before a step's last layer (``CopyClock``)
        self.clock = CopyClock(config.layers)
        self._clocked: dict[AdapterRef, Future[ReadinessRecord]] = {}  # the load last measured, per adapter
        self._step_failed: set[str] = set()  # adapters the last step could not hold here (reported next round)
        self._last_end: float | None = None  # perf_counter at the last step's end (None: a WAIT round since)
        self._readiness_s = 0.0  # time in readiness() since the last step
        # rank 0 of a streaming run: adapters pinned or loaded as requests arrive (the feed's thread)
        self.arrivals = Arrivals(self.cache, self.catalog, lambda: self.versions.index, config.num_slots,
                                 self.prefetching)
        self.pauses = heap.Pauses()  # the collector's stalls, per step in the log (stopped by close)
        self.pauses.start()
        self.releases = Releases(self.catalog, comm.rank, comm.world, lambda name: self.versions.named_versions(name))

    def _make_cache(self) -> WorkerCache:
        c = self.config
        worker = WorkerConfig(num_slots=c.num_slots, page_rank=c.page_rank, pool_pages=c.pool_pages, tp=c.tp,
                              tp_rank=self.comm.rank,
                              dtype=str(self.dtype).removeprefix("torch."), device=str(self.device),
                              max_batch=c.max_running + c.max_adapters, host=c.host, chunk_bytes=c.chunk_bytes)
        cache = WorkerCache(worker, self.catalog, compute_stream=self.stream)
        per_adapter = cache.load_path.pages_for(cache.slot_numel)  # the pages of an adapter of max_rank
        if cache.book.table.num_pages < c.max_adapters * per_adapter:
            cache.close()
            raise ConfigError(f"pool_pages {cache.book.table.num_pages} cannot hold a batch's max_adapters "
                              f"({c.max_adapters}) adapters of rank {self.catalog.config.max_rank} ({per_adapter} "
                              f"pages each): give pool_pages >= {c.max_adapters * per_adapter} or lower max_adapters")
        return cache

    def _make_model(self) -> ShardedModel:
        c, shape = self.config, self.config.shape()
        kv: KVStore = (self.kv_lend.kv if self.kv_lend is not None else
                       KVCache(c.layers, self.pad_row + 1, shape.num_kv_heads // c.tp, c.max_seq_len,
                               shape.head_dim, self.dtype, self.device))
        rope = Rope(shape.head_dim, c.max_seq_len, c.rope_theta, self.device) if c.rope else None
        return build_model(shape, c.layers, tp=c.tp, rank=self.comm.rank, seed=c.seed, share=c.share_weights,
                           dtype=self.dtype, device=self.device, kv=kv, lora=self.lora,
                           all_reduce=self.comm.all_reduce, rope=rope)

    # -- the version exchange's names (every rank the same, in the same order) --------------------------------
    @property
    def names(self) -> list[str]:
        """The adapters of the version exchange, in its rows' order: the catalog's at build (rank 0's: ``adopt``),
        then those rank 0 added at run time (``add_names``)."""
        return self.versions.names

    @property
    def index(self) -> dict[str, int]:
        return self.versions.index  # replaced whole on a change: safe to read from the feed's thread

    def adopt(self, names: list[str]) -> None:
        """Start the exchange over rank 0's names (a rank whose catalog differed at build: a registration on its
        way); every rank calls this at once, before the first round."""
        if names != self.versions.names:
            versions = RankVersions(self.catalog, ())
            versions.append(names)  # those this catalog lacks yet report PENDING (their requests wait), not FAILED
            self.versions = versions

    def new_names(self) -> tuple[str, ...]:
        """Rank 0: the names its catalog registered that the exchange lacks (sorted), read only when the catalog
        changed; the round's plan carries them to every rank (``StepPlan.names``)."""
        generation = self.catalog.generation
        if generation == self._names_generation:
            return ()
        self._names_generation = generation
        index = self.versions.index
        return tuple(n for n in self.catalog.names() if n not in index)

    def add_names(self, names: tuple[str, ...], dropped: tuple[str, ...] = (), retired: tuple[str, ...] = ()) -> None:
        """Drop the round's idle named rows, append its new names, retire what rank 0 retired (rank 0's plan's: the
        rows kept while named, ``releases.py``), on every rank before the next exchange."""
        self.releases.release(retired)
        self.versions.drop(dropped)
        if names:
            self.versions.append(names)
        for name in sorted({base_name(ref) for ref in dropped}):  # their versions retire unless kept otherwise
            self.catalog.trim(name)

    # -- readiness and versions (every round) -------------------------------------------------------------
    def readiness(self, wanted: tuple[AdapterRef, ...]) -> torch.Tensor:
        """Pin the wanted adapters READY here, report every READY version: this rank's rows of the version
        exchange (``workers.attach.versions``), reduced over the ranks by the caller.

        The wanted ones stay READY until the step that uses them (pinned). Others READY now (e.g. a new
        arrival's, prefetched by the controller) are reported too, so a request is not held back a
        round for its adapter not being wanted yet; should one be evicted before the step acquires it,
        the acquire loads it again (that very version) and the step counts the wait."""
        start = time.perf_counter()
        try:
            return kv_report(self._readiness(wanted), self.kv_lend)
        finally:
            self._readiness_s += time.perf_counter() - start

    def _readiness(self, wanted: tuple[AdapterRef, ...]) -> torch.Tensor:
        if wanted or self._pinned is not None:
            self.pin(wanted)  # pinned: READY until the step (may have turned READY just now)
        failed: list[str] = []
        for ref, load in list(self._loads.items()):
            if load.done() and (error := load.exception()) is not None:
                # no room right now (every slot held, or the host tier full of loads in flight) is not the
                # adapter's failure: it stays wanted and is prefetched again next round
                if not isinstance(error, CapacityError):
                    failed += _row_names(ref)
                del self._loads[ref]
            elif self.loading and load.done() and self._clocked.get(ref) is not load:
                self._clocked[ref] = load
                record = load.result()  # a finished copy: its bytes, its events' time, seen READY now
                self.clock.copied(record.nbytes, record.h2d_ms / 1e3, time.perf_counter())
        # LOADING: the copies issued here that land before a step's last layer, at the measured rates
        issued = self.clock.in_time(self.cache.issued_copies(), time.perf_counter()) if self.loading else ()
        # what this report offers for admission stays here until the round's plan holds it (``execute``): an older
        # version evicted meanwhile may retire, and a request admitted on it would fail on this rank
        rows = self.versions.rows(self.cache.ready_keys(fence=True), failed, self._step_failed, issued)
        self._step_failed = set()
        return rows

    def pin(self, wanted: tuple[AdapterRef, ...]) -> list[AdapterRef]:
        """Hold the wanted adapters that are READY here (held, they stay READY); returns them."""
        pinned = self.cache.acquire_ready(wanted)  # atomic: nothing is evicted between check and hold
        if self._pinned is not None:
            self.cache.release(self._pinned)
        self._pinned = pinned
        return list(pinned.adapters) if pinned is not None else []

    def unpin(self) -> None:
        if self._pinned is not None:
            self.cache.release(self._pinned)
            self._pinned = None

    # -- one round ---------------------------------------------------------------------------------------
    def execute(self, plan: StepPlan, arrival: Future[None] | None = None) -> StepResult | None:
        """``arrival`` (rank 0 of a streaming run): done when a request is submitted; it ends a WAIT."""
        if plan.wanted or self._pinned is not None:
            self.pin(plan.wanted)  # what the prefetches below may not evict
        self.cache.unfence()  # the report's fence: the plan's running versions are pinned (``Scheduler._wanted``)
        self.arrivals.release_taken(plan.wanted)  # the round's pins hold the taken arrivals' adapters it wants
        if self.kv_lend is not None:  # borrowed KV rows to the plan's count, before the step that may run in them
            with self._on_stream():
                self.kv_lend.adjust(plan.kv_rows, plan_adapters(plan))
        if plan.kind == WAIT:
            self._prefetch(plan.prefetch)
            self._wait(plan, arrival)
            self._last_end, self._readiness_s = None, 0.0  # the next step's gap is not back to back
            return None
        return self._step(plan)

    def _prefetch(self, refs: tuple[AdapterRef, ...]) -> None:
        for ref in refs:
            try:
                key = resolve(self.catalog, ref)
                self._loads[ref] = self.cache.prefetch(key.name, key.version)
            except LoraCacheError as e:  # e.g. the host tier is full of staged shards right now
                failed: Future[ReadinessRecord] = Future()
                failed.set_exception(e)
                self._loads[ref] = failed

    def _wait(self, plan: StepPlan, arrival: Future[None] | None = None) -> None:
        """Until a load of a held-back adapter finishes here, or the next arrival (the plan's timeout, or a
        request submitted: ``arrival``).

        Loads already done here are skipped: this rank then returns at once and the next round's
        collective waits for the others, so no rank spins while another is still loading. In a streaming
        run the ranks without the feed do not sleep for arrivals either: only rank 0 sees them.
        """
        loads = [f for a in plan.wait_for if (f := self._loads.get(a)) is not None and not f.done()]
        timeout = None if plan.timeout_s is None else max(0.0, plan.timeout_s)
        woken: list[Future[Any]] = [arrival] if arrival is not None else []
        if loads and self.loading:  # a rule that runs LOADING adapters wakes once a copy is issued here
            self._wait_issued(plan, [*loads, *woken], timeout)
        elif loads:
            wait([*loads, *woken], timeout=timeout, return_when=FIRST_COMPLETED)
        elif not plan.wait_for:  # nothing loading: the next arrival
            if woken:
                wait(woken, timeout=1e-3 if timeout is None else timeout)
            elif not plan.streaming:
                time.sleep(1e-3 if timeout is None else timeout)
        elif self.cache.ready_keys().isdisjoint(_key_or_none(self.catalog, a) for a in plan.wait_for):
            # nothing loading for them here (a prefetch refused for room, a failed load): poll, never spin
            time.sleep(min(1e-3, timeout) if timeout is not None else 1e-3)

    def _wait_issued(self, plan: StepPlan, futures: list[Future[Any]], timeout: float | None) -> None:
        """Until a future is done (a load READY, an arrival), the timeout, or a held-back adapter's copy is
        issued here (its read done: LOADING, which the next round may run on its chunks); polled every
        ``ISSUE_POLL_S``, as the simulator wakes at the copy's issue (``bench.sim.replica``)."""
        keys = {k for a in plan.wait_for if (k := _key_or_none(self.catalog, a)) is not None}
        keys -= self.cache.issued_keys()  # issued here already (another rank is behind): wait for READY
        if not keys:
            wait(futures, timeout=timeout, return_when=FIRST_COMPLETED)
            return
        deadline = None if timeout is None else time.perf_counter() + timeout
        while keys.isdisjoint(self.cache.issued_keys()):
            left = ISSUE_POLL_S if deadline is None else min(ISSUE_POLL_S, deadline - time.perf_counter())
            if left <= 0:
                return
            done, _ = wait(futures, timeout=left, return_when=FIRST_COMPLETED)
            if done:
                return

    def _step(self, plan: StepPlan) -> StepResult:
        wall, start, gc_ms = time.time(), time.perf_counter(), self.pauses.total_ms
        named = [it.ref for it in plan.items if it.ref is not None]
        ready = self.cache.ready_keys()
        unready = {ref for ref in named if _key_or_none(self.catalog, ref) not in ready}
        # exactly the admitted versions; one this rank cannot hold fails its requests, never another version
        batch = (self.cache.acquire(named + list(plan.hold), partial=True, pipelined=self.pipelined)
                 if named or plan.hold else None)
        load_wait = time.perf_counter() - start if unready else 0.0
        self._prefetch(plan.prefetch)  # after acquire: a load cannot evict what this step holds
        slot_of = dict(zip(batch.adapters, batch.slots)) if batch is not None else {}
        if batch is not None and batch.failed:
            self._step_failed |= {n for ref, _ in batch.failed for n in _row_names(ref)}
        items = list(plan.items)  # rank 0's order on every rank: the all-reduce adds row i to row i
        with self._on_stream():
            out = self._forward(plan.kind == PREFILL, items, slot_of, batch.waits if batch is not None else None)
            if batch is not None and batch.waits is not None:
                batch.waits.finish()  # the adapters are whole after the step: before any decode graph
            if self.config.audit_steps:  # after finish: every chunk of what the step read has landed
                self.stats.audit.append(self._audit(plan.kind, items, batch))
            if batch is not None:
                self.cache.release(batch)
            outputs = ({it.rid: row for it, row in zip(items, out.float().cpu())}
                       if self.config.record_outputs else None)
        self._sync()
        end = time.perf_counter()
        if self.loading and not load_wait:  # a step's compute, measured (``CopyClock``)
            self.clock.stepped(end - start)
        self.stats.steps += 1
        self.stats.prefill_steps += plan.kind == PREFILL
        self.stats.unready_items += sum(it.ref in unready for it in plan.items)
        gap = None if self._last_end is None else (start - self._last_end) * 1e3
        self.stats.step_log.append(StepLog(plan.kind, len(items), sum(it.length for it in items), len(set(named)),
                                           (end - start) * 1e3, load_wait * 1e3, gap, self._readiness_s * 1e3,
                                           wall, self.pauses.total_ms - gc_ms))
        self._last_end, self._readiness_s = end, 0.0
        return StepResult(start, end, load_wait, outputs)

    def _audit(self, kind: str, items: list[Item], batch: Batch | None) -> StepAudit:
        """The versions and slot bytes this step computed with (the batch still holds its slots)."""
        key_of = dict(zip(batch.adapters, zip(batch.keys, batch.slots))) if batch is not None else {}
        keys: list[str] = []
        digests: dict[str, str] = {}
        for it in items:
            if it.ref is None:
                keys.append("")
                continue
            key, slot = key_of[it.ref]
            if slot < 0:
                keys.append(f"!{it.ref}")
                continue
            keys.append(str(key))
            if str(key) not in digests:
                digests[str(key)] = slot_digest(self.cache.shard(slot))
        return StepAudit(kind, tuple(it.rid for it in items), tuple(keys), digests)

    def _forward(self, prefill: bool, items: list[Item], slot_of: dict[AdapterRef, int],
                 waits: ChunkWaits | None = None) -> torch.Tensor:
        slots = [slot_of[it.ref] if it.ref is not None else -1 for it in items]
        if not prefill and self.graphs is not None:
            if waits is not None:  # a graph waits on no event: the stream waits for whole adapters first
                waits.finish()
            return self.graphs.run([it.row for it in items], [it.start for it in items], slots)
        hidden = self.model.shape.hidden_size
        if prefill:
            x = torch.cat([prompt_states(self.config.seed, it.rid, it.length, hidden, self.device) for it in items])
            x = x.to(self.dtype)
        rows = torch.tensor([it.row for it in items], dtype=torch.int64).to(self.device, non_blocking=True)
        if not prefill:
            x = self.last.index_select(0, rows)
        step = self._inputs(prefill, items, rows)
        self.lora.begin(slots, [it.length for it in items], prefill, self.stream, waits=waits)
        out = self.model.forward(x, step)
        self.last.index_copy_(0, rows, out)
        return out

    def _inputs(self, prefill: bool, items: list[Item], rows: torch.Tensor) -> StepInputs:
        spans: list[tuple[int, int, int]] = []
        positions: list[int] = []
        last: list[int] = []
        for it in items:
            spans.append((it.row, len(positions), it.length))
            positions.extend(range(it.start, it.start + it.length))
            last.append(len(positions) - 1)
        dev = lambda v: torch.tensor(v, dtype=torch.int64).to(self.device, non_blocking=True)  # noqa: E731
        return StepInputs(prefill, tuple(spans), dev(positions), rows, dev(last),
                          max(it.start + it.length for it in items))

    # -- warm-up ---------------------------------------------------------------------------------------
    def warm_up(self) -> None:
        """Run the step shapes once before the clock starts, so no request pays for compiling kernels
        (Triton JIT, attention back ends): prefills and decodes of a few batch sizes, one-prompt prefills
        of ``WARM_PROMPTS`` lengths (every token tile of the prefill kernel; Triton specializes integer
        arguments equal to 1 or divisible by 16), LoRA on slot 0 (its rank is 0 while empty, so the
        kernels run and add nothing), through the all-reduce; on the GPU it then
        captures every decode graph (``graphs.py``). Every rank calls this at once; the KV rows it writes
        are overwritten by the next prefill of each row."""
        c = self.config
        own = self.pad_row  # the own KV rows: no row is borrowed before the clock
        sizes = sorted({min(n, own) for n in (1, 3, min(16, c.max_running), c.max_running)})
        with self._on_stream():
            for n in sizes:
                prompt = max(1, min(17, c.max_prefill_tokens // n, c.max_seq_len - 1))
                prefill = [Item(-1 - i, "warm", i, 0, prompt) for i in range(n)]
                self._forward(True, prefill, {"warm": 0})
                self._forward(False, [Item(it.rid, "warm", it.row, prompt, 1) for it in prefill], {"warm": 0})
            for prompt in WARM_PROMPTS:
                if prompt <= min(c.max_prefill_tokens, c.max_seq_len - 1):
                    self._forward(True, [Item(-1, "warm", 0, 0, prompt)], {"warm": 0})
            if self.graphs is not None:
                self.graphs.capture_all()
        self._sync()

    # -- streams ---------------------------------------------------------------------------------------
    def _on_stream(self) -> Any:
        return torch.cuda.stream(self.stream) if self.stream is not None else contextlib.nullcontext()

    def _sync(self) -> None:
        if self.stream is not None:
            self.stream.synchronize()  # the step's tokens are ready: what an engine's sampling waits for

    def close(self) -> RankStats:
        self.releases.close()
        self.pauses.stop()
        self.stats.gc = self.pauses.summary()
        self.arrivals.close()
        self.unpin()
        self.cache.unfence()
        if self.kv_lend is not None:
            with self._on_stream():
                self.kv_lend.close()
            self.stats.kv = self.kv_lend.summary()
        self.stats.cache = self.cache.stats()
        self.cache.check_integrity()
        if isinstance(self.cache, WorkerCache) and self.owns_cache:
            self.cache.close()
        return self.stats


def _row_names(ref: AdapterRef) -> tuple[str, ...]:
    """The version exchange's rows a load or hold of ``ref`` answers for: its adapter's, and a version's own row
    (``A@VERSION``: the requests that named it)."""
    return (ref.name, str(ref)) if isinstance(ref, AdapterKey) else (ref,)
