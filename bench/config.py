"""The benchmark job's configuration: ``BenchConfig`` (engine, policies, fleet, outputs) and the named scenarios.

``bench.run`` makes its options from it (with ``bench.workloads.WorkloadSpec``'s), and a scenario fills the
options left unset. The simulator's path (``bench.sim.job``) and its check against a real run
(``bench.sim.check``) read it too, so it sits below both: it imports neither the job nor the simulator.
"""

from __future__ import annotations

from dataclasses import dataclass, field
from typing import Any

from bench.policies import parse_policies
from bench.router.rules import RULES
from bench.store import StoreModel, parse_store
from lora_cache.errors import ConfigError
from lora_cache.routing.ranking import RouterConfig
from workers.staging.disk_tier import FETCH_ORDERS, DiskTierConfig
from workers.staging.eviction import EVICTION, RECENT_S
from workers.staging.host_config import DIRECT_READS, TIERS

ENGINES = ("real", "sim")

# Named scenarios: values for options left unset on the command line.
REAL_HOST_BYTES = 16 << 30  # a realistic host tier per rank: 0.25 x 512 GiB / 8 ranks (named scenarios, both engines)

SCENARIOS: dict[str, dict[str, Any]] = {
    # The seed reviewers' scenario: 16 adapters over 8 slots, Poisson 4 req/s. Every slot may serve a batch
    # (max_adapters = slots), as SGLang (max_loras_per_batch) and vLLM (max_loras) size their pools; with
    # fewer (the engine's default of 4), head-of-line waits for a batch place set every policy's tail, the
    # oracle's too (bench/RESULTS.md, 2026-11-22).
    "seed": {"num_adapters": 16, "slots": 8, "max_adapters": 8, "arrivals": "poisson:4", "popularity": "uniform",
             "requests": 200},
    # The reviewers' scenarios: 4x adapters per slot.
    "uniform": {"popularity": "uniform", "arrivals": "poisson:4", "requests": 200, "max_adapters": 8},
    "zipf": {"popularity": "zipf:1.5", "arrivals": "poisson:4", "requests": 200, "max_adapters": 8},
    "bursty": {"popularity": "bursty:10,20,20", "arrivals": "poisson:4", "requests": 300, "num_adapters": 50,
               "max_adapters": 8},
    # CI: small, on the CPU, through the real path.
    "quick": {"model": "tiny", "replicas": 2, "tp": 1, "slots": 4, "popularity": "zipf:1.5", "arrivals": "poisson:20",
              "requests": 48, "random_input_len": 64, "random_output_len": 8, "random_range_ratio": 0.5,
              "max_seq_len": 256, "max_prefill_tokens": 512, "max_running": 8, "max_adapters": 2,
              "adapter_ranks": "8,16", "hint_lead_s": 0.2, "host_bytes": 2 << 30},
}


