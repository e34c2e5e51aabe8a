"""The benchmark declares its replicas' admission limits the way a deployment does (review finding, issue 31):
hosted replicas through ``ServeConfig.max_adapters``/``max_running`` (what ``lora-cache serve --max-adapters
--max-running`` declares when it starts them), attached ranks in their hello (``AttachConfig``); no call of its own
to the controller that serve does not make, so the two paths cannot drift."""

from __future__ import annotations

from pathlib import Path

from bench.attached import attach_config
from bench.real import RealConfig, serve_config
from workers.engine.config import EngineConfig

ROOT = Path(__file__).resolve().parents[1]


def _engine(max_adapters: int, max_running: int) -> EngineConfig:
    return EngineConfig(
        model="tiny", tp=1, num_slots=8, max_rank=64, max_running=max_running, max_adapters=max_adapters
    )


def test_the_benchmark_makes_no_limits_call_of_its_own() -> None:
    for path in sorted((ROOT / "bench").rglob("*.py")):
        assert "declare_limits" not in path.read_text(), f"{path}: declare limits through ServeConfig or the hello"


def test_hosted_replicas_declare_the_engines_limits_through_serve() -> None:
    serve = serve_config(RealConfig(replicas=3, tp=2, max_adapters=2, max_running=6), "/adapters", _engine(2, 6))
    assert (serve.replicas, serve.tp, serve.max_adapters, serve.max_running) == (3, 2, 2, 6)
    assert serve.adapters == "/adapters"


def test_attached_ranks_declare_the_engines_limits_in_their_hello() -> None:
    serve = serve_config(RealConfig(replicas=2, attach=True), "/adapters", _engine(4, 32))
    assert serve.replicas == 0  # the ranks attach themselves; serve starts none
    config = attach_config("replica-1", "127.0.0.1:6379", _engine(4, 32), 1)
    assert (config.replica, config.max_adapters, config.max_running) == ("replica-1", 4, 32)
    assert (attach_config("replica-1", "127.0.0.1:6379", None, 0).max_adapters, config.address) == (0, "127.0.0.1:6379")
