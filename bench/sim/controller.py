"""The controller in simulated time: the real ``ControllerCore``, driven the way the Ray actor drives it.

``ControllerActor`` (lora_cache/controller/actor.py) forwards every input to the core and replans at once:
a queue report, a hint batch or a worker's residency deltas each cost one incremental ``plan(now)``;
a timer (``health_s``, here ``plan_interval_s``) releases failed loads whose backoff passed and
replans the whole fleet; every ``sync_s`` it replaces its view of each worker by the worker's full
report. ``SimController`` does the same, with the calibration's latencies on every message: inputs
reach the core ``report_latency_ms`` after they happen (a worker's deltas gather over that window, as
its outbox batches them), commands reach a worker ``command_latency_ms`` after the plan.

The catalog is a ``SyntheticCatalog``: adapters as ``make-adapters`` writes them, specs built in
memory (a fleet of thousands of adapters without writing or hashing files); shard sizes, the planner
and readiness are the real code.
"""

from __future__ import annotations

from collections.abc import Mapping
from pathlib import Path

from bench.sim.calibration import Calibration
from bench.sim.events import Loop
from bench.sim.worker import Delta, SimWorker
from lora_cache.adapters.catalog import AdapterCatalog, CatalogConfig, check_name
from lora_cache.adapters.peft import AdapterConfig, AdapterSpec, KnownVersion, LoraModule
from lora_cache.adapters.shapes import MODULE_ORDER, ModelShape
from lora_cache.controller.core import HOST_STATES, ControllerConfig, ControllerCore
from lora_cache.errors import NotFoundError
from lora_cache.planner import PlannerConfig
from lora_cache.routing.ranking import RouterConfig
from lora_cache.vocab import Evict, Prefetch, Ranking, Stage, WorkerId

LORA_ALPHA = 32.0  # make-adapters' default; scaling does not change bytes
NO_FILES_ROOT = str(Path(__file__).resolve().parent)  # catalogs need a root; the synthetic one reads nothing


class SyntheticCatalog(AdapterCatalog):
    """Registered adapters with specs made in memory from a name -> LoRA rank table (all 7 modules)."""

    def __init__(self, shape: ModelShape, ranks: Mapping[str, int], dtype: str) -> None:
        super().__init__(self.config_for(shape, ranks), shape)
        self.ranks, self.dtype = dict(ranks), dtype
        self._modules: dict[int, tuple[LoraModule, ...]] = {}  # rank -> modules, shared by its adapters

    @staticmethod
    def config_for(shape: ModelShape, ranks: Mapping[str, int]) -> CatalogConfig:
        return CatalogConfig(adapter_roots=(NO_FILES_ROOT,), model=shape.name, max_rank=max(ranks.values()))

    def read(self, name: str, path: str | Path, known: KnownVersion | None = None,
             carried: bool = False) -> AdapterSpec:
        """The simulated adapter's spec, made in memory (``add``, as for files read, makes it current)."""
        if name not in self.ranks:
            raise NotFoundError(f"adapter {name!r} is not one of the simulated adapters; give it a rank first")
        rank = self.ranks[name]
        if rank not in self._modules:
            self._modules[rank] = tuple(LoraModule(layer, module, rank, LORA_ALPHA / rank)
                                        for layer in range(self.shape.num_layers) for module in MODULE_ORDER)
        spec = AdapterSpec(check_name(name), Path(path), AdapterConfig(rank, LORA_ALPHA, MODULE_ORDER),
                           self._modules[rank], self.dtype, f"sim-r{rank}", 0)
        return spec


