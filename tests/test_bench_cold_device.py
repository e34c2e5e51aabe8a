"""bench/probes/cold_device.py on the CPU (issue 42): every reference read and the real path measured on the same
files, the path's load a host-tier miss (the probe refuses a hit), O_DIRECT measured or named unsupported."""

from __future__ import annotations

import contextlib
import json
from pathlib import Path

import pytest

from bench.probes.cold_device import build_parser, device_of, main, read_buffered, read_direct, read_mmap, scratch
from lora_cache.errors import ConfigError
from tests.pages import direct_refused


def test_the_probe_measures_every_read_and_the_paths_miss_on_the_same_files(tmp_path: Path,
                                                                           capsys: pytest.CaptureFixture[str]) -> None:
    out = main(["--model", "tiny", "--rank", "16", "--device", "cpu", "--threads", "1,2", "--repeats", "2",
                "--files", "2", "--adapters", str(tmp_path / "ad"), "--out", str(tmp_path / "cd.json")])
    assert json.loads((tmp_path / "cd.json").read_text())["GBps"] == pytest.approx(out["GBps"])
    expected = {"buffered_1", "buffered_2", "willneed_1", "willneed_2", "mmap_1", "mmap_2", "path", "path_read"}
    direct = {"direct_1", "direct_2"}
    assert expected <= out["GBps"].keys()
    assert direct <= out["GBps"].keys() or direct <= out["unsupported"].keys()  # tmpfs refuses O_DIRECT
    assert all(v > 0 for v in out["GBps"].values()) and out["shard_bytes"] > 0 and out["device"] == "cpu"
    assert out["best_reference"] in out["GBps"] and out["path_read_over_best"] > 0
    assert out["store"]["mount"] != "?"  # the mount holding the adapters is named
    phases = out["phases_ms"]["path"]  # where a miss's time goes, in order
    assert phases["read"] <= phases["first issue"] <= phases["last issue"] <= phases["seen"] <= phases["answered"]
    assert phases["proven"] <= phases["last issue"] and phases["h2d"] >= 0
    assert phases["direct"] == 0 and out["phases_ms"]["path_ahead"]["direct"] == 0  # only direct_reads goes around
    if not direct_refused(tmp_path):  # the page cache, where the file system takes O_DIRECT
        assert out["phases_ms"]["path_direct"]["direct"] == 1
    table = capsys.readouterr().out
    assert "| path_read |" in table and "the path's store read / the best reference" in table


def test_each_reference_reads_the_whole_file(tmp_path: Path) -> None:
    data = bytes(range(256)) * 40_000 + b"tail"  # not a multiple of the 8 MiB chunk nor of O_DIRECT's 4 KiB
    path = tmp_path / "f.bin"
    path.write_bytes(data)
    into = scratch(len(data))
    for threads in (1, 3):
        assert read_buffered(path, threads, into) == len(data) and read_mmap(path, threads, into) == len(data)
        assert read_buffered(path, threads, into, willneed=True) == len(data)
        with contextlib.suppress(OSError):  # a file system without O_DIRECT (tmpfs): the probe names it unsupported
            assert read_direct(path, threads, into) == len(data)
    assert device_of(path)["mount"] != "?"


def test_bad_options_are_refused_before_any_adapter_is_made(tmp_path: Path) -> None:
    from bench.probes.cold_device import measure

    for argv in (["--repeats", "0"], ["--threads", "0,4"]):
        with pytest.raises(ConfigError, match="must be >= 1"):
            measure(build_parser().parse_args([*argv, "--model", "tiny", "--adapters", str(tmp_path / "ad")]))
    assert not (tmp_path / "ad").exists()
