"""One TP rank's share of a LoRA-augmented decoder: random base weights at the shape's real sizes.

Per layer: RMSNorm, fused q/k/v (column-parallel), RoPE, attention over a per-request KV cache (SDPA),
o (row-parallel) + all-reduce, RMSNorm, fused gate/up (column-parallel), SiLU gate, down (row-parallel)
+ all-reduce. The LoRA op adds each target module's delta to the base projection's output in place.
The weights are pure functions of (seed, layer) sliced per rank (``tp.py``-style, gpt-fast), so every
TP size computes the same model.
"""

from __future__ import annotations

import math
from collections.abc import Callable
from typing import NamedTuple

import torch
import torch.nn.functional as F

from lora_cache.shapes import MODULE_ORDER, ModelShape
from lora_cache.shards import base_slices

# the fused module groups: one base GEMM and one LoRA call each
QKV, OUT, GATE_UP, DOWN = ("q_proj", "k_proj", "v_proj"), ("o_proj",), ("gate_proj", "up_proj"), ("down_proj",)
LoraFn = Callable[[torch.Tensor, torch.Tensor, int, tuple[str, ...]], None]  # (x, y, layer, modules): y += delta
AllReduce = Callable[[torch.Tensor], None]
EPS = 1e-5


class LayerWeights(NamedTuple):
    """One rank's shard of one layer; projections are [out, in] like nn.Linear."""

    in_norm: torch.Tensor  # [hidden]
    qkv: torch.Tensor  # [(heads + 2 * kv_heads) / tp * head_dim, hidden]: q, k, v rows of this rank
    o: torch.Tensor  # [hidden, heads / tp * head_dim]: this rank's input columns
    post_norm: torch.Tensor  # [hidden]
    gate_up: torch.Tensor  # [2 * intermediate / tp, hidden]: gate rows, then up rows
    down: torch.Tensor  # [hidden, intermediate / tp]


def full_weights(shape: ModelShape, seed: int, layer: int, device: torch.device) -> dict[str, torch.Tensor]:
    """The whole (unsharded) layer in float32: module -> [out, in], plus the two norm weights."""
    gen = torch.Generator(device=device).manual_seed(seed * 100_003 + layer)
    out = {}
    for module in MODULE_ORDER:
        d_in, d_out = shape.dims(module)
        out[module] = torch.randn(d_out, d_in, generator=gen, device=device) / math.sqrt(d_in)
    for norm in ("in_norm", "post_norm"):
        out[norm] = 1 + 0.1 * torch.randn(shape.hidden_size, generator=gen, device=device)
    return out


def shard_weights(full: dict[str, torch.Tensor], tp: int, rank: int, dtype: torch.dtype) -> LayerWeights:
    """Megatron split: column-parallel modules keep rows of [out, in], row-parallel ones columns."""
    part = {}
    for module in MODULE_ORDER:
        w = full[module]  # [out, in]
        ins, outs = base_slices(module, w.shape[1], w.shape[0], tp, rank)
        part[module] = w[outs, ins]
    cast = lambda t: t.to(dtype).contiguous()  # noqa: E731
    return LayerWeights(cast(full["in_norm"]), cast(torch.cat([part[m] for m in QKV])), cast(part["o_proj"]),
                        cast(full["post_norm"]), cast(torch.cat([part[m] for m in GATE_UP])), cast(part["down_proj"]))


def prompt_states(seed: int, rid: int, length: int, hidden: int, device: torch.device) -> torch.Tensor:
    """A request's prompt embeddings [length, hidden] (float32): the same on every rank of one device kind."""
    gen = torch.Generator(device=device).manual_seed(seed * 1_000_003 + rid + 1)
    return torch.randn(length, hidden, generator=gen, device=device)


def rms_norm(x: torch.Tensor, weight: torch.Tensor) -> torch.Tensor:
    xf = x.float()
    return (xf * torch.rsqrt(xf.pow(2).mean(-1, keepdim=True) + EPS) * weight.float()).to(x.dtype)


class Rope:
    """Rotary embeddings (the rotate-half form of HF Llama), tables for positions 0..max_len-1."""

    def __init__(self, head_dim: int, max_len: int, theta: float, device: torch.device) -> None:
        inv = 1.0 / theta ** (torch.arange(0, head_dim, 2, dtype=torch.float64) / head_dim)
        freqs = torch.outer(torch.arange(max_len, dtype=torch.float64), inv)
        emb = torch.cat([freqs, freqs], -1)
        self.cos, self.sin = emb.cos().float().to(device), emb.sin().float().to(device)

    def __call__(self, x: torch.Tensor, positions: torch.Tensor) -> torch.Tensor:
        """x [T, heads, head_dim] at positions [T]."""
        cos, sin = self.cos[positions][:, None], self.sin[positions][:, None]
        x1, x2 = x.float().chunk(2, -1)
        return (x.float() * cos + torch.cat([-x2, x1], -1) * sin).to(x.dtype)


class StepInputs(NamedTuple):
    """Where each item's tokens sit in the step's rows and in the KV cache."""

    prefill: bool
    spans: tuple[tuple[int, int, int], ...]  # per item: (KV row, first row in x, tokens); prefill starts at 0
    positions: torch.Tensor  # [T] int64: each token's position in its request
    rows: torch.Tensor  # [items] int64: KV row of each item
    last: torch.Tensor  # [items] int64: each item's last token in x
    kv_len: int  # decode: the longest item's length after this token


