"""The lora-cache command line: make-adapters, inspect (plain and JSON), demo, and errors as exit code 2."""

from __future__ import annotations

import json
import re
import subprocess
import sys
from pathlib import Path

import pytest
import torch

from lora_cache.adapters.peft import CONFIG_FILE, WEIGHTS_FILE, content_version
from lora_cache.adapters.shapes import DEFAULT_MODEL, MODULE_ORDER, SHAPES
from lora_cache.adapters.shards import shard_layout
from lora_cache.adapters.synth import SynthConfig, make_named_adapters
from lora_cache.app.cli import main
from lora_cache.errors import ConfigError

TINY_HF_CONFIG = {
    "hidden_size": 64,
    "intermediate_size": 128,
    "num_attention_heads": 4,
    "num_key_value_heads": 2,
    "num_hidden_layers": 2,
    "head_dim": 16,
}


@pytest.fixture
def made(tmp_path: Path, capsys: pytest.CaptureFixture[str]) -> list[Path]:
    out = tmp_path / "adapters"
    assert (
        main(["make-adapters", str(out), "--model", "tiny", "--count", "3", "--rank", "8,16", "--seed", "7"])
        == 0
    )
    printed = capsys.readouterr().out.split()
    return [Path(p) for p in printed]


def inspect_json(capsys: pytest.CaptureFixture[str], *argv: str) -> dict[str, object]:
    assert main(["inspect", *argv, "--json"]) == 0
    captured = capsys.readouterr()
    assert captured.err == ""
    return json.loads(captured.out)


def test_make_adapters_with_mixed_ranks(made: list[Path], tmp_path: Path) -> None:
    assert [p.name for p in made] == ["adapter-000", "adapter-001", "adapter-002"]
    ranks = []
    for p in made:
        assert (p / WEIGHTS_FILE).is_file()
        cfg = json.loads((p / CONFIG_FILE).read_text())
        assert (
            cfg["peft_type"] == "LORA"
            and cfg["target_modules"] == list(MODULE_ORDER)
            and cfg["lora_alpha"] == 32
        )
        ranks.append(cfg["r"])
    assert ranks == [8, 16, 8]  # ranks used in turn
    again = tmp_path / "again"
    assert main(["make-adapters", str(again), "--count", "3", "--rank", "8,16", "--seed", "7"]) == 0
    assert [content_version(again / p.name) for p in made] == [content_version(p) for p in made]  # seeded


def test_named_adapters_written_by_several_processes_are_the_bytes_one_process_writes(tmp_path: Path) -> None:
    names = ["adapter-007", "tenant-b", "adapter-001", "x"]
    config = SynthConfig(model="tiny", count=len(names), rank="8,16,32", seed=3)
    alone = make_named_adapters(tmp_path / "one", config, names)
    spread = make_named_adapters(tmp_path / "three", config, names, jobs=3)
    assert [p.name for p in spread] == names  # in the order given, each under its own name
    assert [json.loads((p / CONFIG_FILE).read_text())["r"] for p in spread] == [8, 16, 32, 8]  # ranks in turn
    assert [content_version(p) for p in spread] == [content_version(p) for p in alone]
    (tmp_path / "parts").mkdir()
    first = make_named_adapters(tmp_path / "parts", config, names, skip={"tenant-b", "x"})
    rest = make_named_adapters(tmp_path / "parts", config, names, jobs=2, skip={"adapter-007", "adapter-001"})
    assert [p.name for p in first] == ["adapter-007", "adapter-001"] and [p.name for p in rest] == ["tenant-b", "x"]
    assert [content_version(tmp_path / "parts" / n) for n in names] == [content_version(p) for p in alone]
    with pytest.raises(ConfigError, match="jobs is 0"):
        make_named_adapters(tmp_path / "none", config, names, jobs=0)
    assert not (tmp_path / "none").exists()  # refused before anything is written


