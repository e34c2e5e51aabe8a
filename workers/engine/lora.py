"""The LoRA op of one TP rank: per-step batch metadata, then ``lora_apply`` per fused module group.

``lora_apply`` (``workers.kernels``: the Triton kernels on the GPU; on the CPU their pure-torch twin
``lora_apply_ref``, whatever ``TRITON_INTERPRET`` says, so CPU runs never pay for the interpreter) reads
the adapters straight from the worker cache's slot pool through the cache's ``meta`` (per-slot offsets,
ranks and scalings, written on the copy stream with each load): no copy, no host sync (step 9).
"""

from __future__ import annotations

from collections.abc import Callable, Sequence

import torch

from workers.attach.seam import EngineCache
from workers.gpu.chunk_waits import ChunkWaits
from workers.kernels import BatchMeta, lora_apply_ref


class LoraOp:
    """Call ``begin`` once per step, then the op once per fused module group and layer."""

    def __init__(self, cache: EngineCache, max_tokens: int, max_items: int) -> None:
        self.cache = cache
        self.apply: Callable[..., None] = lora_apply_ref
        if cache.device.type == "cuda":
            from workers.kernels import lora_apply  # imports Triton: only where the kernels run

            self.apply = lora_apply
        self.batch = BatchMeta(max_tokens, max_items, cache.device, num_slots=cache.worker.num_slots)
        self.active = False  # False: no item of this step has an adapter, the op adds nothing
        self.waits: ChunkWaits | None = None  # this step's per-layer waits on loads in flight (pipelined)

    def begin(self, slots: Sequence[int], lengths: Sequence[int], prefill: bool, stream: object = None,
              always: bool = False, waits: ChunkWaits | None = None) -> None:
        """Each item's slot (-1: no adapter) and token count, in the order of the step's rows.
        ``always``: launch the kernels even if no item has an adapter (a CUDA graph's step: the
        captured launches must be there whatever the next batch holds; the kernels skip empty tiles).
        ``waits``: the batch's loads in flight (``WorkerCache.acquire(pipelined=True)``): each layer's
        op first makes the compute stream wait on the chunk that holds that layer."""
        self.waits = waits
        self.active = always or any(s >= 0 for s in slots)
        if not self.active:
            return
        if prefill:  # SGMV: one segment per run of items with one slot (the plan groups items by adapter)
            self.batch.set_segments(*_segments(lengths, slots), stream=stream)
        else:  # BGMV: one slot per token
            self.batch.set_tokens(list(slots), stream=stream)

    def __call__(self, x: torch.Tensor, y: torch.Tensor, layer: int, modules: tuple[str, ...]) -> None:
        """y [T, sum(out)] += the LoRA delta of ``modules`` for x [T, in] (this rank's shards)."""
        if self.waits is not None:
            self.waits.before(layer)
        if self.active:
            self.apply(x, y, self.cache.pool, self.cache.meta, self.batch, layer, modules)


def _segments(lengths: Sequence[int], slots: Sequence[int]) -> tuple[list[int], list[int]]:
    seg_lens: list[int] = []
    seg_slots: list[int] = []
    for n, s in zip(lengths, slots):
        if seg_slots and seg_slots[-1] == s:
            seg_lens[-1] += n
        else:
            seg_lens.append(n)
            seg_slots.append(s)
    return seg_lens, seg_slots
