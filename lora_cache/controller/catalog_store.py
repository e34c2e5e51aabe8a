"""The controller's catalog across a restart (lifecycle step 0; issue 29): names, paths, versions, kept
older versions, in Ray's GCS key-value store beside the planner's snapshot (``snapshots.py``).

Workers' reports alone cannot rebuild a catalog when there are none (``serve --replicas 0`` with no engine
attached), and they name paths, not versions. So every registration call ends with the catalog saved
(``CatalogSnapshots.save``: encoded and written on a thread, a write in flight covering the calls that
arrive while it runs), and the health loop saves what else changed. Each entry keeps the version as it
was hashed (``KnownVersion``: the file's identity, header and block CRCs), so a restarted controller
takes a file that is provably the one hashed without reading its weights again (``peft.proves``), and
hashes any other. Whatever the file holds now is what comes back: an entry whose file changed meanwhile
comes back under its new version (logged), one that cannot be read is left out (logged, with the fix),
and an older version comes back only if its bytes are still the ones it was hashed from. Never the old
version over new bytes. A store version comes back from the config and header the snapshot kept (each
distinct blob once, by digest), with no request to the store: every fetch proves its object (``If-Match``).

``encode``/``decode`` are plain functions over the catalog's specs; ``read_saved`` reads a decoded
snapshot's files (on a thread), ``CatalogSnapshots`` keeps each entry's encoding until it changes.
"""

from __future__ import annotations

import base64
import dataclasses
import hashlib
import json
import logging
import time
import zlib
from collections.abc import Iterable
from typing import Any, NamedTuple

from lora_cache.adapters.catalog import AdapterCatalog
from lora_cache.adapters.files import BlockCrcs, FileIdentity, WeightsSource
from lora_cache.adapters.objects import StoreSource
from lora_cache.adapters.peft import AdapterSpec, KnownVersion
from lora_cache.controller.core import ControllerCore
from lora_cache.errors import LoraCacheError

log = logging.getLogger(__name__)

FORMAT = 1
YIELD_EVERY = 64  # entries encoded between two hand-overs of the GIL


class SavedVersion(NamedTuple):
    path: str  # the directory to read it from (the current version's as it was registered)
    known: KnownVersion


class SavedEntry(NamedTuple):
    name: str
    current: SavedVersion
    older: tuple[SavedVersion, ...]  # oldest first


class Restored(NamedTuple):
    """What a restore brought back (each current version: as saved, or a new one hashed) and left out."""

    entries: list[tuple[AdapterSpec, str, list[AdapterSpec]]]  # (current spec, its path, older specs kept)
    unchanged: int  # current versions proven the same file, taken without reading the weights
    rehashed: int  # current versions read again (another machine, a racy stamp, a changed identity)
    changed: int  # of those, now a new version
    refused: int  # entries that could not be read: left out
    dropped: int  # older versions whose bytes are gone


def known_json(k: KnownVersion, metas: dict[str, bytes] | None = None) -> dict[str, Any]:
    """``k`` as JSON. A store version's carried config and header (``KnownVersion.meta``, compressed, at most
    ``objects.MAX_META_BYTES``) go into ``metas`` by their digest, named by it here (a snapshot keeps each distinct
    one once: adapters of one shape and config have the same), or inline without ``metas``."""
    s = k.source
    if isinstance(s, StoreSource):  # from an object store: its identity there, its metadata as registered
        d = {"v": k.version, "c": k.config_digest, "h": k.host, "s3": list(s)}
        if k.meta and metas is None:
            d["mi"] = base64.b64encode(k.meta).decode()
        elif k.meta and metas is not None:
            digest = hashlib.blake2b(k.meta, digest_size=16).hexdigest()
            metas[digest] = k.meta
            d["m"] = digest
        return d
    assert isinstance(s, WeightsSource), "a device-only version is not saved (entry_json)"
    return {"v": k.version, "c": k.config_digest, "h": k.host, "w": s.path, "id": list(s.identity),
            "hb": s.header_bytes, "hc": s.header_crc, "b": base64.b64encode(s.block_crcs.packed).decode(),
            "t": s.registered_ns}


def known_from(d: dict[str, Any], metas: dict[str, bytes] | None = None) -> KnownVersion:
    if "s3" in d:
        b, key, v, etag, vid, size, hb, hc = d["s3"]
        store = StoreSource(str(b), str(key), str(v), str(etag), str(vid), int(size), int(hb), int(hc))
        meta = base64.b64decode(d["mi"]) if "mi" in d else (metas or {}).get(str(d.get("m", "")), b"")
        return KnownVersion(str(d["v"]), str(d["c"]), str(d["h"]), store, meta)
    source = WeightsSource(str(d["w"]), str(d["v"]), FileIdentity(*map(int, d["id"])), int(d["hb"]), int(d["hc"]),
                           BlockCrcs(base64.b64decode(d["b"])), int(d["t"]))
    return KnownVersion(str(d["v"]), str(d["c"]), str(d["h"]), source)


def entry_json(name: str, path: str, current: AdapterSpec, older: list[AdapterSpec],
               metas: dict[str, bytes] | None = None) -> bytes | None:
    """One entry's encoding (its store metadata into ``metas``); None for a spec not read from disk (a
    simulator's): nothing to prove it by. A device push's version whose node copy has not landed is left out (no
    file to take it from after a restart, ``device_source``): the newest version kept before it is saved current."""
    older = [s for s in older if not s.device_only]
    if current.device_only:
        if not older:
            return None
        current = older.pop()
        path = str(current.path)
    versions = [(path, current), *((str(s.path), s) for s in older)]
    if any(s.known is None for _, s in versions):
        return None
    return json.dumps([name, [[p, known_json(s.known, metas)] for p, s in versions]],  # type: ignore[arg-type]
                      separators=(",", ":")).encode()