class KVCache:
    """Per layer [rows, kv_heads / tp, max_len, head_dim] keys and values; one row per running request."""

    def __init__(self, layers: int, rows: int, kv_heads: int, max_len: int, head_dim: int, dtype: torch.dtype,
                 device: torch.device) -> None:
        size = (rows, kv_heads, max_len, head_dim)
        self.k = [torch.zeros(size, dtype=dtype, device=device) for _ in range(layers)]
        self.v = [torch.zeros(size, dtype=dtype, device=device) for _ in range(layers)]

    def attend(self, layer: int, q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, step: StepInputs) -> torch.Tensor:
        """Store k, v [T, kv_heads, hd] at the step's positions; causal attention of q [T, heads, hd]."""
        kc, vc = self.k[layer], self.v[layer]
        if step.prefill:
            outs = []
            for row, first, n in step.spans:
                kc[row, :, :n] = k[first : first + n].transpose(0, 1)
                vc[row, :, :n] = v[first : first + n].transpose(0, 1)
                o = F.scaled_dot_product_attention(q[first : first + n].transpose(0, 1)[None], kc[row : row + 1, :, :n],
                                                   vc[row : row + 1, :, :n], is_causal=True, enable_gqa=True)
                outs.append(o[0].transpose(0, 1))
            return torch.cat(outs).flatten(1)
        kc[step.rows, :, step.positions], vc[step.rows, :, step.positions] = k, v
        keys = kc[:, :, : step.kv_len].index_select(0, step.rows)  # [items, kv_heads, kv_len, hd]
        values = vc[:, :, : step.kv_len].index_select(0, step.rows)
        mask = torch.arange(step.kv_len, device=q.device)[None] <= step.positions[:, None]
        o = F.scaled_dot_product_attention(q[:, :, None], keys, values, attn_mask=mask[:, None, None], enable_gqa=True)
        return o[:, :, 0].flatten(1)


class ShardedModel:
    """The decoder layers of one TP rank; ``forward`` runs one step and returns each item's output."""

    def __init__(self, shape: ModelShape, layers: list[LayerWeights], final_norm: torch.Tensor, kv: KVCache,
                 tp: int, lora: LoraFn, all_reduce: AllReduce, rope: Rope | None) -> None:
        self.shape, self.layers, self.final_norm, self.kv = shape, layers, final_norm, kv
        self.lora, self.all_reduce, self.rope = lora, all_reduce, rope
        self.heads, self.kv_heads = shape.num_heads // tp, shape.num_kv_heads // tp
        hd = shape.head_dim
        self.qkv_split = [self.heads * hd, self.kv_heads * hd, self.kv_heads * hd]

    def forward(self, x: torch.Tensor, step: StepInputs) -> torch.Tensor:
        """x [T, hidden] -> the final-normed hidden state of each item's last token [items, hidden]."""
        for i, w in enumerate(self.layers):
            x = x + self._attention(i, w, rms_norm(x, w.in_norm), step)
            x = x + self._mlp(i, w, rms_norm(x, w.post_norm))
        return rms_norm(x.index_select(0, step.last), self.final_norm)

    def _attention(self, i: int, w: LayerWeights, h: torch.Tensor, step: StepInputs) -> torch.Tensor:
        qkv = F.linear(h, w.qkv)  # [T, (heads + 2 kv_heads) * hd] of this rank
        self.lora(h, qkv, i, QKV)
        hd = self.shape.head_dim
        q, k, v = (t.reshape(t.shape[0], -1, hd) for t in qkv.split(self.qkv_split, -1))
        if self.rope is not None:
            q, k = self.rope(q, step.positions), self.rope(k, step.positions)
        a = self.kv.attend(i, q, k, v.contiguous(), step)  # [T, heads * hd]
        o = F.linear(a, w.o)  # partial sum over this rank's heads
        self.lora(a, o, i, OUT)
        self.all_reduce(o)
        return o

    def _mlp(self, i: int, w: LayerWeights, h: torch.Tensor) -> torch.Tensor:
        gu = F.linear(h, w.gate_up)
        self.lora(h, gu, i, GATE_UP)
        gate, up = gu.chunk(2, -1)
        m = F.silu(gate) * up
        d = F.linear(m, w.down)  # partial sum over this rank's intermediate features
        self.lora(m, d, i, DOWN)
        self.all_reduce(d)
        return d


def build_model(shape: ModelShape, num_layers: int, *, tp: int, rank: int, seed: int, share: bool,
                dtype: torch.dtype, device: torch.device, kv: KVCache, lora: LoraFn, all_reduce: AllReduce,
                rope: Rope | None) -> ShardedModel:
    """Random weights for ``num_layers`` layers (one set reused if ``share``), sliced for ``rank``."""
    layers: list[LayerWeights] = []
    for i in range(num_layers):
        layers.append(layers[0] if share and layers else shard_weights(full_weights(shape, seed, i, device),
                                                                        tp, rank, dtype))
    final_norm = final_norm_weight(shape, seed, device).to(dtype)
    return ShardedModel(shape, layers, final_norm, kv, tp, lora, all_reduce, rope)


def final_norm_weight(shape: ModelShape, seed: int, device: torch.device) -> torch.Tensor:
    gen = torch.Generator(device=device).manual_seed(seed * 100_003 - 1)
    return 1 + 0.1 * torch.randn(shape.hidden_size, generator=gen, device=device)
