"""PEFT's module patterns matched in bounded time (lifecycle step 0).

An adapter config names its modules by regular expressions: ``target_modules`` as a string (PEFT:
``re.fullmatch(target_modules, path)``) and every key of ``rank_pattern`` / ``alpha_pattern`` (PEFT:
``re.match(rf"(.*\\.)?({key})$", path)``, the first key that matches wins). Python's ``re`` backtracks: a pattern
like ``(.*)*z`` takes hours against a 30-character module path, holding the GIL all the while, so one config
would stop the controller's event loop. Here the same patterns are parsed by Python's own parser (the same
syntax, the same errors) and run as a Thompson automaton: every path is matched in one pass, in time linear in
its length times the automaton's size, and the state sets met are cached, so a model's few hundred module
paths, which share their prefixes, cost a few hundred steps. Every pattern set has a hard budget of work
(``MAX_STEPS``): a pattern too large (``MAX_STATES``) or too costly is refused with an error, never run long.

Constructs that a bounded automaton cannot run are refused with a clear error: back-references, look-ahead
and look-behind, conditional groups, possessive repeats and atomic groups (docs/decisions.md, "Module
patterns in bounded time"). The matched strings are module paths (``model.layers.0.self_attn.q_proj``):
no newline, so ``^``/``$``/``\\A``/``\\Z`` mean the ends of the path under every flag.
"""

from __future__ import annotations

import functools
import re
import sys
from collections.abc import Callable, Sequence
from typing import Any

if sys.version_info >= (3, 11):
    from re import _constants as C  # type: ignore[attr-defined]
    from re import _parser as P  # type: ignore[attr-defined]
else:  # pragma: no cover - Python 3.10
    import sre_constants as C
    import sre_parse as P

MAX_PATTERN_CHARS = 4096  # one pattern; PEFT's are a few dozen characters
MAX_PATTERNS = 4096  # keys of one rank_pattern / alpha_pattern (one per module of a 120-layer model fits)
MAX_STATES = 20_000  # automaton nodes of one pattern set (repeats like {1000} are unrolled)
MAX_STEPS = 2_000_000  # node visits over a pattern set's life (~1 s of Python): then it is refused
MAX_PATHS = 65_536  # matched paths remembered per pattern set

FULL, PREFIX = "fullmatch", "match"  # how a pattern must match: the whole path, or from its start (``$`` inside)
_CHAR, _SPLIT, _ASSERT, _ACCEPT = range(4)
_UNSUPPORTED = {
    C.GROUPREF: "a back-reference",
    C.GROUPREF_EXISTS: "a conditional group",
    C.ASSERT: "a look-ahead or look-behind",
    C.ASSERT_NOT: "a negative look-ahead or look-behind",
}
for _op, _what in (
    ("POSSESSIVE_REPEAT", "a possessive repeat"),
    ("ATOMIC_GROUP", "an atomic group"),
    ("GROUPREF_IGNORE", "a back-reference"),
):
    if hasattr(C, _op):
        _UNSUPPORTED[getattr(C, _op)] = _what


class PatternError(ValueError):
    """A pattern that is not valid, uses a construct that cannot run in bounded time, or costs too much."""


def _word(c: str | None) -> bool:
    return c is not None and (c.isalnum() or c == "_")


