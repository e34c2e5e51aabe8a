"""Shared fixtures of the CPU tests: tiny adapters on disk, catalogs and worker caches over them."""

from __future__ import annotations

import atexit
import faulthandler
import json
import os
import shutil
import sys
import tempfile
import threading
from collections.abc import Callable, Iterator
from pathlib import Path
from typing import Any

import pytest
import torch
from hypothesis import settings
from safetensors import safe_open
from safetensors.torch import save_file

import workers.staging.tier_reads as tier_reads
from lora_cache.adapters.catalog import AdapterCatalog, CatalogConfig
from lora_cache.adapters.peft import CONFIG_FILE, WEIGHTS_FILE, AdapterSpec, peft_key
from lora_cache.adapters.shapes import MODULE_ORDER, SHAPES
from lora_cache.adapters.shards import ShardLayout
from lora_cache.adapters.synth import SynthConfig, make_adapters
from workers.cache import WorkerCache, WorkerConfig
from workers.staging.host_config import HostTierConfig

# CI runs a fixed, reproducible example set (derandomize); developers' runs explore with fresh seeds.
# A counterexample found by exploration is kept as a regression test or an issue, never lost.
settings.register_profile("ci", derandomize=True, print_blob=True)
settings.load_profile("ci" if os.environ.get("CI") else "default")

TINY = SHAPES["tiny"]


def _no_ray_auto_init() -> None:
    """A Ray API called in this process while Ray is down raises instead of starting a local cluster or
    joining the last one started on the machine (Ray's auto-init). A thread left running by one test (an
    attached rank's outbox retrying its deltas) once re-initialised Ray after its module's ``ray.shutdown()``,
    and every later module's ``ray.init`` failed ("called ray.init twice"; the official CI of the third
    session). Only in the test process: subprocesses keep Ray's defaults."""
    from lora_cache.runtime import ray_compat

    ray_compat.disable_auto_init()


_no_ray_auto_init()


TEST_LIMIT_S = 900  # one test (its setup and teardown included) past this is hung: see the hook below
_real_stderr: Any = None  # the terminal's stderr, duplicated before pytest captures it (the dump must reach the log)


def pytest_configure(config: pytest.Config) -> None:
    global _real_stderr
    _real_stderr = os.fdopen(os.dup(2), "w")  # capture is suspended while plugins configure
    # the run's own directory of demand-read markers (workers/staging/node_reads.py), inherited by the Ray clusters
    # the tests start: a service running beside the tests on this machine neither holds their warm stages back nor
    # is held back by them
    if "LORA_CACHE_READS_DIR" not in os.environ:  # removed at the end of the run (one was left in /tmp per run)
        reads = tempfile.mkdtemp(prefix="lora-cache-reads-")
        os.environ["LORA_CACHE_READS_DIR"] = reads
        atexit.register(shutil.rmtree, reads, ignore_errors=True)


_exit_status: list[int] = []  # the session's, for ``pytest_unconfigure``


def pytest_sessionfinish(session: pytest.Session, exitstatus: int) -> None:
    _exit_status[:] = [int(exitstatus)]


@pytest.hookimpl(trylast=True)
def pytest_unconfigure(config: pytest.Config) -> None:
    """The run ends here, with the session's status, once pytest has reported everything and the functions
    registered to run at exit have run: the interpreter's own teardown is skipped. A full run passed every test and
    then died with SIGSEGV in that teardown twice in about thirty (stop 51's first fresh-clone run; 2026-12-02, after
    2006 passed): with no stack even from a fault handler enabled here, so after Python's own fault handler was gone,
    in a native library's finalization (torch, gRPC or Ray's core worker), which nothing of the tests reaches.
    With ``LORA_CACHE_TEST_TEARDOWN=1`` the interpreter tears down as usual (to look for that crash), a fault handler
    printing every thread's stack if it comes while one still can."""
    if _real_stderr is not None:
        faulthandler.enable(file=_real_stderr, all_threads=True)
    if os.environ.get("LORA_CACHE_TEST_TEARDOWN") == "1" or not _exit_status:
        return
    atexit._run_exitfuncs()  # what the run registered (its reads directory's removal), Ray's and torch's hooks
    for stream in (sys.stdout, sys.stderr, _real_stderr):
        if stream is not None:
            stream.flush()
    os._exit(_exit_status[0])