class SimController:
    """The controller actor's event handling around the real ``ControllerCore``."""

    def __init__(self, loop: Loop, calibration: Calibration, planner: PlannerConfig, catalog: SyntheticCatalog,
                 plan_interval_s: float, sync_s: float, router: RouterConfig | None = None) -> None:
        self.loop, self.calibration = loop, calibration
        config = ControllerConfig(catalog=catalog.config, planner=planner, router=router or RouterConfig())
        self.core = ControllerCore(config, epoch=1)
        self.core.catalog = catalog  # the actor's catalog reads adapter files; the simulated one is in memory
        self.core.admission.catalog = catalog  # what a rank's claim is checked against: the same one
        self.plan_interval_s, self.sync_s = plan_interval_s, sync_s
        self.workers: dict[WorkerId, SimWorker] = {}
        self._outbox: dict[WorkerId, list[Delta]] = {}  # deltas gathering until their batch is sent
        self._next_sync = sync_s
        self.messages = self.prefetches = self.evicts = self.stages = self.rankings = 0

    @property
    def report_s(self) -> float:
        return self.calibration.report_latency_ms / 1e3

    def add_worker(self, wid: WorkerId, worker: SimWorker) -> None:
        self.workers[wid] = worker
        self._outbox[wid] = []

    def start(self) -> None:
        """Adopt the workers from their full reports (oracle residency included), then run the timer."""
        for wid, worker in self.workers.items():  # as a restarted controller's adoption: believed once
            self.core.sync_worker(wid, worker.describe(), worker.hosted(), adopting=True)
        self.loop.after(self.plan_interval_s, self._timer)

    # -- inputs, sent now, taken after the report latency --------------------------------------------
    def queue(self, replica: str, entries: list[tuple[str, float]]) -> None:
        self.loop.after(self.report_s, self._take_queue, replica, entries)

    def hint(self, hint_id: str, adapter: str, replica: str, expected_in_s: float) -> None:
        self.loop.after(self.report_s, self._take_hint, (hint_id, adapter, replica, expected_in_s))

    def push(self, wid: WorkerId, delta: Delta) -> None:
        """A worker's delta: the first of a batch schedules its send."""
        pending = self._outbox[wid]
        if not pending:
            self.loop.after(self.report_s, self._take_deltas, wid)
        pending.append(delta)

    def _take_queue(self, replica: str, entries: list[tuple[str, float]]) -> None:
        self.core.report_queue(replica, entries, self.loop.now)
        self._plan()

    def _take_hint(self, hint: tuple[str, str, str, float]) -> None:
        (outcome,) = self.core.hint_batches([[hint]], self.loop.now)
        assert not outcome.rejections, outcome.rejections
        self._plan()

    def _take_deltas(self, wid: WorkerId) -> None:
        deltas, self._outbox[wid] = self._outbox[wid], []
        self.core.worker_report(wid, deltas, self.loop.now)
        if any(d[2] not in HOST_STATES for d in deltas):  # as WorkerLinks.receive: host tiers' changes plan nothing
            self._plan()

    # -- decisions -------------------------------------------------------------------------------------
    def _timer(self) -> None:
        now = self.loop.now
        self.core.retry_failed(now)
        if now >= self._next_sync:  # anti-entropy, as the controller's WorkerLinks.resync (here no delta is ever lost)
            self._next_sync = now + self.sync_s
            for wid, worker in self.workers.items():
                self.core.sync_worker(wid, worker.describe(), worker.hosted())
        self._plan(full=True)
        self.loop.after(self.plan_interval_s, self._timer)

    def _plan(self, full: bool = False) -> None:
        self.messages += 1
        for wid, commands in self.core.plan(self.loop.now, full=full).items():
            if commands:
                self.prefetches += sum(isinstance(c, Prefetch) for c in commands)
                self.evicts += sum(isinstance(c, Evict) for c in commands)
                self.stages += sum(isinstance(c, Stage) for c in commands)
                self.rankings += sum(isinstance(c, Ranking) for c in commands)
                self.loop.after(self.calibration.command_latency_ms / 1e3, self.workers[wid].apply, commands)

    def stats(self) -> dict[str, object]:
        status = self.core.status()
        planner = self.core.planner.stats
        return {"policy": self.core.planner.config.policy, "plans": planner.plans,
                "replicas_planned": planner.replicas_planned, "messages": self.messages,
                "prefetch_commands": self.prefetches, "evict_commands": self.evicts,
                "stage_commands": self.stages, "ranking_commands": self.rankings,
                "hints_received": status["hints_received"], "hints_accepted": status["hints_accepted"],
                "load_failures": status["load_failures"]}
