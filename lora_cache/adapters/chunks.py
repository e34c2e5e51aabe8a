"""The chunk plan of a packed shard: layer-ordered pieces copied (and read) one after another.

A shard keeps its one contiguous layout (``shards.py``: matrices in layer, module, A then B order), but
its load is issued as a few copies of consecutive element ranges, each holding whole layers and each at
least ``min_bytes`` where the shard allows (>= 4 MB runs at the pinned-copy peak; ARCHITECTURE facts),
with an event per chunk. The LoRA op of layer l then waits only on the chunk that holds layer l
(lifecycle steps 6 and 9, ``workers.gpu.chunk_waits``). Plain Python over the layout, tested on the CPU.
"""

from __future__ import annotations

from collections.abc import Sequence
from typing import NamedTuple

from lora_cache.adapters.shards import ShardEntry
from lora_cache.errors import ConfigError

MIN_CHUNK_BYTES = 4 << 20  # a pinned H2D copy of >= 4 MB runs at 53-55 GB/s on the H200 (1 MB: 40 GB/s)


class Chunk(NamedTuple):
    """Consecutive whole layers of a shard: elements ``start:stop``, entries ``first:last`` of the layout."""

    seq: int  # its place in the plan, from 0
    layers: range  # the layers whose matrices it holds
    start: int  # element offset in the packed shard
    stop: int  # exclusive; the next chunk's start (alignment padding included), or the shard's numel
    entries: slice  # which of the layout's entries it holds

    @property
    def numel(self) -> int:
        return self.stop - self.start


class ChunkPlan(NamedTuple):
    """The chunks of one shard, and for each layer of the model the chunk its LoRA op waits on."""

    chunks: tuple[Chunk, ...]
    layer_chunk: tuple[int, ...]  # layer -> chunk index (a layer the adapter skips: the chunk before it, or 0)

    def chunk_of(self, layer: int) -> int:
        return self.layer_chunk[layer]

    @property
    def entry_spans(self) -> tuple[slice, ...]:
        """Each chunk's range of layout entries: what a reader reads (and reports) one chunk at a time."""
        return tuple(c.entries for c in self.chunks)


def chunk_plan(entries: Sequence[ShardEntry], numel: int, num_layers: int, elem_bytes: int,
               min_bytes: int = MIN_CHUNK_BYTES) -> ChunkPlan:
    """Cut a layout's entries (layer-ordered, as ``shard_layout`` packs them) into chunks of whole layers.

    A chunk closes at the first layer boundary at which it holds >= ``min_bytes``; a last chunk smaller
    than that joins the one before it, so every chunk is >= ``min_bytes`` unless the shard is smaller.
    ``min_bytes`` 0: one chunk per adapted layer; a shard with no entries is one empty chunk."""
    if min_bytes < 0:
        raise ConfigError(f"chunk min_bytes must be >= 0 (0: a chunk per layer), got {min_bytes}")
    if num_layers < 1:
        raise ConfigError(f"chunk plan needs num_layers >= 1, got {num_layers}")
    bounds = _layer_bounds(entries, num_layers)  # (layer, first entry index) where each layer starts
    cuts: list[int] = [0]  # indices into bounds where chunks start
    for i in range(1, len(bounds)):
        held = entries[bounds[i][1]].offset - entries[bounds[cuts[-1]][1]].offset
        if held * elem_bytes >= min_bytes:
            cuts.append(i)
    if len(cuts) > 1 and (numel - entries[bounds[cuts[-1]][1]].offset) * elem_bytes < min_bytes:
        cuts.pop()  # a short tail joins the chunk before it
    return _plan(entries, numel, num_layers, bounds, cuts)


def _layer_bounds(entries: Sequence[ShardEntry], num_layers: int) -> list[tuple[int, int]]:
    bounds: list[tuple[int, int]] = []
    for i, e in enumerate(entries):
        if not 0 <= e.layer < num_layers:
            raise ConfigError(f"shard entry {e.key} is in layer {e.layer}, outside 0..{num_layers - 1}")
        if bounds and e.layer < bounds[-1][0]:
            raise ConfigError(f"shard entries are not in layer order ({e.key} after layer {bounds[-1][0]}); "
                              "build the layout with shards.shard_layout")
        if not bounds or e.layer != bounds[-1][0]:
            bounds.append((e.layer, i))
    return bounds


def _plan(entries: Sequence[ShardEntry], numel: int, num_layers: int, bounds: list[tuple[int, int]],
          cuts: list[int]) -> ChunkPlan:
    if not bounds:
        return ChunkPlan((Chunk(0, range(0), 0, numel, slice(0, 0)),), (0,) * num_layers)
    chunks = []
    for k, first in enumerate(cuts):
        last = cuts[k + 1] if k + 1 < len(cuts) else len(bounds)  # bounds index past this chunk
        e0 = bounds[first][1]
        e1 = bounds[last][1] if last < len(bounds) else len(entries)
        stop = entries[e1].offset if e1 < len(entries) else numel
        layers = range(bounds[first][0], bounds[last - 1][0] + 1)
        chunks.append(Chunk(k, layers, 0 if k == 0 else entries[e0].offset, stop, slice(e0, e1)))
    layer_chunk, k = [], 0
    for layer in range(num_layers):
        while k + 1 < len(chunks) and chunks[k + 1].layers.start <= layer:
            k += 1
        layer_chunk.append(k)
    return ChunkPlan(tuple(chunks), tuple(layer_chunk))
