"""``lora_apply``: the LoRA delta of one layer's (fused) projections, added in place (lifecycle step 9).

Dispatches to the Triton kernels (``sgmv`` for prefill segments, ``bgmv`` for one slot per token) or,
for CPU tensors outside the Triton interpreter, to the pure-torch reference.
"""

from __future__ import annotations

from collections.abc import Callable, Sequence

import torch

from workers.kernels import bgmv as bgmv_module
from workers.kernels import sgmv as sgmv_module
from workers.kernels.bgmv import bgmv
from workers.kernels.meta import MODES, BatchMeta, SlotMeta
from workers.kernels.reference import lora_apply_ref
from workers.kernels.sgmv import sgmv
from workers.kernels.tuning import interpreting

KERNELS: dict[str, Callable[..., None]] = {"sgmv": sgmv, "bgmv": bgmv}

__all__ = ["KERNELS", "lora_apply", "lora_apply_ref"]


def lora_apply(x: torch.Tensor, y: torch.Tensor, pool: torch.Tensor, slot_meta: SlotMeta, batch: BatchMeta,
               layer: int, modules: Sequence[str], mode: str = "auto") -> None:
    """Semantics: for every token t with slot s = batch.token_slot[t] >= 0, every module m at column c_m::

        r = slot_meta.rank[s, layer, m]                        # 0: module m not adapted by slot s
        A = pool[s, a_off:][: r * d_in].view(r, d_in)          # a_off = slot_meta.a_off[s, layer, m]
        B = pool[s, b_off:][: out_m * r].view(out_m, r)        # b_off = slot_meta.b_off[s, layer, m]
        y[t, c_m : c_m + out_m] += slot_meta.scale[s, layer, m] * (x[t] @ A.T) @ B.T

    x: [T, d_in] (the shard's input: full for column-parallel modules, in/tp for row-parallel ones);
    y: [T, sum(out_m)], the modules' shard outputs side by side in ``modules`` order. ``mode``: "sgmv"
    (prefill kernel), "bgmv" (decode kernel) or "auto" (the kernel of the BatchMeta setter used last);
    both kernels compute the same thing for either setter. One launch (sgmv) or two (bgmv) per call,
    no host sync, CUDA-graph capturable. The arguments are checked in full once per signature (shapes,
    strides, dtypes, devices, batch size: ``args.cached_plan``), then a call costs a few microseconds
    of Python besides Triton's own launches.
    """
    if mode != "auto" and mode not in MODES:
        raise ValueError(f"mode must be 'auto', 'sgmv' or 'bgmv', got {mode!r}")
    if not (isinstance(x, torch.Tensor) and x.is_cuda):  # CPU tensors (non-tensors: the reference names them)
        if not interpreting():
            lora_apply_ref(x, y, pool, slot_meta, batch, layer, modules)
            return
        _check_interpreted()
    if mode == "auto":
        if batch.mode is None:
            raise ValueError("BatchMeta is empty: call set_segments (prefill) or set_tokens (decode) first")
        mode = batch.mode
    KERNELS[mode](x, y, pool, slot_meta, batch, layer, modules)


def _check_interpreted() -> None:
    """CPU tensors under TRITON_INTERPRET need kernels that @triton.jit built for the interpreter."""
    if not (bgmv_module.BUILT_FOR_INTERPRETER and sgmv_module.BUILT_FOR_INTERPRETER):
        raise RuntimeError("TRITON_INTERPRET=1 was set after workers.kernels.lora was imported, so its kernels are "
                           "built for the GPU and cannot run on CPU tensors: set TRITON_INTERPRET=1 before the import "
                           "(or unset it to run the torch reference on the CPU)")