def test_inspect_json(made: list[Path], capsys: pytest.CaptureFixture[str]) -> None:
    info = inspect_json(capsys, str(made[1]), "--model", "tiny", "--tp", "2")
    assert info["name"] == "adapter-001" and info["path"] == str(made[1].resolve())
    assert (
        info["version"] == content_version(made[1])
        and info["model"] == "tiny"
        and info["dtype"] == "bfloat16"
    )
    assert info["rank"] == 16 and info["ranks"] == [16] and info["lora_alpha"] == 32.0
    assert info["use_rslora"] is False and info["scaling"] == [2.0]
    assert info["modules"] == sorted(MODULE_ORDER) and info["layers"] == 2
    assert info["file_bytes"] == (made[1] / WEIGHTS_FILE).stat().st_size and info["tp"] == 2
    shard_bytes = info["shard_bytes"]
    assert isinstance(shard_bytes, list) and len(shard_bytes) == 2 and shard_bytes[0] == shard_bytes[1]
    from lora_cache.adapters.peft import read_adapter

    spec = read_adapter("adapter-001", made[1], SHAPES["tiny"], 16)
    assert shard_bytes == [shard_layout(spec, SHAPES["tiny"], 2, k, torch.bfloat16).nbytes for k in range(2)]
    whole = inspect_json(capsys, str(made[1]), "--model", "tiny")["shard_bytes"]
    assert isinstance(whole, list) and len(whole) == 1 and shard_bytes[0] < whole[0] < 2 * shard_bytes[0]
    assert inspect_json(capsys, str(made[0]), "--model", "tiny", "--tp", "4")["scaling"] == [4.0]


def test_inspect_plain(made: list[Path], capsys: pytest.CaptureFixture[str]) -> None:
    assert main(["inspect", str(made[0]), "--model", "tiny", "--tp", "2"]) == 0
    out = capsys.readouterr().out
    fields = dict(re.split(r"\s+", line, maxsplit=1) for line in out.strip().splitlines())
    assert fields["name"] == "adapter-000" and fields["rank"] == "8" and fields["scaling"] == "[4.0]"
    assert fields["version"] == content_version(made[0]) and fields["tp"] == "2"
    assert fields["modules"] == str(sorted(MODULE_ORDER))
    assert re.fullmatch(r"\[\d+, \d+\]", fields["shard_bytes"])


def test_inspect_with_hf_config_json(
    made: list[Path], tmp_path: Path, capsys: pytest.CaptureFixture[str]
) -> None:
    model = tmp_path / "base" / "config.json"
    model.parent.mkdir()
    model.write_text(json.dumps(TINY_HF_CONFIG))
    by_path = inspect_json(capsys, str(made[1]), "--model", str(model), "--tp", "2")
    by_name = inspect_json(capsys, str(made[1]), "--model", "tiny", "--tp", "2")
    assert by_path["model"] == "base"
    assert {k: v for k, v in by_path.items() if k != "model"} == {
        k: v for k, v in by_name.items() if k != "model"
    }


def expect_error(capsys: pytest.CaptureFixture[str], argv: list[str], *parts: str) -> str:
    assert main(argv) == 2
    captured = capsys.readouterr()
    assert captured.out == ""
    assert captured.err.startswith(f"lora-cache {argv[0]}: error: ")
    for part in parts:
        assert part in captured.err, (part, captured.err)
    return captured.err


def test_inspect_pickle_only_dir(made: list[Path], capsys: pytest.CaptureFixture[str]) -> None:
    (made[0] / WEIGHTS_FILE).rename(made[0] / "adapter_model.bin")
    expect_error(
        capsys,
        ["inspect", str(made[0]), "--model", "tiny"],
        "pickle weights ['adapter_model.bin']",
        "arbitrary code",
        "safetensors",
    )


def test_inspect_errors(made: list[Path], tmp_path: Path, capsys: pytest.CaptureFixture[str]) -> None:
    expect_error(
        capsys,
        ["inspect", str(made[0]), "--model", "tiny", "--tp", "3"],
        "layer 0 q_proj.lora_B",
        "does not divide by TP size 3",
    )
    expect_error(
        capsys,
        ["inspect", str(made[1]), "--model", "tiny", "--max-rank", "8"],
        "rank 16, above the configured maximum 8",
        "--max-rank",
    )
    expect_error(
        capsys,
        ["inspect", str(made[0]), "--model", "llama-3.1-8b"],
        "lora_A has shape [8, 64], expected [8, 4096]",
    )
    expect_error(capsys, ["inspect", str(made[0]), "--model", "gpt-5"], "unknown model 'gpt-5'")
    expect_error(capsys, ["inspect", str(tmp_path / "nope"), "--model", "tiny"], "does not exist")
    (made[2] / WEIGHTS_FILE).write_bytes((made[2] / WEIGHTS_FILE).read_bytes()[:1000])
    expect_error(capsys, ["inspect", str(made[2]), "--model", "tiny"], "truncated or corrupt")