class _Nfa:
    """The automaton's nodes in parallel lists; built back to front (each part given what follows it)."""

    def __init__(self) -> None:
        self.kind: list[int] = []
        self.arg: list[Any] = []  # CHAR: predicate; ASSERT: condition; ACCEPT: (tag, how)
        self.out: list[int] = []
        self.out2: list[int] = []  # SPLIT's second branch

    def node(self, kind: int, arg: Any = None, out: int = -1, out2: int = -1) -> int:
        if len(self.kind) >= MAX_STATES:
            raise PatternError(
                f"is too large: more than {MAX_STATES} automaton states (long repeats like "
                "{1000} are unrolled); write it shorter or list the modules"
            )
        self.kind.append(kind)
        self.arg.append(arg)
        self.out.append(out)
        self.out2.append(out2)
        return len(self.kind) - 1

    def seq(self, items: Any, nxt: int, flags: int) -> int:
        for op, av in reversed(list(items)):
            nxt = self.item(op, av, nxt, flags)
        return nxt

    def item(self, op: Any, av: Any, nxt: int, flags: int) -> int:
        if op in _UNSUPPORTED:
            raise PatternError(
                f"uses {_UNSUPPORTED[op]}, which cannot be matched in bounded time; write it "
                "without, or list the module names"
            )
        if op in (C.LITERAL, C.NOT_LITERAL, C.ANY, C.IN):
            return self.node(_CHAR, _predicate(op, av, flags), nxt)
        if op is C.BRANCH:
            starts = [self.seq(alt, nxt, flags) for alt in av[1]]
            start = starts[-1]
            for s in reversed(starts[:-1]):
                start = self.node(_SPLIT, None, s, start)
            return start
        if op is C.SUBPATTERN:
            _, add, remove, sub = av
            return self.seq(sub, nxt, (flags | add) & ~remove)
        if op in (C.MAX_REPEAT, C.MIN_REPEAT):  # greedy or lazy: the same strings match
            return self.repeat(av, nxt, flags)
        if op is C.AT:
            return self.node(_ASSERT, av, nxt)
        raise PatternError(f"uses {_name(op)}, which this matcher does not support; simplify it or list the modules")

    def repeat(self, av: Any, nxt: int, flags: int) -> int:
        low, high, sub = av
        if high == C.MAXREPEAT:
            loop = self.node(_SPLIT, None, -1, nxt)
            self.out[loop] = self.seq(sub, loop, flags)
            start = loop
        else:
            start = nxt
            for _ in range(high - low):  # optional copies: take one more, or go on
                start = self.node(_SPLIT, None, self.seq(sub, start, flags), nxt)
        for _ in range(low):
            start = self.seq(sub, start, flags)
        return start


def _predicate(op: Any, av: Any, flags: int) -> Callable[[str], bool]:
    fold = bool(flags & re.IGNORECASE)
    if op is C.LITERAL or op is C.NOT_LITERAL:
        want = chr(av)
        if fold:
            eq: Callable[[str], bool] = functools.partial(_fold_eq, want.lower())
        else:
            eq = want.__eq__
        return eq if op is C.LITERAL else (lambda c: not eq(c))
    if op is C.ANY:
        return (lambda c: True) if flags & re.DOTALL else (lambda c: c != "\n")
    items, negate = [], False
    for kind, arg in av:
        if kind is C.NEGATE:
            negate = True
        else:
            items.append(_member(kind, arg, flags))
    return lambda c: any(f(c) for f in items) != negate


def _fold_eq(want: str, c: str) -> bool:
    return c.lower() == want


def _member(kind: Any, arg: Any, flags: int) -> Callable[[str], bool]:
    fold, ascii_only = bool(flags & re.IGNORECASE), bool(flags & re.ASCII)
    if kind is C.LITERAL:
        return _predicate(C.LITERAL, arg, flags)
    if kind is C.RANGE:
        lo, hi = arg
        if fold:
            return lambda c: any(lo <= ord(x) <= hi for x in {c, c.lower(), c.upper()})
        return lambda c: lo <= ord(c) <= hi
    if kind is C.CATEGORY:
        return _category(_name(arg), ascii_only)
    raise PatternError(f"uses a character class item {_name(kind)} this matcher does not support; simplify it")


def _category(name: str, ascii_only: bool) -> Callable[[str], bool]:
    base = name.rsplit("_", 1)[-1]  # CATEGORY_DIGIT, CATEGORY_UNI_NOT_WORD, ...
    negate = "_NOT_" in name
    test: Callable[[str], bool] = {
        "DIGIT": str.isdecimal,
        "SPACE": str.isspace,
        "WORD": lambda c: c.isalnum() or c == "_",
        "LINEBREAK": lambda c: c == "\n",
    }.get(base, lambda c: False)
    if ascii_only:
        inner = test
        test = lambda c: c.isascii() and inner(c)  # noqa: E731
    return (lambda c: not test(c)) if negate else test