@dataclass(frozen=True)
class BenchConfig:
    """One benchmark run: which engine, which policies, the fleet, and where results go."""

    engine: str = field(default="real", metadata={"help": f"engine: {' | '.join(ENGINES)}"})
    policies: str = field(default="all", metadata={"help": "comma list of ondemand,overlap,queue,global,oracle or all"})
    scenario: str = field(default="", metadata={"help": f"named scenario: {', '.join(SCENARIOS)} (sets the options "
                                                        "you leave unset)"})
    quick: bool = field(default=False, metadata={"help": "the small CI run (same as --scenario quick)"})
    out: str = field(default="bench-results", metadata={
        "path": True, "help": "directory for results.json and the plots"})
    adapters: str = field(default="", metadata={
        "path": True, "help": "directory of PEFT adapters (empty: make them under --out)"})
    adapter_ranks: str = field(default="16,64", metadata={"help": "ranks of the adapters made (used in turn)"})
    model: str = field(default="llama-3.1-8b", metadata={
        "path": "name_or_file", "help": "named model shape or path to its config.json"})
    num_layers: int = field(default=0, metadata={"help": "layers the real engine runs (0: all)"})
    replicas: int = field(default=1, metadata={"help": "replicas"})
    tp: int = field(default=1, metadata={"help": "tensor-parallel size of each replica"})
    slots: int = field(default=8, metadata={"help": "GPU adapter slots per rank, equal for every policy but the "
                                                    "oracle (which has one per adapter)"})
    max_rank: int = field(default=64, metadata={"help": "largest LoRA rank (sizes the slots)"})
    page_rank: int = field(default=0, metadata={
        "help": "GPU pages sized for this LoRA rank, every policy but the oracle (issue 43; 0: one page per slot). "
                "Equal bytes to --slots S of max_rank: --pool-pages S*max_rank/page_rank and --slots the most "
                "adapters at once"})
    pool_pages: int = field(default=0, metadata={"help": "GPU pages per rank (0: --slots adapters of max_rank)"})
    max_running: int = field(default=32, metadata={"help": "most requests running per replica"})
    kv_rows: int = field(default=0, metadata={
        "help": "real engine: KV rows kept in the adapter pool (0: the engine's own KV cache); past them, up to "
                "--max-running, rows borrowed from the pool as the batch grows (workers/engine/kv_rows.py). Give "
                "--pool-pages room for the KV rows too"})
    max_adapters: int = field(default=4, metadata={"help": "most distinct adapters per batch"})
    max_prefill_tokens: int = field(default=4096, metadata={"help": "prompt tokens per prefill step"})
    max_seq_len: int = field(default=2048, metadata={"help": "longest input + output"})
    hint_lead_s: float = field(default=0.05, metadata={
        "help": "the router hints a request's adapter this long before the request reaches its replica (0.05: a "
                "router that forwards within milliseconds; 0.5: a router that queues requests)"})
    router: str = field(default="round-robin", metadata={
        "help": "the benchmark router, on either engine: round-robin (request i to replica i mod R, the default) | "
                "least-loaded (fewest routed and not finished) | affinity (the least-loaded replica where the "
                "adapter is ready, else the least loaded) | lora-cache (the controller's routing advice, the "
                "gateway's Route); closed-loop arrivals (inflight:N) on --engine real are routed round-robin"})
    join_over: float = field(default=RouterConfig.join_over, metadata={
        "help": "the lora-cache router's RouterConfig.join_over, on either engine (1: off; 2: a replica running the "
                "request's adapter with no adapter waiting for a lane may take twice the load bound)"})
    host_bytes: int = field(default=REAL_HOST_BYTES, metadata={
        "help": "pinned host tier bytes per rank, the same for every policy (default 16 GiB: a quarter of a 512 GiB "
                "host's memory over its 8 GPU ranks); 0: the host tier's auto size (a share of this host's available "
                "memory over its GPU ranks), resolved once on the driver"})
    host_eviction: str = field(default="lru", metadata={
        "help": "the host tier's eviction order, the same for every policy: lru (the default) | popular (the "
                "fleet's least asked-for adapters first, by the controller's ranking: LRU where no controller ranks, "
                "as for the baselines) | segmented (read-once shards first); workers/staging/eviction.py"})
    host_recent_s: float = field(default=RECENT_S, metadata={
        "help": "host_eviction popular: a shard touched this many seconds ago or less goes after every other "
                "(HostTierConfig.recent_s; 0: rank alone)"})
    host_tiers: str = field(default="exclusive", metadata={
        "help": "whether GPU slots and the host tier may hold one shard both, the same for every policy: inclusive | "
                "exclusive (a GPU load lets go of its host copy; a slot's eviction writes the shard back; "
                "workers/staging/host_config.py)"})
    direct_reads: str = field(default="off", metadata={
        "help": "real engine: how the workers read an adapter file that is out of the page cache "
                "(HostTierConfig.direct_reads), the same for every policy: off (through the page cache) | on "
                "(O_DIRECT: with --store device, a miss reads the device with no page cache at all) | auto (each "
                "file system and shard size tries O_DIRECT, the page cache and the page cache asked ahead, and takes "
                "the fastest, workers/staging/read_ways.py); "
                "the simulator takes a device read's speed from its calibration"})
    read_ahead: bool = field(default=False, metadata={
        "help": "real engine: the workers ask for an adapter file out of the page cache whole as its read starts "
                "(HostTierConfig.read_ahead; with --direct-reads off only), the same for every policy"})
    gpus: str = field(default="auto", metadata={"help": "real engine on GPUs: auto | yes | no"})
    gpu_share: float = field(default=1.0, metadata={
        "help": "real engine on GPUs: the share of one GPU each rank asks for (0.5: two replicas of --tp 1 on each "
                "GPU, sharing its copy engines and compute; lora-cache serve --gpu-share)"})
    calibration: str = field(default="h200-llama8b", metadata={
        "path": "name_or_file", "help": "sim costs: a name under bench/calibration "
                                                                        "or a JSON file"})
    attach: bool = field(default=False, metadata={"help": "real engine: run every engine rank in a process of its "
                                                          "own, attached through the engine seam (workers/attach/) "
                                                          "instead of inside the service's worker actors"})
    check_sim: bool = field(default=False, metadata={"help": "real engine: also simulate this run with costs fitted "
                                                             "from it and compare TTFT"})
    store: str = field(default="page-cache", metadata={
        "help": "where adapters come from, on either engine (bench/store.py): page-cache (local files, pages kept "
                "after the first read; the default) | device (local files, every file's pages dropped before each "
                "policy and after every shard read: reads come from the device) | s3:BANDWIDTH,LATENCY, e.g. "
                "s3:200MBps,30ms (a real S3 server behind a throttling proxy: BANDWIDTH shared by every fetch, "
                "LATENCY before each response's first byte; workers fetch into a fresh disk tier per policy)"})
    disk_bytes: int = field(default=DiskTierConfig.disk_cache_bytes, metadata={
        "help": "s3: bytes of the node's disk tier (the store's copies, LRU by bytes), the same for every policy, on "
                "either engine (default: the service's own, 64 GiB; below the catalog's objects, copies are evicted "
                "and fetched again)"})
    fetch_order: str = field(default=DiskTierConfig.fetch_order, metadata={
        "help": "s3: how the node's demand fetches share the store, on either engine (DiskTierConfig.fetch_order): "
                "soonest (one at a time, the one that would end soonest alone first) | shared (all at once)"})
    warmup_requests: int = field(default=-1, metadata={
        "help": "requests played before the measured window, from the same arrival process (bench/warmup.py): "
                "-1 (auto): until every replica has seen as many distinct adapters as it has GPU slots (its slots "
                "are full), at most 4x --requests; 0: none. The warm-up is reported as the cold start, apart"})
    timeout_s: float = field(default=1800.0, metadata={"help": "give up on one policy's run after this long"})
    plots: bool = field(default=True, metadata={"help": "write the PNG plots"})

    def __post_init__(self) -> None:
        if self.engine not in ENGINES:
            raise ConfigError(f"engine {self.engine!r} is not one of {ENGINES}")
        if self.host_eviction not in EVICTION:
            raise ConfigError(f"host_eviction {self.host_eviction!r} is not one of {', '.join(EVICTION)}; pick one "
                              "(lru is the default)")
        if not (isinstance(self.host_recent_s, (int, float)) and 0 <= self.host_recent_s < float("inf")):
            raise ConfigError(f"host_recent_s is {self.host_recent_s!r}; give seconds >= 0, e.g. {RECENT_S} (0: rank "
                              "alone)")
        if self.host_tiers not in TIERS:
            raise ConfigError(f"host_tiers {self.host_tiers!r} is not one of {', '.join(TIERS)}; pick one "
                              "(inclusive is the default)")
        if self.direct_reads not in DIRECT_READS:
            raise ConfigError(f"direct_reads {self.direct_reads!r} is not one of {', '.join(DIRECT_READS)}; pick one "
                              "(off is the default)")
        if self.read_ahead and self.direct_reads != "off":
            raise ConfigError(f"--read-ahead with --direct-reads {self.direct_reads}: read-ahead asks the page cache "
                              "for a file that direct reads never read from it; drop --read-ahead or give "
                              "--direct-reads off")
        if self.scenario and self.scenario not in SCENARIOS:
            raise ConfigError(f"scenario {self.scenario!r} is not one of {', '.join(SCENARIOS)}")
        if self.gpus not in ("auto", "yes", "no"):
            raise ConfigError(f"gpus must be auto, yes or no, got {self.gpus!r}")
        for name in ("replicas", "tp", "slots", "max_rank", "max_running", "max_adapters"):
            if getattr(self, name) < 1:
                raise ConfigError(f"{name} must be >= 1, got {getattr(self, name)}")
        parse_policies(self.policies)
        RouterConfig(join_over=self.join_over)  # a clear error for a bad value before anything starts
        if self.router not in RULES:  # the simulator's ROUTERS are these rules too
            raise ConfigError(f"router {self.router!r} is not registered; choose one of {', '.join(RULES)}")
        parse_store(self.store)
        if self.disk_bytes < 1:
            raise ConfigError(f"--disk-bytes {self.disk_bytes}: give the node's disk tier in bytes, >= 1 (default "
                              f"{DiskTierConfig.disk_cache_bytes}: 64 GiB)")
        if self.fetch_order not in FETCH_ORDERS:
            raise ConfigError(f"--fetch-order {self.fetch_order!r}: give one of {', '.join(FETCH_ORDERS)}")
        if self.warmup_requests < -1:
            raise ConfigError(f"--warmup-requests {self.warmup_requests}: give a count >= 0, or -1 (auto: until "
                              "every replica's GPU slots are full)")
        if self.kv_rows and self.engine != "real":
            raise ConfigError(f"--kv-rows {self.kv_rows}: the simulator does not model the engine's KV cache; it needs "
                              f"--engine real, not {self.engine!r}")
        if not 0 < self.gpu_share <= 1 or (self.gpu_share != 1 and self.gpus == "no"):
            raise ConfigError(f"--gpu-share {self.gpu_share}: give the share of one GPU each rank asks for, in (0, 1], "
                              "with GPUs (not --gpus no)")
        if self.gpu_share != 1 and (self.engine != "real" or self.attach):
            raise ConfigError(f"--gpu-share {self.gpu_share}: GPUs shared by replicas are the service's worker actors' "
                              f"(--engine real without --attach); the simulator models a GPU per rank, so give "
                              f"--gpu-share 1 with --engine {self.engine}{' --attach' if self.attach else ''}")
        if self.attach and self.engine != "real":
            raise ConfigError(f"--attach runs the real engine's ranks in their own processes; it needs --engine real, "
                              f"not {self.engine!r}")

    def store_model(self) -> StoreModel:
        return parse_store(self.store)

    def byte_slots(self, kv_pages: int = 0) -> int:
        """The slots of ``max_rank`` the GPU bytes of a rank amount to: ``slots`` for slots, the pool's pages over
        the pages of a max-rank shard for a paged pool (issue 43; a shard's size is linear in its rank). The
        workload's adapters count from it, so a paged run at equal bytes gets the slots' catalog. ``kv_pages``: the
        pages of the engine's own KV cache a ``--kv-rows`` pool holds too (``bench.real.own_kv_pages``), left out,
        so that run gets the catalog of the run with its own KV cache beside the rest of the pool."""
        if not self.page_rank or self.page_rank >= self.max_rank or not self.pool_pages:
            return self.slots
        return max(1, (self.pool_pages - kv_pages) * self.page_rank // self.max_rank)

    def use_gpus(self) -> bool:
        if self.gpus != "auto":
            return self.gpus == "yes"
        import torch

        return torch.cuda.is_available() and torch.cuda.device_count() >= self.tp