def test_make_adapters_errors(tmp_path: Path, capsys: pytest.CaptureFixture[str]) -> None:
    expect_error(capsys, ["make-adapters", str(tmp_path), "--rank", "8,x"], "rank must be integers", "'8,x'")
    expect_error(
        capsys, ["make-adapters", str(tmp_path), "--targets", "q_proj,fc1"], "unknown target modules ['fc1']"
    )
    expect_error(capsys, ["make-adapters", str(tmp_path), "--count", "0"], "count must be >= 1, got 0")
    expect_error(capsys, ["make-adapters", str(tmp_path), "--dtype", "int8"], "float16, bfloat16 or float32")
    assert not list(tmp_path.iterdir())  # nothing was written


def test_synth_config_defaults_match_the_cli() -> None:
    cfg = SynthConfig()
    assert cfg.ranks() == [16] and cfg.target_list() == list(MODULE_ORDER)


def test_demo(tmp_path: Path, capsys: pytest.CaptureFixture[str]) -> None:
    out = tmp_path / "demo"
    argv = [
        "demo",
        "--out",
        str(out),
        "--count",
        "5",
        "--num-slots",
        "3",
        "--steps",
        "5",
        "--device",
        "cpu",
        "--host-bytes",
        str(1 << 20),
    ]
    assert main(argv) == 0
    text = capsys.readouterr().out
    assert sorted(p.name for p in out.iterdir()) == [f"adapter-{i:03d}" for i in range(5)]
    assert "3 slots" in text and "5 adapters registered" in text and text.count("READY adapter-") >= 2
    m = re.search(r"max \|delta error\| (\S+)\)", text)
    assert m is not None and float(m.group(1)) < 1e-3  # every request computed with its own weights
    counts = {
        k: int(v) for k, v in re.findall(r"^\s+(gpu_hits|gpu_misses|loads|host_misses)\s+(\d+)$", text, re.M)
    }
    assert counts["gpu_hits"] + counts["gpu_misses"] >= 5 and counts["loads"] >= counts["host_misses"] >= 1


def test_demo_bad_device_is_a_clean_error(tmp_path: Path, capsys: pytest.CaptureFixture[str]) -> None:
    argv = [
        "demo",
        "--out",
        str(tmp_path / "d"),
        "--count",
        "2",
        "--steps",
        "1",
        "--device",
        "tpu",
        "--host-bytes",
        str(1 << 20),
    ]
    assert main(argv) == 2  # not a traceback
    err = capsys.readouterr().err
    assert err.startswith("lora-cache demo: error: device 'tpu'") and "use cpu, cuda, cuda:N or auto" in err


def test_usage_errors_exit_2(capsys: pytest.CaptureFixture[str]) -> None:
    with pytest.raises(SystemExit) as e:
        main(["frobnicate"])
    assert e.value.code == 2 and "invalid choice" in capsys.readouterr().err
    with pytest.raises(SystemExit) as e:
        main(["demo", "--num-slots", "three"])
    assert e.value.code == 2 and "--num-slots" in capsys.readouterr().err


ROUTER_COMMANDS = [["hint", "adapter-000", "--replica", "replica-0"], ["cancel-hint", "h1"], ["lookup", "adapter-000"],
                   ["route", "adapter-000", "adapter-001"], ["watch", "--count", "1"], ["status"],
                   ["register", "a", "some/dir"], ["unregister", "a"]]


@pytest.mark.parametrize("argv", ROUTER_COMMANDS, ids=lambda a: a[0])
def test_router_commands_import_neither_torch_nor_ray(argv: list[str]) -> None:
    """Routers run these in scripts: they load grpc and the stubs only (bench/probes/cli_startup.py times them)."""
    code = ("import sys; from lora_cache.app.cli import main\n"
            f"rc = main({argv!r} + ['--server', '127.0.0.1:9', '--timeout-s', '0.5'])\n"
            "heavy = sorted(m for m in ('torch', 'ray', 'triton', 'safetensors', 'numpy') if m in sys.modules)\n"
            "print(rc, heavy)")
    done = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, timeout=60)
    assert done.returncode == 0, done.stderr[-2000:]
    assert done.stdout.split("\n")[-2] == "1 []", done.stdout + done.stderr  # unreachable: exit 1, nothing heavy
    assert "UNAVAILABLE" in done.stderr  # the client's error, with the gRPC code