def _name(constant: Any) -> str:
    return str(getattr(constant, "name", constant))


def _holds(code: Any, prev: str | None, nxt: str | None) -> bool:
    name = _name(code)
    if name in ("AT_BEGINNING", "AT_BEGINNING_STRING", "AT_BEGINNING_LINE"):
        return prev is None
    if name in ("AT_END", "AT_END_STRING", "AT_END_LINE"):
        return nxt is None
    if name in ("AT_BOUNDARY", "AT_UNI_BOUNDARY", "AT_LOC_BOUNDARY"):
        return _word(prev) != _word(nxt)
    if name in ("AT_NON_BOUNDARY", "AT_UNI_NON_BOUNDARY", "AT_LOC_NON_BOUNDARY"):
        return (prev is not None or nxt is not None) and _word(prev) == _word(nxt)  # sre: never in ""
    raise PatternError(f"uses the anchor {name}, which this matcher does not support")


class PatternSet:
    """Patterns in order, each to be matched as ``how`` says (``FULL`` or ``PREFIX``); ``first(path)`` is the
    index of the first one that matches ``path`` (None if none does), as ``re`` would answer, in bounded time.
    Thread-safe (what it caches is filled idempotently). ``PatternError`` names no field: callers add it."""

    def __init__(self, patterns: Sequence[str], how: str) -> None:
        if len(patterns) > MAX_PATTERNS:
            raise PatternError(f"has {len(patterns)} patterns, more than {MAX_PATTERNS}")
        self.nfa = _Nfa()
        starts = [self._compile(i, p, how) for i, p in enumerate(patterns)]
        start = starts[-1] if starts else self.nfa.node(_CHAR, lambda c: False, -1)
        for s in reversed(starts[:-1]):
            start = self.nfa.node(_SPLIT, None, s, start)
        self.start = frozenset((start,))
        self.steps = 0  # node visits so far (bounded by MAX_STEPS)
        self._moves: dict[tuple[frozenset[int], bool | None, str | None], tuple[frozenset[int], frozenset[int]]] = {}
        self._paths: dict[str, int | None] = {}

    def _compile(self, tag: int, pattern: str, how: str) -> int:
        if not isinstance(pattern, str):
            raise PatternError(f"pattern {pattern!r} is a {type(pattern).__name__}, not a string")
        if len(pattern) > MAX_PATTERN_CHARS:
            raise PatternError(f"pattern of {len(pattern)} characters is longer than {MAX_PATTERN_CHARS}")
        if "\n" in pattern or "\0" in pattern:
            raise PatternError(f"pattern {_clip(pattern)} holds a newline or NUL, which no module path has")
        try:
            parsed = P.parse(pattern, 0)
        except (re.error, OverflowError, RecursionError) as e:
            raise PatternError(f"pattern {_clip(pattern)} is not a valid regular expression ({e})") from e
        accept = self.nfa.node(_ACCEPT, (tag, how))
        try:
            return self.nfa.seq(parsed, accept, parsed.state.flags)
        except PatternError as e:
            raise PatternError(f"pattern {_clip(pattern)} {e}") from None

    def first(self, path: str) -> int | None:
        if path in self._paths:
            return self._paths[path]
        assert "\n" not in path, "module paths have no newline"
        cur, prev, matched = self.start, None, set[int]()
        for i in range(len(path) + 1):
            c = path[i] if i < len(path) else None
            key = (cur, None if prev is None else _word(prev), c)
            move = self._moves.get(key)
            if move is None:
                move = self._moves[key] = self._move(cur, prev, c)
            cur, accepted = move
            matched.update(accepted)
            if not cur:
                break
            prev = c
        found = min(matched) if matched else None
        if len(self._paths) >= MAX_PATHS:
            self._paths.clear()
        self._paths[path] = found
        return found

    def _move(self, cur: frozenset[int], prev: str | None, c: str | None) -> tuple[frozenset[int], frozenset[int]]:
        """From the nodes ``cur`` between ``prev`` and ``c``: the nodes after reading ``c`` (none at the end), and
        the tags accepted here (prefix patterns anywhere, whole-path ones at the end)."""
        nfa, stack, seen, after, accepted = self.nfa, list(cur), set(cur), set(), set()
        while stack:
            n = stack.pop()
            self.steps += 1
            kind = nfa.kind[n]
            if kind == _CHAR:
                if c is not None and nfa.arg[n](c):
                    after.add(nfa.out[n])
                continue
            if kind == _ACCEPT:
                tag, how = nfa.arg[n]
                if how == PREFIX or c is None:
                    accepted.add(tag)
                continue
            if kind == _ASSERT and not _holds(nfa.arg[n], prev, c):
                continue
            for m in (nfa.out[n], nfa.out2[n]) if kind == _SPLIT else (nfa.out[n],):
                if m not in seen:
                    seen.add(m)
                    stack.append(m)
        if self.steps > MAX_STEPS:
            raise PatternError(
                f"costs more than {MAX_STEPS} automaton steps over the model's module paths; "
                "simplify it or list the modules"
            )
        return frozenset(after), frozenset(accepted)