@pytest.hookimpl(hookwrapper=True)
def pytest_runtest_protocol(item: pytest.Item, nextitem: pytest.Item | None) -> Iterator[None]:
    """A hung test ends the run at once with every thread's stack, instead of eating CI's whole 90 minutes and
    printing nothing (stop 48: a lifeline test waited forever, and all the log said was where the dots stopped).
    A Ray module's first test carries its cluster's start; none comes near the limit on the 2-core CI machine."""
    faulthandler.dump_traceback_later(TEST_LIMIT_S, exit=True, file=_real_stderr)
    try:
        yield
    finally:
        faulthandler.cancel_dump_traceback_later()


@pytest.hookimpl(tryfirst=True)
def pytest_collectreport(report: pytest.CollectReport) -> None:
    """A test module skipped because an import failed is an error, not a skip: every package the tests
    import is a declared dependency (pyproject's main or ``test`` extra), so a skip would only hide one
    that the declaration forgot, on a machine that has it installed by hand."""
    if report.skipped and isinstance(report.longrepr, tuple) and "could not import" in str(report.longrepr[2]):
        report.outcome = "failed"
        report.longrepr = (f"{report.nodeid}: {report.longrepr[2]}; declare the package in pyproject.toml "
                           "(dependencies, or the test extra) instead of skipping")


def _shut_down_ray_left_up(where: str) -> None:
    """Shut down a Ray left initialized in this process, naming ``where`` on stderr."""
    if "ray" in sys.modules:
        import ray

        if ray.is_initialized():
            print(f"\nRay was left initialized {where}: shut down", file=sys.stderr)
            ray.shutdown()


@pytest.fixture(autouse=True)
def _no_ray_left_up(request: pytest.FixtureRequest) -> Iterator[None]:
    """A CPU test (not marked ``ray``) runs with no Ray in this process and leaves none behind: a Ray started
    in-process would make every later Ray module's ``ray.init`` fail ("called ray.init twice") and a fail-fast
    test see Ray already up (the fresh-clone CI of 2026-11-26, third session)."""
    ray_test = request.node.get_closest_marker("ray") is not None
    if not ray_test:
        _shut_down_ray_left_up(f"before {request.node.nodeid}")
    yield
    if not ray_test:
        _shut_down_ray_left_up(f"after {request.node.nodeid}")


@pytest.fixture(scope="module", autouse=True)
def _no_ray_across_modules(request: pytest.FixtureRequest) -> Iterator[None]:
    """Each module starts with no Ray up in this process and leaves none: its own fixture or test starts
    and stops its cluster (set up before the module's own fixtures, torn down after them)."""
    _shut_down_ray_left_up(f"before module {request.node.nodeid}")
    yield
    _shut_down_ray_left_up(f"after module {request.node.nodeid}")


@pytest.fixture
def tiny_adapters(tmp_path: Path) -> Callable[..., list[Path]]:
    """``tiny_adapters(count, rank="8,16", root=None, **synth)``: PEFT dirs written by make_adapters."""

    def make(count: int = 4, rank: str = "8,16", root: Path | None = None, **kw: Any) -> list[Path]:
        return make_adapters(
            root or tmp_path / "adapters", SynthConfig(model="tiny", count=count, rank=rank, **kw)
        )

    return make


@pytest.fixture
def make_catalog() -> Callable[..., AdapterCatalog]:
    """``make_catalog(root, max_rank=16, model="tiny", register=True)``: a catalog over ``root``."""

    def make(root: Path, max_rank: int = 16, model: str = "tiny", register: bool = True) -> AdapterCatalog:
        catalog = AdapterCatalog(CatalogConfig(adapter_roots=(str(root),), model=model, max_rank=max_rank))
        if register:
            catalog.register_dir(root)
        return catalog

    return make


