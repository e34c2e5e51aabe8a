"""PEFT's module patterns in bounded time (lora_cache/adapters/patterns.py, issue 35 item 3): the same answers as
Python's ``re`` (and PEFT's own matching) for every pattern it accepts, a catastrophic pattern answered at once,
constructs that cannot run in bounded time refused with the reason."""

from __future__ import annotations

import re
import time

import pytest
from hypothesis import given, settings
from hypothesis import strategies as st

from lora_cache.adapters.patterns import (
    FULL,
    MAX_STEPS,
    PREFIX,
    PatternError,
    PatternSet,
    PeftKeys,
    peft_key_pattern,
)
from lora_cache.adapters.shapes import MODULE_ORDER, MODULES

ATOMS = [
    "a",
    "b",
    "_",
    "1",
    ".",
    r"\.",
    r"\d",
    r"\w",
    r"\W",
    r"\s",
    "[ab.]",
    "[^a]",
    "[0-9]",
    "[A-Z]",
    "(?:a|b)",
    r"\b",
    r"\B",
    "^",
    "$",
    r"\A",
    r"\Z",
]
SHORT = ["", "a", "1", "a.b", "ab1_x", "x.a.b1", "A.b", "ba_1.x", "aa.bb", "b.x", "a b"]  # re never backtracks long


@st.composite
def regexes(draw: st.DrawFn, depth: int = 0) -> str:
    kind = draw(st.sampled_from(["atom", "atom", "seq", "alt", "rep", "flag"] if depth < 3 else ["atom"]))
    if kind == "atom":
        return draw(st.sampled_from(ATOMS))
    if kind == "seq":
        return draw(regexes(depth + 1)) + draw(regexes(depth + 1))
    if kind == "alt":
        return f"({draw(regexes(depth + 1))}|{draw(regexes(depth + 1))})"
    if kind == "flag":
        return f"(?i:{draw(regexes(depth + 1))})"
    return f"({draw(regexes(depth + 1))}){draw(st.sampled_from(['*', '+', '?', '*?', '{2}', '{1,3}', '{0,2}']))}"


@settings(max_examples=400, deadline=None)
@given(regexes())
def test_the_automaton_answers_as_re_does(pattern: str) -> None:
    compiled = re.compile(pattern)
    full, prefix = PatternSet([pattern], FULL), PatternSet([pattern], PREFIX)
    for s in SHORT:
        assert (full.first(s) is not None) == (compiled.fullmatch(s) is not None), (pattern, s)
        assert (prefix.first(s) is not None) == (compiled.match(s) is not None), (pattern, s)


def module_paths(layers: int = 3) -> list[str]:
    return [f"model.layers.{la}.{MODULES[m][0]}.{m}" for la in range(layers) for m in MODULE_ORDER]


@pytest.mark.parametrize(
    "pattern",
    [
        r".*\.(q_proj|v_proj)",
        r"model\.layers\.[01]\.self_attn\..*",
        r".*mlp.*",
        r"(?i).*Q_PROJ",
        r".*\b(up|down)_proj",
        r"model\.layers\.\d+\.mlp\.\w+",
    ],
)
def test_typical_target_regexes_match_the_module_paths_as_peft(pattern: str) -> None:
    targets = PatternSet([pattern], FULL)
    for path in module_paths():
        assert (targets.first(path) is not None) == (re.fullmatch(pattern, path) is not None), path


def peft_first(keys: list[str], path: str) -> int | None:
    """PEFT's ``get_pattern_key`` (peft/utils/other.py), as an index."""
    return next((i for i, key in enumerate(keys) if re.match(rf"(.*\.)?({key})$", path)), None)


@pytest.mark.parametrize(
    "keys",
    [
        ["q_proj", "layers.1.mlp.down_proj", "model.layers.2.self_attn.v_proj"],
        ["q.proj", ".*_proj", "q_proj"],  # '.' is any character; the first key that matches wins
        [r"layers\.[12]\..*", "down_proj", "o_proj"],
        ["mlp", "self_attn", "proj"],  # a module's parent alone matches nothing
        [f"model.layers.{la}.self_attn.q_proj" for la in range(80)] + ["up_proj"],
        ["(?:gate|up)_proj", "a)|(b"],  # the second parses only inside PEFT's wrapping, as there
    ],
)
def test_rank_pattern_keys_pick_what_peft_picks(keys: list[str]) -> None:
    matcher = PeftKeys(keys)
    for path in module_paths():
        assert matcher.first(path) == peft_first(keys, path), path


@pytest.mark.parametrize("pattern", [r"(.*)*z", r"(.|.)*z", r"((\w|\.)*)*z", r"(.*){12}z", r"(a|a?)+$"])
def test_a_catastrophic_pattern_is_answered_at_once(pattern: str) -> None:
    """``re.fullmatch`` takes minutes to hours on each of these against a module path (each failing match holds
    the GIL throughout); the automaton answers every path of a 120-layer model in well under a second."""
    targets = PatternSet([pattern], FULL)
    start = time.perf_counter()
    assert all(targets.first(p) is None for p in module_paths(120))
    assert time.perf_counter() - start < 2.0
    assert targets.steps < MAX_STEPS


@pytest.mark.parametrize(
    ("pattern", "why"),
    [
        ("(unclosed", "not a valid regular expression"),
        (r"(a)\1", "back-reference"),
        ("(?=q)q_proj", "look-ahead or look-behind"),
        ("(?<!x)q_proj", "look-ahead or look-behind"),
        ("(a)?(?(1)b|c)", "conditional group"),
        ("(?:a{1000}){1000}", "too large"),
        ("x" * 5000, "longer than"),
        ("q\nproj", "newline"),
    ],
)
def test_patterns_that_cannot_run_bounded_are_refused_with_the_reason(pattern: str, why: str) -> None:
    with pytest.raises(PatternError, match=why):
        PatternSet([pattern], FULL)


def test_peft_key_pattern_is_the_wrapping_peft_uses() -> None:
    assert peft_key_pattern("q_proj") == r"(.*\.)?(q_proj)$"


def test_too_many_keys_are_refused() -> None:
    with pytest.raises(PatternError, match="more than"):
        PeftKeys([f"k{i}" for i in range(5000)])
