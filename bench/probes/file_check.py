"""What a read's proof of its version costs: one rank's shard of a rank-16 Llama-3.1-8B adapter, read warm
from the page cache, with each ``verify`` mode against the copy alone (no check at all), and what
registration pays to take the CRCs (docs/decisions.md, "A version is the bytes it hashed"); and for an identity
version, registration against the first read on the machine, which pins the content (``identity``).

    python -m bench.probes.file_check --dir /tmp/filecheck --trials 7
"""

from __future__ import annotations

import argparse
import json
import statistics
import time
from pathlib import Path

import torch

from lora_cache.adapters.catalog import AdapterCatalog, CatalogConfig
from lora_cache.adapters.peft import AdapterSpec
from lora_cache.adapters.shards import ShardLayout, shard_layout
from lora_cache.adapters.synth import SynthConfig, make_adapters
from workers.reads.proof import tensor_index
from workers.reads.shard import _copy_slices, _mapped, read_shard


def unchecked(spec: AdapterSpec, layout: ShardLayout, dest: torch.Tensor) -> int:
    """The copy alone: the mapped file's slices into ``dest``, no stat, no header or block check."""
    assert spec.source is not None
    index = tensor_index(spec.source.path, spec.version, spec.file_bytes)
    with open(spec.source.path, "rb") as f, _mapped(f.fileno()) as mapped:
        return _copy_slices(mapped, index, layout.entries, dest)


def _reader(kind: str, spec: AdapterSpec, layout: ShardLayout, dest: torch.Tensor) -> object:
    if kind == "unchecked":
        return lambda: unchecked(spec, layout, dest)
    return lambda: read_shard(spec, layout, dest, kind)


def timed_ms(fn: object) -> float:
    t0 = time.perf_counter()
    fn()  # type: ignore[operator]
    return (time.perf_counter() - t0) * 1e3


def main(argv: list[str] | None = None) -> dict[str, object]:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--dir", default="/tmp/lora-cache-filecheck", help="where the adapter is written")
    ap.add_argument("--trials", type=int, default=15)
    ap.add_argument("--rank", type=int, default=16)
    args = ap.parse_args(argv)
    root = Path(args.dir)
    if not (root / "adapter-000").is_dir():
        make_adapters(root, SynthConfig(model="llama-3.1-8b", count=1, rank=str(args.rank)))
    catalog = AdapterCatalog(CatalogConfig(adapter_roots=(str(root),), model="llama-3.1-8b", max_rank=64,
                                           local_versions="content"))
    register_ms = statistics.median(timed_ms(lambda: catalog.register("a", "adapter-000")) for _ in range(3))
    spec = catalog.get("a")
    assert spec.source is not None
    rows: list[dict[str, float]] = []
    out: dict[str, object] = {"file_mb": spec.file_bytes / 1e6, "register_ms": register_ms,
                              "racy": spec.source.racy, "rows": rows}
    for tp in (1, 2):
        layout = shard_layout(spec, catalog.shape, tp, 0, torch.bfloat16)
        dest = torch.empty(layout.numel, dtype=torch.bfloat16)
        unchecked(spec, layout, dest)  # warm: page cache, the header parsed
        row: dict[str, float] = {"tp": tp, "shard_mb": layout.nbytes / 1e6}
        times: dict[str, list[float]] = {k: [] for k in ("unchecked", "identity", "sample", "content")}
        for _ in range(args.trials):  # interleaved: drift on a shared machine hits every kind alike
            for kind, ms in times.items():
                ms.append(timed_ms(_reader(kind, spec, layout, dest)))
        row.update({k: statistics.median(ms) for k, ms in times.items()})
        rows.append(row)
    out["identity"] = identity_versions(root, catalog, args.trials)
    print(json.dumps(out, indent=1))
    return out


def identity_versions(root: Path, content: AdapterCatalog, trials: int) -> dict[str, float]:
    """What an identity version moves from registration to the first read on the machine: its registration
    (config and header only) against a content version's (every byte hashed), and the TP-2 rank-0 read
    (``sample``) that pins the content (every block CRC'd, the pin published) against a later read."""
    import os
    import tempfile

    from workers.reads import proof

    weights = root / "adapter-000" / "adapter_model.safetensors"
    time.sleep(max(0.0, 2.2 - (time.time() - weights.stat().st_ctime)))  # settled: else it is hashed in full
    catalog = AdapterCatalog(CatalogConfig(adapter_roots=(str(root),), model="llama-3.1-8b", max_rank=64,
                                           local_versions="identity"))
    content_ms = statistics.median(timed_ms(lambda: content.register("c", "adapter-000")) for _ in range(3))
    register_ms = statistics.median(timed_ms(lambda k=k: catalog.register(f"i{k}", "adapter-000"))
                                    for k in range(3))
    spec = catalog.get("i0")
    assert spec.source is not None and not spec.source.pinned, "not an identity version: is the file settled?"
    layout = shard_layout(spec, catalog.shape, 2, 0, torch.bfloat16)
    dest = torch.empty(layout.numel, dtype=torch.bfloat16)
    first, later = [], []
    for _ in range(trials):
        os.environ["LORA_CACHE_PIN_DIR"] = tempfile.mkdtemp(prefix="lora-cache-pins-probe-")
        proof._PINS.clear()  # a machine where no read pinned it yet
        first.append(timed_ms(lambda: read_shard(spec, layout, dest, "sample")))
        later.append(timed_ms(lambda: read_shard(spec, layout, dest, "sample")))
    return {"register_content_ms": content_ms, "register_identity_ms": register_ms,
            "first_read_tp2_ms": statistics.median(first), "later_read_tp2_ms": statistics.median(later)}


if __name__ == "__main__":
    main()