def test_make_adapters_then_inspect_agree_on_the_model_without_flags(
        tmp_path: Path, capsys: pytest.CaptureFixture[str], monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.chdir(tmp_path)
    assert main(["make-adapters", "rt/ad", "--count", "2"]) == 0  # a relative path, the default model
    made = [Path(p) for p in capsys.readouterr().out.split()]
    assert made == [tmp_path / "rt" / "ad" / f"adapter-00{i}" for i in range(2)]
    info = inspect_json(capsys, "rt/ad/adapter-001")  # no --model: the adapter's base_model_name_or_path
    assert info["model"] == DEFAULT_MODEL and info["path"] == str(made[1])


def test_path_options_are_taken_from_the_working_directory(tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    from lora_cache.adapters.catalog import CatalogConfig
    from lora_cache.api.gateway import GatewayConfig
    from lora_cache.app.cli import build_parser
    from lora_cache.app.serve import ServeConfig
    from lora_cache.runtime.cliargs import config_from_args

    (tmp_path / "rt" / "ad").mkdir(parents=True)
    (tmp_path / "token").write_text("secret")
    (tmp_path / "base").mkdir()
    (tmp_path / "base" / "config.json").write_text(json.dumps(TINY_HF_CONFIG))
    monkeypatch.chdir(tmp_path)
    ns = build_parser().parse_args(["serve", "--adapters", "rt/ad", "--adapter-roots", "rt", "rt/ad", "--model",
                                    "base", "--token-file", "token"])
    assert config_from_args(ServeConfig, ns).adapters == str(tmp_path / "rt" / "ad")
    catalog = config_from_args(CatalogConfig, ns)
    assert catalog.adapter_roots == (str(tmp_path / "rt"), str(tmp_path / "rt" / "ad"))
    assert catalog.model == str(tmp_path / "base") and catalog.shape().hidden_size == 64
    assert config_from_args(GatewayConfig, ns).bearer_token() == "secret"
    named = build_parser().parse_args(["serve", "--model", "tiny"])
    assert config_from_args(CatalogConfig, named).model == "tiny"  # a named shape is not a path


def test_serve_takes_the_model_from_the_adapters_and_names_the_flag_on_a_mismatch(tmp_path: Path) -> None:
    from lora_cache.adapters.base_model import choose_model, shape_of_base
    from lora_cache.adapters.synth import make_adapters

    make_adapters(tmp_path / "tiny", SynthConfig(count=2))
    assert choose_model("", tmp_path / "tiny") == "tiny"
    assert choose_model("tiny", tmp_path / "tiny") == "tiny"
    with pytest.raises(ConfigError, match=r"trained on 'tiny'.*differs from --model 'llama-3.1-8b'; pass --model tiny"):
        choose_model("llama-3.1-8b", tmp_path / "tiny")
    with pytest.raises(ConfigError, match="no adapters to take it from: pass --model"):
        choose_model("", None)
    for hf_id in ("meta-llama/Llama-3.1-8B", "meta-llama/Meta-Llama-3.1-8B-Instruct", "llama-3.1-8b"):
        assert shape_of_base(hf_id) == SHAPES["llama-3.1-8b"], hf_id
    assert shape_of_base("Qwen/Qwen2.5-7B-Instruct") == SHAPES["qwen2.5-7b"]
    assert shape_of_base("some-org/unknown-13b") is None
    base = tmp_path / "base"
    base.mkdir()
    (base / "config.json").write_text(json.dumps(TINY_HF_CONFIG))
    config = json.loads((tmp_path / "tiny" / "adapter-001" / CONFIG_FILE).read_text())
    (tmp_path / "tiny" / "adapter-001" / CONFIG_FILE).write_text(json.dumps({**config, "base_model_name_or_path":
                                                                               str(base)}))
    assert choose_model("", tmp_path / "tiny") == "tiny"  # a config.json of the same shape agrees with 'tiny'
    make_adapters(tmp_path / "tiny", SynthConfig(model="qwen2.5-7b", count=1, rank="1", prefix="big",
                                                 targets="k_proj"))
    with pytest.raises(ConfigError, match=r"trained on different base models.*pass --model"):
        choose_model("", tmp_path / "tiny")
    for d in (tmp_path / "tiny").iterdir():
        config = json.loads((d / CONFIG_FILE).read_text())
        (d / CONFIG_FILE).write_text(json.dumps({**config, "base_model_name_or_path": "some-org/unknown-13b"}))
    with pytest.raises(ConfigError, match=r"name no base model we know \(\['some-org/unknown-13b'\]\): pass --model"):
        choose_model("", tmp_path / "tiny")
    assert choose_model("tiny", tmp_path / "tiny") == "tiny"  # an unknown base cannot contradict --model


def test_the_benchmark_makes_the_adapters_a_trace_names(tmp_path: Path) -> None:
    """A trace's own adapter names (sparse, or not adapter-NNN at all) are made, then served as named."""
    from bench.run import BenchConfig, adapter_dir
    from bench.workloads import WorkloadSpec, make_workload
    from lora_cache.adapters.catalog import AdapterCatalog, CatalogConfig

    trace = tmp_path / "trace.jsonl"
    names = ["adapter-085", "adapter-007", "tenant-a", "adapter-085", "zeta"]
    trace.write_text("".join(json.dumps({"time": i / 10, "adapter": n, "input_len": 8, "output_len": 2}) + "\n"
                             for i, n in enumerate(names)))
    spec = WorkloadSpec(arrivals="trace", popularity=f"trace:{trace}", requests=0)
    wanted = spec.adapter_names(slots=2)
    assert wanted == sorted(set(names))
    bench = BenchConfig(model="tiny", adapter_ranks="8", out=str(tmp_path / "out"))
    root = adapter_dir(bench, wanted)
    catalog = AdapterCatalog(CatalogConfig(adapter_roots=(root,), model="tiny", max_rank=8))
    versions = {n: catalog.register(n, Path(root) / n).version for n in wanted}
    assert [r.adapter for r in make_workload(spec, wanted).requests] == names
    assert adapter_dir(bench, wanted) == root  # made again: the same bytes, the same versions
    assert {n: catalog.register(n, Path(root) / n).version for n in wanted} == versions
    from lora_cache.adapters.synth import make_adapters

    theirs = tmp_path / "theirs"  # a directory the job did not make is never written to
    make_adapters(theirs, SynthConfig(count=1, prefix="mine"))
    with pytest.raises(ConfigError, match=r"lacks 4 of the workload's 4 adapters \(adapter-007, adapter-085"):
        adapter_dir(BenchConfig(model="tiny", adapters=str(theirs)), wanted)
    assert sorted(p.name for p in theirs.iterdir()) == ["mine-000"]


def test_a_benchmark_catalog_completed_in_parts_holds_what_a_whole_one_does(tmp_path: Path) -> None:
    """Each adapter's rank is its place in the workload's names, whether it is made with the rest or later (it was
    its place among the missing ones: a catalog made for 1 adapter, then 4, had ranks 8, 8, 16, 8, not 8, 16, 8, 16)."""
    from bench.run import BenchConfig, adapter_dir

    wanted = [f"adapter-{i:03d}" for i in range(4)]
    whole = Path(adapter_dir(BenchConfig(model="tiny", adapter_ranks="8,16", out=str(tmp_path / "whole")), wanted))
    part = BenchConfig(model="tiny", adapter_ranks="8,16", out=str(tmp_path / "part"))
    adapter_dir(part, wanted[:1])
    root = Path(adapter_dir(part, wanted))
    assert [json.loads((root / n / CONFIG_FILE).read_text())["r"] for n in wanted] == [8, 16, 8, 16]
    assert [content_version(root / n) for n in wanted] == [content_version(whole / n) for n in wanted]


def test_bare_command_lists_every_command_and_version_is_cheap(capsys: pytest.CaptureFixture[str]) -> None:
    """Issue 34: `lora-cache` alone listed only the router commands, and there was no `--version`."""
    from lora_cache.app.cli import main

    with pytest.raises(SystemExit) as info:
        main([])
    assert info.value.code == 2
    usage = capsys.readouterr().err
    assert all(c in usage for c in ("serve", "make-adapters", "inspect", "demo", "hint", "route", "watch", "status"))
    code = ("import sys\nfrom lora_cache.app.cli import main\ntry:\n    main(['--version'])\nexcept SystemExit as e:\n"
            "    print('exit', e.code, sorted({'torch', 'ray'} & set(sys.modules)))")
    done = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, timeout=60, check=True)
    import lora_cache

    assert done.stdout.splitlines() == [f"lora-cache {lora_cache.__version__}", "exit 0 []"], done.stdout + done.stderr
