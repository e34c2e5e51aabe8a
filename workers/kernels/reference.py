"""The pure-torch twin of the LoRA kernels: the tests' reference and the CPU path.

It reads the same pool and the host mirrors of the same metadata, groups tokens by slot and computes
in float32, rounding once into ``y``'s dtype like the kernels do.
"""

from __future__ import annotations

from collections.abc import Sequence

import numpy as np
import torch

from workers.kernels.args import check_launch
from workers.kernels.meta import MODES, BatchMeta, SlotMeta


def lora_apply_ref(x: torch.Tensor, y: torch.Tensor, pool: torch.Tensor, slot_meta: SlotMeta, batch: BatchMeta,
                   layer: int, modules: Sequence[str], mode: str = "auto") -> None:
    """Semantics: the same as ``lora_apply``; for every module m at column c_m, token t with slot s >= 0::

        A = pool[s, a_off[s, layer, m] :][: r * d_in].view(r, d_in)      # r = rank[s, layer, m] > 0
        B = pool[s, b_off[s, layer, m] :][: out_m * r].view(out_m, r)
        y[t, c_m : c_m + out_m] += scale[s, layer, m] * (x[t] @ A.T) @ B.T

    ``mode`` is accepted for symmetry with ``lora_apply``; the result does not depend on it.
    """
    if mode != "auto" and mode not in MODES:
        raise ValueError(f"mode must be 'auto', 'sgmv' or 'bgmv', got {mode!r}")
    launch = check_launch(x, y, pool, slot_meta, batch, layer, modules)
    slots = batch.host_token_slot
    for s in np.unique(slots[slots >= 0]).tolist():
        rows = _rows(np.flatnonzero(slots == s), x.device)
        xs = x[rows].float()
        for f in range(launch.fused):
            i = (s, layer, launch.midx[f])
            r = int(slot_meta.host_rank[i])
            if r == 0:
                continue
            out, col = launch.outs[f], launch.cols[f]
            a_off, b_off = int(slot_meta.host_a_off[i]), int(slot_meta.host_b_off[i])
            a = pool[s, a_off : a_off + r * launch.d_in].view(r, launch.d_in).float()
            b = pool[s, b_off : b_off + out * r].view(out, r).float()
            delta = (xs @ a.T) @ b.T * float(slot_meta.host_scale[i])
            y[rows, col : col + out] = (y[rows, col : col + out].float() + delta).to(y.dtype)


def _rows(idx: np.ndarray, device: torch.device) -> slice | torch.Tensor:
    """A slice when the slot's tokens are contiguous (a segment), else an index tensor."""
    if idx[-1] - idx[0] + 1 == len(idx):
        return slice(int(idx[0]), int(idx[-1]) + 1)
    return torch.from_numpy(idx).to(device)