def join(fragments: Iterable[bytes], metas: dict[str, bytes] | None = None) -> bytes:
    table = json.dumps({k: base64.b64encode(v).decode() for k, v in (metas or {}).items()},
                       separators=(",", ":")).encode()
    return zlib.compress(b'{"format":%d,"metas":%s,"entries":[' % (FORMAT, table) + b",".join(fragments) + b"]}", 1)


def decode(data: bytes) -> list[SavedEntry]:
    """A snapshot's entries; ValueError (or KeyError, TypeError) for one this controller cannot read."""
    state = json.loads(zlib.decompress(data))
    if not isinstance(state, dict) or state.get("format") != FORMAT:
        raise ValueError(f"catalog snapshot has format {state.get('format') if isinstance(state, dict) else state!r}, "
                         f"this controller reads {FORMAT}")
    metas = {str(k): base64.b64decode(v) for k, v in state.get("metas", {}).items()}
    out = []
    for name, versions in state["entries"]:
        saved = [SavedVersion(str(p), known_from(k, metas)) for p, k in versions]
        out.append(SavedEntry(str(name), saved[0], tuple(saved[1:])))
    return out


class CatalogSnapshots:
    """The catalog's snapshot, re-encoding only the entries that changed since the last one (a 10,000-adapter
    catalog is a few MB; one registration changes one entry). ``take`` runs on a thread, one at a time."""

    def __init__(self) -> None:
        self._fragments: dict[str, tuple[tuple[str, tuple[str, ...]], bytes | None, dict[str, bytes]]] = {}
        # name -> (key, encoding, its store metadata by digest)
        self.writes = 0
        self.bytes = 0  # the last snapshot's size

    def take(self, catalog: AdapterCatalog, paths: dict[str, str]) -> bytes:
        """The snapshot of ``catalog``, each entry with its registered path in ``paths`` (on a thread: the GIL is
        let go every ``YIELD_EVERY`` entries, so that the event loop answers meanwhile)."""
        fragments: dict[str, tuple[tuple[str, tuple[str, ...]], bytes | None, dict[str, bytes]]] = {}
        for n, (current, older) in enumerate(catalog.entries()):
            if n % YIELD_EVERY == YIELD_EVERY - 1:
                time.sleep(0)
            name, path = current.name, paths.get(current.name, str(current.path))
            # a device version's node copy landing changes its entry, not its version: marked apart
            key = (path, tuple(s.version + "~" * s.device_only for s in (current, *older)))
            cached = self._fragments.get(name)
            if cached is not None and cached[0] == key:
                fragments[name] = cached
            else:
                metas: dict[str, bytes] = {}
                fragments[name] = (key, entry_json(name, path, current, older, metas), metas)
        self._fragments = fragments
        table: dict[str, bytes] = {}
        for _, _, metas in fragments.values():
            table.update(metas)  # one copy of each distinct metadata blob (the entries share the bytes objects)
        data = join((f for _, f, _ in fragments.values() if f is not None), table)
        self.bytes = len(data)
        return data


def read_saved(core: ControllerCore, saved: list[SavedEntry]) -> Restored:
    """Every saved entry read again from its files, with what was saved as the version's proof (a file that is
    provably the one hashed is not read again). Changes nothing: run it on a thread, then ``apply``."""
    entries, unchanged, rehashed, changed, refused, dropped = [], 0, 0, 0, 0, 0
    for entry in saved:
        try:
            current = _read(core, entry.name, entry.current)
        except (LoraCacheError, OSError) as e:
            log.warning("adapter %s (%s) was not restored: %s; register it again once its files are in place",
                        entry.name, entry.current.path, e)
            refused += 1
            continue
        if (current.store or current.source) is entry.current.known.source:
            unchanged += 1
        else:
            rehashed += 1
        if current.version != entry.current.known.version:
            changed += 1
            log.warning("adapter %s changed while the controller was down: restored as version %s (it was %s)",
                        entry.name, current.version, entry.current.known.version)
        older = []
        for kept in entry.older:
            spec = _same_version(core, entry.name, kept)
            if spec is None:
                dropped += 1
            else:
                older.append(spec)
        entries.append((current, entry.current.path, older))
    return Restored(entries, unchanged, rehashed, changed, refused, dropped)


def _read(core: ControllerCore, name: str, saved: SavedVersion) -> AdapterSpec:
    """A saved version read again: a local file from its files (not its weights, if provably the same file); a
    store version from the config and header the snapshot kept, with no request to the store (its weights are
    proven by every fetch, ``If-Match`` on the ETag: an object replaced while the controller was down is
    refused there, and found by the next registration)."""
    known = saved.known
    if isinstance(known.source, StoreSource) and known.meta:
        return dataclasses.replace(core.read_adapter(name, saved.path, known, carried=True), store_meta=known.meta)
    return core.read_adapter(name, saved.path, known)


def _same_version(core: ControllerCore, name: str, kept: SavedVersion) -> AdapterSpec | None:
    """An older version again, if its files still hold exactly its bytes (else None: it is gone)."""
    try:
        spec = _read(core, name, kept)
    except (LoraCacheError, OSError) as e:
        log.info("older version %s of adapter %s is gone (%s)", kept.known.version, name, e)
        return None
    if spec.version != kept.known.version:
        log.info("older version %s of adapter %s is gone: %s now holds version %s", kept.known.version, name,
                 kept.path, spec.version)
        return None
    return spec


def apply(core: ControllerCore, restored: Restored) -> None:
    """The restored entries into the core (on the loop, before the controller acts)."""
    for current, path, older in restored.entries:
        core.add_adapter(current, path)
        for spec in older:
            core.catalog.keep(spec)