def lora_tensors(
    rank: int | dict[tuple[int, str], int] = 8,
    modules: tuple[str, ...] = MODULE_ORDER,
    layers: tuple[int, ...] | None = None,
    dtype: torch.dtype = torch.bfloat16,
    seed: int = 0,
) -> dict[str, torch.Tensor]:
    """Valid tiny-model LoRA tensors under PEFT keys; ``rank`` may be per (layer, module)."""
    gen = torch.Generator().manual_seed(seed)
    out = {}
    for layer in range(TINY.num_layers) if layers is None else layers:
        for module in modules:
            r = rank if isinstance(rank, int) else rank.get((layer, module), 8)
            d_in, d_out = TINY.dims(module)
            out[peft_key(layer, module, "A")] = torch.randn(r, d_in, generator=gen).to(dtype)
            out[peft_key(layer, module, "B")] = torch.randn(d_out, r, generator=gen).to(dtype)
    return out


def write_peft(directory: Path, tensors: dict[str, torch.Tensor] | None = None, **config: Any) -> Path:
    """A hand-written PEFT adapter dir; ``config`` overrides the adapter_config.json fields."""
    directory.mkdir(parents=True, exist_ok=True)
    raw = {
        "peft_type": "LORA",
        "r": 8,
        "lora_alpha": 16,
        "target_modules": list(MODULE_ORDER),
        "use_rslora": False,
        "use_dora": False,
        "modules_to_save": None,
        "rank_pattern": {},
        "alpha_pattern": {},
        "task_type": "CAUSAL_LM",
        "base_model_name_or_path": "tiny",
    }
    raw.update(config)
    save_file(lora_tensors() if tensors is None else tensors, str(directory / WEIGHTS_FILE))
    (directory / CONFIG_FILE).write_text(json.dumps(raw))
    return directory


@pytest.fixture
def peft_writer() -> Callable[..., Path]:
    """``peft_writer(dir, tensors=None, **config)``: see :func:`write_peft`."""
    return write_peft


@pytest.fixture
def tensors_for() -> Callable[..., dict[str, torch.Tensor]]:
    """``tensors_for(rank, modules, layers, dtype, seed)``: see :func:`lora_tensors`."""
    return lora_tensors


def file_tensors(spec: AdapterSpec) -> dict[str, torch.Tensor]:
    """Every tensor of an adapter's weights file, read in full."""
    with safe_open(str(spec.weights), framework="pt") as f:
        return {k: f.get_tensor(k) for k in f.keys()}  # noqa: SIM118 - safe_open is not iterable


def expected_entries(spec: AdapterSpec, layout: ShardLayout) -> dict[tuple[int, str, str], torch.Tensor]:
    """(layer, module, A/B) -> the slice this layout's rank must hold, cut from the full file tensors."""
    full = file_tensors(spec)
    return {(e.layer, e.module, e.ab): full[e.key][e.rows, e.cols].to(layout.dtype) for e in layout.entries}


@pytest.fixture
def file_slices() -> Callable[[AdapterSpec, ShardLayout], dict[tuple[int, str, str], torch.Tensor]]:
    return expected_entries


@pytest.fixture
def make_cache() -> Iterator[Callable[..., WorkerCache]]:
    """``make_cache(catalog, num_slots=3, host_bytes=1 MiB, on_ready=None, tiers="exclusive", **worker_config)``: a
    CPU WorkerCache, closed after the test."""
    caches: list[WorkerCache] = []

    def make(
        catalog: AdapterCatalog,
        num_slots: int = 3,
        host_bytes: int = 1 << 20,
        on_ready: Callable[..., None] | None = None,
        tiers: str = "exclusive",
        **kw: Any,
    ) -> WorkerCache:
        config = WorkerConfig(
            num_slots=num_slots,
            device="cpu",
            host=HostTierConfig(host_bytes=host_bytes, read_threads=2, pin=False, tiers=tiers),
            **kw,
        )
        cache = WorkerCache(config, catalog, on_ready=on_ready)
        caches.append(cache)
        return cache

    yield make
    for cache in caches:
        cache.close()


@pytest.fixture
def gated_reads(monkeypatch: pytest.MonkeyPatch) -> tuple[threading.Event, list[str]]:
    """read_shard blocks until the returned event is set; the list records every read."""
    gate, reads, real = threading.Event(), [], tier_reads.read_shard

    def read(spec: AdapterSpec, lay: ShardLayout, dest: torch.Tensor, *rest: Any) -> int:
        reads.append(spec.name)
        assert gate.wait(timeout=10), "test gate never opened"
        return real(spec, lay, dest, *rest)

    monkeypatch.setattr(tier_reads, "read_shard", read)
    return gate, reads
