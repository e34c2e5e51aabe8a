"""Adapter references: a name, or one of its versions by version or by the trainer's tag (issue 44 item 3).

A request, a lookup or a lease names an adapter as ``A`` (the version the replica serves: its newest READY on
every rank, else its current one) or as ``A@REF``, one exact version kept by the catalog: ``REF`` is a version
(``A@3f9c...``, as registrations and readiness events name it) or the tag a trainer pushed it under (``A@7``, the
push area's directory of that version). Names cannot hold ``@``, so the split is unambiguous. A version is found
only while the catalog keeps it (the current one, the ``keep_versions`` newest older ones, older ones in use:
``retirement.py``); an exact version wins over a tag that spells the same.
"""

from __future__ import annotations

from collections.abc import Callable, Iterable
from pathlib import Path

from lora_cache.adapters.catalog import AdapterCatalog, check_name
from lora_cache.adapters.pushed import TAG_RE
from lora_cache.errors import AdapterFormatError, NotFoundError

SEP = "@"


def split_ref(text: str) -> tuple[str, str | None]:
    """``"A"`` -> ``("A", None)``; ``"A@REF"`` -> ``("A", "REF")``, each part checked (the name as a registration
    checks it, the reference as a tag or version)."""
    if not isinstance(text, str):
        raise AdapterFormatError(f"adapter reference {text!r} is not a string: give NAME or NAME@VERSION")
    name, sep, ref = text.partition(SEP)
    check_name(name)
    if not sep:
        return name, None
    if not TAG_RE.match(ref):
        raise AdapterFormatError(f"adapter reference {text!r} names no version after '@': give NAME@VERSION or "
                                 "NAME@TAG (1-64 letters, digits, '.', '_' or '-'), or NAME alone for the version "
                                 "the replica serves")
    return name, ref


def base_name(ref: str) -> str:
    """``"A"`` or ``"A@REF"`` -> ``"A"``, not checked: for a reference checked at the edge already (``split_ref``,
    ``lora_cache/api/validate.py``), or on a path where a bad one must not raise here but fail later with its own
    error (an unknown name's ``NotFoundError``), or pass through as it is."""
    return ref.partition(SEP)[0]


def split_unchecked(ref: str) -> tuple[str, str]:
    """``"A"`` -> ``("A", "")``; ``"A@REF"`` -> ``("A", "REF")``: ``split_ref`` without its checks, for the same
    callers as ``base_name`` (no version named: ``""``, as ``"A@"`` gives; the caller's later check decides)."""
    name, _, ref_part = ref.partition(SEP)
    return name, ref_part


def versions_named(refs: Iterable[str | None], name: str) -> set[str]:
    """The references among ``refs`` that name one version of ``name`` (``"A@REF"``), each as its ``REF``: what a
    holder of pinned references keeps in a catalog past ``keep_versions`` (``AdapterCatalog.use``)."""
    return {ref for r in refs if r and (split := split_unchecked(r))[0] == name and (ref := split[1])}


def version_of(catalog: AdapterCatalog, name: str, ref: str, revive: Callable[[str, str], bool] | None = None) -> str:
    """The version of ``name`` that ``ref`` stands for: a version the catalog keeps, or the tag a kept version
    was pushed under; ``NotFoundError`` naming what is kept otherwise. ``revive(name, ref)``: asked first of a ``ref``
    not kept, which it may keep again (a pushed version retired moments ago: ``controller.pushes.Pushes.revive``)."""
    try:
        return _kept_version(catalog, name, ref)
    except NotFoundError:
        if revive is None or not revive(name, ref):
            raise
    return _kept_version(catalog, name, ref)


def _kept_version(catalog: AdapterCatalog, name: str, ref: str) -> str:
    versions = catalog.versions(name)  # NotFoundError for a name not registered, naming the fix
    if ref in versions:
        return ref
    tags = {path.name: version for version, path in catalog.paths(name).items() if _pushed(catalog, path)}
    if ref in tags:
        return tags[ref]
    raise NotFoundError(f"adapter {name!r} has no version or pushed tag {ref!r} kept; kept: versions "
                        f"{versions[-8:]}, tags {sorted(tags)[-8:]} (older ones retire past keep_versions once no "
                        f"rank holds them); name one of those, or {name!r} alone for the version served")


def _pushed(catalog: AdapterCatalog, path: Path) -> bool:
    """Whether ``path`` (resolved, as the catalog keeps it) is a pushed version's: PUSH_ROOT/SERVICE/NAME/TAG."""
    return path.parent.parent.parent == catalog.push_root
