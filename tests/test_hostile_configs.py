"""Hostile adapter configs and arguments (issue 35, item 3): none blocks the controller's event loop, each is a
clear INVALID_ARGUMENT naming the field and the fix, and every adapter the validator accepts is one the loader
reads (a property test over configs PEFT writes and configs it never would).

The registrations run through the real ``Registrar`` and ``ControllerCore`` (the actor's code, no Ray) with the
workers' links faked, as tests/test_registrations.py does; the status codes are the servicer's own mapping.
"""

from __future__ import annotations

import asyncio
import json
import math
import re
import time
from collections.abc import Callable
from pathlib import Path
from typing import Any

import grpc
import pytest
import torch
from hypothesis import HealthCheck, event, given, settings
from hypothesis import strategies as st
from safetensors.torch import save_file

from lora_cache.adapters.catalog import AdapterCatalog, CatalogConfig
from lora_cache.adapters.peft import CONFIG_FILE, WEIGHTS_FILE, module_path, peft_key
from lora_cache.adapters.shapes import MODULE_ORDER, SHAPES
from lora_cache.adapters.shards import shard_layout
from lora_cache.api.servicer import status_for
from lora_cache.controller.core import ControllerConfig, ControllerCore
from lora_cache.controller.registrations import Registrar
from lora_cache.errors import AdapterError
from tests.conftest import expected_entries, lora_tensors, write_peft
from tests.test_registrations import Links
from workers.reads.shard import read_shard

TINY = SHAPES["tiny"]


def registrar(root: Path) -> tuple[ControllerCore, Registrar]:
    core = ControllerCore(
        ControllerConfig(catalog=CatalogConfig(adapter_roots=(str(root),), model="tiny", max_rank=16)), epoch=1
    )

    async def plan() -> None:
        pass

    return core, Registrar(core, Links([]), set(), plan)  # type: ignore[arg-type]


async def register_while_ticking(reg: Registrar, items: list[tuple[str, str]]) -> tuple[list[Any], float]:
    """The registration's results and the longest the event loop went without running a 10 ms ticker meanwhile
    (what a Status or Lookup call would have waited)."""
    longest, done = 0.0, False

    async def tick() -> None:
        nonlocal longest
        last = time.perf_counter()
        while not done:
            await asyncio.sleep(0.01)
            now = time.perf_counter()
            longest, last = max(longest, now - last), now

    ticker = asyncio.create_task(tick())
    try:
        results = await reg.register(items)
    finally:
        done = True
        await ticker
    return results, longest


def test_a_catastrophic_target_regex_does_not_stop_the_event_loop(tmp_path: Path) -> None:
    """Before issue 35, ``re.fullmatch("(.*){9}z", "model.layers.0.mlp.down_proj")`` ran for seconds on the
    registration thread holding the GIL (``(.*)*z``: hours), so the loop answered nothing meanwhile. Now the
    pattern is matched by a bounded automaton: refused at once (it excludes the adapter's tensors), the loop free."""
    write_peft(tmp_path / "evil", target_modules="(.*){9}z")
    write_peft(tmp_path / "good")
    core, reg = registrar(tmp_path)
    start = time.perf_counter()
    (evil, good), longest = asyncio.run(
        register_while_ticking(reg, [("evil", str(tmp_path / "evil")), ("good", str(tmp_path / "good"))])
    )
    assert time.perf_counter() - start < 10
    assert longest < 0.5, f"the event loop stalled {longest:.2f} s"
    assert evil.error is not None and "target_modules" in str(evil.error) and "excludes" in str(evil.error)
    assert good.error is None and "good" in core.catalog


def test_a_catastrophic_regex_that_matches_registers_at_once(tmp_path: Path) -> None:
    write_peft(tmp_path / "a", target_modules=r"(.*)*\.(q|k|v|o|gate|up|down)_proj")
    _, reg = registrar(tmp_path)
    (done,), longest = asyncio.run(register_while_ticking(reg, [("a", str(tmp_path / "a"))]))
    assert done.error is None and longest < 0.5


