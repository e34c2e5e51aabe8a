"""The reference engine's TP ranks version each adapter as the driver did (``workers.engine.rank.load_catalog``):
a file written a moment before the engine starts is hashed by content while racy and versioned by its identity once
settled, so ranks registering on either side of that moment would agree on no version (the engine's requests for
it failed after ``agree_timeout_s``, seen once in a full CPU suite)."""

from __future__ import annotations

import os
from pathlib import Path

import pytest

from lora_cache.adapters import peft
from lora_cache.adapters.files import RACY_NS
from lora_cache.adapters.synth import SynthConfig, make_adapters
from tests.test_engine import engine_config
from workers.engine.catalog import known_versions, load_catalog


def test_a_rank_registering_after_the_racy_window_takes_the_drivers_version(tmp_path: Path,
                                                                          monkeypatch: pytest.MonkeyPatch) -> None:
    make_adapters(tmp_path, SynthConfig(model="tiny", count=3, rank="8"))
    config = engine_config(tmp_path)
    written = max(os.stat(f).st_ctime_ns for f in tmp_path.rglob("*") if f.is_file())
    clock = {"now": written + RACY_NS // 4}
    monkeypatch.setattr(peft.time, "time_ns", lambda: clock["now"])
    driver = load_catalog(config)  # inside the racy window: every weights file hashed by its content
    versions = {n: driver.known(n).version for n in driver.names()}  # type: ignore[union-attr]
    assert len(versions) == 3
    clock["now"] = written + 2 * RACY_NS  # a rank starting once the window has passed
    alone = load_catalog(config)
    assert all(alone.known(n).version != v for n, v in versions.items())  # type: ignore[union-attr]  # the race
    rank = load_catalog(config, known_versions(driver))
    assert {n: rank.known(n).version for n in rank.names()} == versions  # type: ignore[union-attr]
    # the driver's version is taken only for the bytes it hashed: a file changed since is versioned anew
    changed = tmp_path / sorted(versions)[0] / peft.WEIGHTS_FILE
    data = bytearray(changed.read_bytes())
    data[-1] ^= 1
    changed.write_bytes(bytes(data))
    clock["now"] = os.stat(changed).st_ctime_ns + 2 * RACY_NS
    again = load_catalog(config, known_versions(driver))
    assert [n for n in sorted(versions) if again.known(n).version != versions[n]] == [changed.parent.name]  # type: ignore[union-attr]
