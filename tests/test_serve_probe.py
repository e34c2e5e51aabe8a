"""bench.probes.ray_serve's options: the GPU mode's engine and cache, and every bad option refused with the option,
its value and the fix before Ray or any adapter is touched (no Ray here: fast)."""

from __future__ import annotations

import pytest

from bench.probes.ray_serve import build_parser, engine_overrides, main
from examples.ray_serve_lora import engine_config


def _refused(capsys: pytest.CaptureFixture[str], *argv: str) -> str:
    import ray

    with pytest.raises(SystemExit) as exit_:
        main(list(argv))
    assert exit_.value.code == 2
    assert not ray.is_initialized()
    return capsys.readouterr().err


@pytest.mark.parametrize(
    ("argv", "says"),
    [
        (["--device", "gpu"], ["--device 'gpu'", "use one of cpu, cuda"]),
        (["--model", "llama-9z"], ["--model 'llama-9z'", "llama-3.1-8b"]),
        (["--adapter-ranks", "16,x"], ["--adapter-ranks '16,x'", "comma-separated"]),
        (["--adapter-ranks", "0"], ["--adapter-ranks '0'", ">= 1"]),
        (["--replicas", "4", "--adapters", "2"], ["--adapters 2", "--replicas 4", "raise --adapters"]),
        (["--input-len", "300"], ["--input-len 300", "max_seq_len (256)", "--engine"]),
        (["--engine", '{"no_such_field": 1}'], ["--engine", "no_such_field", "EngineConfig fields"]),
        (["--engine", "[1]"], ["--engine '[1]'", "JSON object"]),
        (["--router", "{bad"], ["--router '{bad'", "is not JSON"]),
        (["--device", "cuda", "--replicas", "64", "--adapters", "64"], ["--device cuda", "needs 64 GPUs"]),
    ],
)
def test_bad_options_are_refused_before_ray_starts(
    capsys: pytest.CaptureFixture[str], argv: list[str], says: list[str]
) -> None:
    err = _refused(capsys, *argv)
    for part in says:
        assert part in err, err


def test_the_cpu_mode_keeps_its_engine() -> None:
    """The defaults build the engine the probe built before its GPU mode (tiny, CPU, 4 slots, rank 16)."""
    args = build_parser().parse_args([])
    assert engine_config(**engine_overrides(args)) == engine_config(num_slots=4, max_adapters=4)


def test_the_gpu_mode_runs_the_8b_engine_in_bfloat16_with_cuda_graphs_at_equal_slots() -> None:
    args = build_parser().parse_args(
        ["--device", "cuda", "--model", "llama-3.1-8b", "--adapter-ranks", "16,64", "--slots", "6"]
    )
    got = engine_overrides(args)
    assert got["device"] == "cuda" and got["dtype"] == "bfloat16" and got["cuda_graphs"] is True
    assert (got["model"], got["num_slots"], got["max_adapters"], got["max_rank"]) == ("llama-3.1-8b", 6, 4, 64)
    args = build_parser().parse_args(["--device", "cuda", "--engine", '{"max_running": 8}'])
    assert engine_overrides(args)["max_running"] == 8