CONFIGS: list[tuple[str, dict[str, Any], str]] = [  # (id, config fields, what the message must name)
    ("bad-regex", {"target_modules": "(q_proj"}, "'target_modules' regex"),
    ("backreference", {"target_modules": r"(q)_\1"}, "back-reference"),
    ("targets-ints", {"target_modules": [1, 2]}, "'target_modules' must be"),
    ("rank-pattern-inf", {"rank_pattern": {"q_proj": math.inf}}, "rank_pattern['q_proj']"),
    ("rank-pattern-8.5", {"rank_pattern": {"q_proj": 8.5}}, "rank_pattern['q_proj']"),
    ("rank-pattern-bad-key", {"rank_pattern": {"(": 8}}, "'rank_pattern'"),
    ("alpha-nan", {"lora_alpha": math.nan}, "'lora_alpha'"),
    ("alpha-inf", {"lora_alpha": math.inf}, "'lora_alpha'"),
    ("rslora-string", {"use_rslora": "false"}, "'use_rslora'"),
    ("r-string", {"r": "8"}, "'r'"),
]
RAW_CONFIGS = [  # (id, the file's text, what the message must name)
    ("r-5000-digits", '{"peft_type": "LORA", "target_modules": ["q_proj"], "r": ' + "1" * 5000 + "}", "not valid JSON"),
    ("nested-100000", "[" * 100_000 + "]" * 100_000, "not valid JSON"),
]


def codes_of(root: Path, items: list[tuple[str, str]]) -> list[tuple[grpc.StatusCode, str]]:
    _, reg = registrar(root)
    results = asyncio.run(reg.register(items))
    assert all(r.error is not None for r in results), [r for r in results if r.error is None]
    return [status_for(r.error) for r in results]  # type: ignore[arg-type]


@pytest.mark.parametrize(("case", "fields", "names"), CONFIGS, ids=[c[0] for c in CONFIGS])
def test_every_bad_config_is_invalid_argument_naming_the_field(
    tmp_path: Path, case: str, fields: dict[str, Any], names: str
) -> None:
    """Before issue 35 the first five raised re.error, TypeError or OverflowError (INTERNAL: "this is a bug in
    lora-cache") and NaN, Infinity, 8.5 and "false" were accepted."""
    write_peft(tmp_path / case, **fields)
    ((code, message),) = codes_of(tmp_path, [(case, str(tmp_path / case))])
    assert code is grpc.StatusCode.INVALID_ARGUMENT, message
    assert names in message and CONFIG_FILE in message and len(message) < 800


@pytest.mark.parametrize(("case", "text", "names"), RAW_CONFIGS, ids=[c[0] for c in RAW_CONFIGS])
def test_hostile_config_files_are_invalid_argument(tmp_path: Path, case: str, text: str, names: str) -> None:
    write_peft(tmp_path / case)
    (tmp_path / case / CONFIG_FILE).write_text(text)
    ((code, message),) = codes_of(tmp_path, [(case, str(tmp_path / case))])
    assert code is grpc.StatusCode.INVALID_ARGUMENT and names in message and len(message) < 800


@pytest.mark.parametrize("path", ["a\0b", "x" * 4096, "a/" + "y" * 300, "d/" * 2100])
def test_impossible_paths_are_invalid_argument_without_echoing_them(tmp_path: Path, path: str) -> None:
    """A NUL byte raised ValueError (INTERNAL) and a 4,096-character component an OSError echoing all of it."""
    ((code, message),) = codes_of(tmp_path, [("a", path)])
    assert code is grpc.StatusCode.INVALID_ARGUMENT and "adapter path" in message and len(message) < 400


# -- accepted means loadable ---------------------------------------------------------------------------------

KEYS = [
    "q_proj",
    "down_proj",
    "layers.1.mlp.down_proj",
    "model.layers.0.self_attn.v_proj",
    ".*_proj",
    "q.proj",
    r"layers\.1\..*",
    "(k|v)_proj",
    "mlp",
]
REGEXES = [
    r".*\.(q_proj|v_proj|down_proj)",
    r"model\.layers\.[01]\.self_attn\..*",
    r".*",
    r".*mlp.*",
    r"(?i).*\.(Q|K|V|O)_PROJ",
    r"(.*)*\.(gate|up)_proj",
    r"(.*){9}_proj",
]
BAD_REGEXES = ["[", r"(q)\1", "(?=m).*", "(.*)*z"]
HOSTILE = [None, 0, -1, 8.5, "8", True, math.nan, math.inf, [8], {"x": 1}, 10**6]


@st.composite
def sane_or(draw: st.DrawFn, sane: list[Any], hostile: list[Any] = HOSTILE) -> Any:
    """A sane value, or one time in ten a hostile one."""
    return draw(st.sampled_from(hostile if draw(st.integers(0, 9)) == 0 else sane))