def _clip(value: object, limit: int = 80) -> str:
    text = repr(value)
    return text if len(text) <= limit else f"{text[: limit - 20]}...{text[-12:]} ({len(text)} characters)"


@functools.lru_cache(maxsize=256)
def compiled(patterns: tuple[str, ...], how: str) -> PatternSet:
    """The pattern set of ``patterns`` (shared: adapters of one config match through one cache)."""
    return PatternSet(patterns, how)


def peft_key_pattern(key: str) -> str:
    """A rank_pattern / alpha_pattern key as PEFT matches it (``get_pattern_key``), for ``PREFIX``."""
    return rf"(.*\.)?({key})$"


_PLAIN = re.compile(r"[\w.-]+", re.ASCII)  # letters, digits, '_', '-' (literal) and '.' (any character)


class PeftKeys:
    """The keys of a ``rank_pattern`` or ``alpha_pattern``, in order; ``first(path)`` is the index of the key PEFT
    picks for ``path`` (the first whose ``peft_key_pattern`` matches), or None. A plain key (``_PLAIN``: most
    are module names or paths) is compared directly, exactly as the regex would match it; the others run
    through one ``PatternSet``."""

    def __init__(self, keys: Sequence[str]) -> None:
        if len(keys) > MAX_PATTERNS:
            raise PatternError(f"has {len(keys)} keys, more than {MAX_PATTERNS}")
        self.plain = [(i, k) for i, k in enumerate(keys) if isinstance(k, str) and _PLAIN.fullmatch(k)]
        other = [(i, k) for i, k in enumerate(keys) if not (isinstance(k, str) and _PLAIN.fullmatch(k))]
        self.other_at = [i for i, _ in other]
        self.other = PatternSet([peft_key_pattern(k) if isinstance(k, str) else k for _, k in other], PREFIX)

    def first(self, path: str) -> int | None:
        best = next((i for i, k in self.plain if _plain_match(k, path)), None)
        j = self.other.first(path) if self.other_at else None
        if j is not None and (best is None or self.other_at[j] < best):
            best = self.other_at[j]
        return best


def _plain_match(key: str, path: str) -> bool:
    r"""``re.match(rf"(.*\.)?({key})$", path)`` for a plain key: the key's length of the path's end, after a '.' or
    the start, equal to the key where the key's '.' stands for any character."""
    at = len(path) - len(key)
    if at < 0 or (at > 0 and path[at - 1] != "."):
        return False
    return all(k == "." or k == c for k, c in zip(key, path[at:]))


@functools.lru_cache(maxsize=256)
def peft_keys(keys: tuple[str, ...]) -> PeftKeys:
    """The ``PeftKeys`` of ``keys`` (shared, like ``compiled``)."""
    return PeftKeys(keys)