@st.composite
def adapters(draw: st.DrawFn) -> tuple[dict[str, Any], dict[tuple[int, str], int], list[Callable[[str], str]]]:
    """An adapter_config.json's fields (mostly sane, sometimes hostile), the modules whose tensors the file holds
    with the rank each has (mostly the config's), and key renames (mostly none)."""
    modules = draw(
        st.lists(
            st.tuples(st.integers(0, TINY.num_layers - 1), st.sampled_from(MODULE_ORDER)),
            min_size=1,
            max_size=6,
            unique=True,
        )
    )
    fields: dict[str, Any] = {"r": draw(sane_or([4, 8, 16])), "lora_alpha": draw(sane_or([8, 16.0, 0.5]))}
    if draw(st.booleans()):
        extra = draw(st.lists(st.sampled_from([*MODULE_ORDER, "mlp.up_proj", "q"]), max_size=3))
        named = sorted({m for _, m in modules} | set(extra)) if draw(st.integers(0, 4)) else extra or ["q"]
        fields["target_modules"] = named
    else:
        fields["target_modules"] = draw(sane_or(REGEXES, BAD_REGEXES))
    for name in ("rank_pattern", "alpha_pattern"):
        if draw(st.booleans()):
            values = sane_or([2, 4, 8, 16, 32])
            fields[name] = draw(st.dictionaries(st.sampled_from(KEYS), values, max_size=3))
    fields["use_rslora"] = draw(sane_or([False, True, None], ["false", 0, "true"]))
    ranks = {}
    for layer, module in modules:
        want = peft_rank(fields, layer, module)
        sane = type(want) is int and 1 <= want <= 16
        ranks[(layer, module)] = want if sane and draw(st.integers(0, 9)) else draw(st.sampled_from([4, 8, 16]))
    renames = draw(
        st.lists(
            st.sampled_from(
                [lambda k: k.replace(".weight", ".default.weight"), lambda k: k.replace("layers.1.", "layers.01.")]
            ),
            max_size=1,
        )
        if not draw(st.integers(0, 5))
        else st.just([])
    )
    return fields, ranks, renames


def peft_rank(fields: dict[str, Any], layer: int, module: str) -> Any:
    """The rank PEFT gives a module from the config (``get_pattern_key`` over ``rank_pattern``)."""
    pattern, path = fields.get("rank_pattern") or {}, module_path(layer, module)
    if not isinstance(pattern, dict):
        return None
    key = next((k for k in pattern if re.match(rf"(.*\.)?({k})$", path)), None)
    return pattern[key] if key is not None else fields["r"]


@settings(max_examples=150, deadline=None, suppress_health_check=[HealthCheck.function_scoped_fixture])
@given(adapters())
def test_every_adapter_the_validator_accepts_is_read_by_the_loader(
    tmp_path_factory: pytest.TempPathFactory, case: tuple[dict[str, Any], dict[tuple[int, str], int], list[Any]]
) -> None:
    """Accepted: every TP rank's shard at TP 1 and 2 is read and holds the file's slices, and each module's rank
    is the one PEFT's matching gives it (patterns matched by the bounded automaton agree with ``re``).
    Refused: an ``AdapterError`` naming the file. Before issue 35, keys with the adapter name segment passed
    validation and failed every read."""
    fields, ranks, renames = case
    root = tmp_path_factory.mktemp("a")
    tensors = {}
    for (layer, module), rank in ranks.items():
        one = lora_tensors(rank, (module,), (layer,), seed=layer)
        for key, value in one.items():
            for rename in renames:
                key = rename(key)
            tensors[key] = value
    directory = root / "adapter"
    directory.mkdir()
    save_file(tensors, str(directory / WEIGHTS_FILE))
    config = {"peft_type": "LORA", "base_model_name_or_path": "tiny", **fields}
    (directory / CONFIG_FILE).write_text(json.dumps(config))
    catalog = AdapterCatalog(CatalogConfig(adapter_roots=(str(root),), model="tiny", max_rank=16))
    try:
        spec = catalog.read("adapter", str(directory))
    except AdapterError as e:
        assert str(directory) in str(e)
        event("refused: " + re.sub(r"^.*?(json|safetensors):? ?", "", str(e))[:50])
        return
    event("accepted")
    for m in spec.modules:
        assert m.rank == peft_rank(fields, m.layer, m.module) == ranks[(m.layer, m.module)]
        assert math.isfinite(m.scaling) and m.scaling > 0
    for tp in (1, 2):
        for rank in range(tp):
            layout = shard_layout(spec, TINY, tp, rank, torch.float32)
            staged = torch.zeros(layout.numel, dtype=torch.float32)
            read_shard(spec, layout, staged, verify="content")
            for e in layout.entries:
                want = expected_entries(spec, layout)[(e.layer, e.module, e.ab)]
                assert torch.equal(staged[e.offset : e.offset + e.numel].view(e.shape), want), (tp, rank, e.key)
    assert all(peft_key(m.layer, m.module, "A") in tensors for m in spec.modules)
