"""One TP rank's share of a LoRA-augmented decoder: random base weights at the shape's real sizes.

Per layer: RMSNorm, fused q/k/v (column-parallel), RoPE, attention over a per-request KV cache (SDPA),
o (row-parallel) + all-reduce, RMSNorm, fused gate/up (column-parallel), SiLU gate, down (row-parallel)
+ all-reduce. The LoRA op adds each target module's delta to the base projection's output in place.
The weights are pure functions of (seed, layer) sliced per rank (``tp.py``-style, gpt-fast), so every
TP size computes the same model.

Host cost matters as much as GPU time at decode (a step launches every op of every layer from Python),
so what is the same for every layer of a step is computed once per step (``StepTables``: the RoPE rows
of the step's positions, the decode attention bias, whether the items' KV rows can be read in place),
RoPE rotates q and k in one pass, and SDPA never uses cuDNN (see ``SDPA_BACKENDS``).
"""

from __future__ import annotations

import math
from collections.abc import Callable
from typing import NamedTuple, Protocol

import torch
import torch.nn.functional as F
from torch.nn.attention import SDPBackend, sdpa_kernel

from lora_cache.adapters.shapes import MODULE_ORDER, ModelShape
from lora_cache.adapters.shards import base_slices

# the fused module groups: one base GEMM and one LoRA call each
QKV, OUT, GATE_UP, DOWN = ("q_proj", "k_proj", "v_proj"), ("o_proj",), ("gate_proj", "up_proj"), ("down_proj",)
LoraFn = Callable[[torch.Tensor, torch.Tensor, int, tuple[str, ...]], None]  # (x, y, layer, modules): y += delta
AllReduce = Callable[[torch.Tensor], None]
EPS = 1e-5
# cuDNN's SDPA builds (and caches) an execution plan per shape; a decode step's KV length is new at every
# step, so each call planned afresh: ~2 ms of CPU per call on an H200 (192 ms of 3 steps' 32 layers).
# The flash and memory-efficient kernels need no plan (math is the fallback, and the CPU's choice).
SDPA_BACKENDS = [SDPBackend.FLASH_ATTENTION, SDPBackend.EFFICIENT_ATTENTION, SDPBackend.MATH]
BIAS_ALIGN = 16  # decode bias rows padded to this many keys: the memory-efficient kernel then reads it as is


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
    """``x * rsqrt(mean(x^2) + EPS) * weight`` in float32, rounded once to x's dtype (weight: x's dtype).

    One op: torch's rms_norm upcasts half inputs itself (one fused kernel on CUDA)."""
    return F.rms_norm(x, (x.shape[-1],), weight, EPS)


class Rope:
    """Rotary embeddings (the rotate-half form of HF Llama), tables for positions 0..max_len-1."""

    def __init__(self, head_dim: int, max_len: int, theta: float, device: torch.device) -> None:
        inv = 1.0 / theta ** (torch.arange(0, head_dim, 2, dtype=torch.float64) / head_dim)
        freqs = torch.outer(torch.arange(max_len, dtype=torch.float64), inv)
        emb = torch.cat([freqs, freqs], -1)
        self.cos, self.sin = emb.cos().float().to(device), emb.sin().float().to(device)

    def rows(self, positions: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
        """cos and signed sin [T, 1, head_dim] of positions [T]: gathered once per step, used by every layer.

        rotate_half(x) * sin = roll(x, head_dim / 2) * (sin with its first half negated)."""
        half = self.cos.shape[-1] // 2
        sin = self.sin[positions]
        return self.cos[positions][:, None], torch.cat([-sin[:, :half], sin[:, half:]], -1)[:, None]

    @staticmethod
    def rotate(x: torch.Tensor, cos: torch.Tensor, signed_sin: torch.Tensor) -> torch.Tensor:
        """x [T, heads, head_dim] rotated by the rows of ``rows``: x * cos + rotate_half(x) * sin, in float32."""
        xf = x.float()
        return (xf * cos).addcmul_(xf.roll(x.shape[-1] // 2, -1), signed_sin).to(x.dtype)


class StepInputs(NamedTuple):
    """Where each item's tokens sit in the step's rows and in the KV cache."""

    prefill: bool
    spans: tuple[tuple[int, int, int], ...]  # per item: (KV row, first row in x, tokens); prefill starts at 0
    positions: torch.Tensor  # [T] int64: each token's position in its request
    rows: torch.Tensor  # [items] int64: KV row of each item
    last: torch.Tensor  # [items] int64: each item's last token in x
    kv_len: int  # decode: the longest item's length after this token


class StepTables(NamedTuple):
    """What every layer of one step shares, computed once per step (``step_tables``)."""

    rope: tuple[torch.Tensor, torch.Tensor] | None  # cos, signed sin [T, 1, head_dim] of the step's positions
    bias: torch.Tensor | None  # decode: [items, 1, 1, kv_len] 0 up to each item's position, -inf after
    kv_rows: slice | None  # decode: the items' KV rows when they are consecutive, in order: read in place


def step_tables(step: StepInputs, rope: Rope | None, dtype: torch.dtype) -> StepTables:
    rows = [row for row, _, _ in step.spans]  # none given (a captured decode step): rows are read by index
    consecutive = bool(rows) and not step.prefill and rows == list(range(rows[0], rows[0] + len(rows)))
    return StepTables(rope.rows(step.positions) if rope is not None else None,
                      None if step.prefill else decode_bias(step, dtype),
                      slice(rows[0], rows[0] + len(rows)) if consecutive else None)


def decode_bias(step: StepInputs, dtype: torch.dtype) -> torch.Tensor:
    """[items, 1, 1, kv_len] additive attention bias: key j is visible to an item at position p iff j <= p.

    Rows are padded to BIAS_ALIGN keys and sliced, so the memory-efficient SDPA kernel takes the bias as
    it is (an unaligned one is padded into a copy per call)."""
    padded = -(-step.kv_len // BIAS_ALIGN) * BIAS_ALIGN
    keys = torch.arange(padded, device=step.positions.device)
    hidden = keys[None] > step.positions[:, None]  # [items, padded]
    bias = torch.zeros(hidden.shape, dtype=dtype, device=keys.device).masked_fill_(hidden, float("-inf"))
    return bias[:, None, None, : step.kv_len]


class KVStore(Protocol):
    """Where a step's keys and values go and come from: the engine's own ``KVCache``, or its rows in the adapter
    pool (``engine.kv_rows.PooledKV``)."""

    def attend(self, layer: int, q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, step: StepInputs,
               tables: StepTables) -> torch.Tensor: ...


class KVCache:
    """Per layer [rows, kv_heads / tp, max_len, head_dim] keys and values; one row per running request."""

    def __init__(self, layers: int, rows: int, kv_heads: int, max_len: int, head_dim: int, dtype: torch.dtype,
                 device: torch.device) -> None:
        size = (rows, kv_heads, max_len, head_dim)
        self.k = [torch.zeros(size, dtype=dtype, device=device) for _ in range(layers)]
        self.v = [torch.zeros(size, dtype=dtype, device=device) for _ in range(layers)]

    def attend(self, layer: int, q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, step: StepInputs,
               tables: StepTables) -> torch.Tensor:
        """Store k, v [T, kv_heads, hd] at the step's positions; causal attention of q [T, heads, hd]."""
        kc, vc = self.k[layer], self.v[layer]
        if step.prefill:
            return attend_prefill(lambda row: (kc[row], vc[row]), q, k, v, step)
        kc[step.rows, :, step.positions], vc[step.rows, :, step.positions] = k, v
        if tables.kv_rows is not None:  # the items' rows in order: attend over a view of the cache, no copy
            keys, values = kc[tables.kv_rows, :, : step.kv_len], vc[tables.kv_rows, :, : step.kv_len]
        else:  # [items, kv_heads, kv_len, hd]
            keys = kc[:, :, : step.kv_len].index_select(0, step.rows)
            values = vc[:, :, : step.kv_len].index_select(0, step.rows)
        return attend_decode(q, keys, values, tables)


def attend_prefill(row: Callable[[int], tuple[torch.Tensor, torch.Tensor]], q: torch.Tensor, k: torch.Tensor,
                   v: torch.Tensor, step: StepInputs) -> torch.Tensor:
    """A prefill's keys and values into each item's KV row (``row``: its [kv_heads, max_len, hd] K and V), then
    causal attention over them, item by item."""
    outs = []
    for r, first, n in step.spans:
        kr, vr = row(r)
        kr[:, :n] = k[first : first + n].transpose(0, 1)
        vr[:, :n] = v[first : first + n].transpose(0, 1)
        o = F.scaled_dot_product_attention(q[first : first + n].transpose(0, 1)[None], kr[None, :, :n],
                                           vr[None, :, :n], is_causal=True, enable_gqa=True)
        outs.append(o[0].transpose(0, 1))
    return torch.cat(outs).flatten(1)


def attend_decode(q: torch.Tensor, keys: torch.Tensor, values: torch.Tensor, tables: StepTables) -> torch.Tensor:
    """One query per item over its keys and values [items, kv_heads, kv_len, hd] -> [items, heads * hd]."""
    # the `group` query heads of a KV head (h // group, as enable_gqa maps them) are that head's query rows, so
    # plain SDPA does grouped-query attention without repeating K and V
    items, kv_heads = keys.shape[:2]
    o = F.scaled_dot_product_attention(q.reshape(items, kv_heads, -1, q.shape[-1]), keys, values,
                                       attn_mask=tables.bias)
    return o.flatten(1)


class ShardedModel:
    """The decoder layers of one TP rank; ``forward`` runs one step and returns each item's output."""

    def __init__(self, shape: ModelShape, layers: list[LayerWeights], final_norm: torch.Tensor, kv: KVStore,
                 tp: int, lora: LoraFn, all_reduce: AllReduce, rope: Rope | None) -> None:
        self.shape, self.layers, self.final_norm, self.kv = shape, layers, final_norm, kv
        self.lora, self.all_reduce, self.rope = lora, all_reduce, rope
        self.heads, self.kv_heads = shape.num_heads // tp, shape.num_kv_heads // tp
        hd = shape.head_dim
        self.qkv_split = [self.heads * hd, self.kv_heads * hd, self.kv_heads * hd]

    def forward(self, x: torch.Tensor, step: StepInputs) -> torch.Tensor:
        """x [T, hidden] -> the final-normed hidden state of each item's last token [items, hidden]."""
        tables = step_tables(step, self.rope, x.dtype)
        with sdpa_kernel(SDPA_BACKENDS):  # once per step: entering it costs a few microseconds
            for i, w in enumerate(self.layers):
                x = x + self._attention(i, w, rms_norm(x, w.in_norm), step, tables)
                x = x + self._mlp(i, w, rms_norm(x, w.post_norm))
        return rms_norm(x.index_select(0, step.last), self.final_norm)

    def _attention(self, i: int, w: LayerWeights, h: torch.Tensor, step: StepInputs,
                   tables: StepTables) -> torch.Tensor:
        qkv = F.linear(h, w.qkv)  # [T, (heads + 2 kv_heads) * hd] of this rank
        self.lora(h, qkv, i, QKV)
        hd, n_q = self.shape.head_dim, self.qkv_split[0] // self.shape.head_dim
        qk = qkv[:, : self.qkv_split[0] + self.qkv_split[1]].reshape(qkv.shape[0], -1, hd)  # [T, heads + kv_heads, hd]
        if tables.rope is not None:
            qk = Rope.rotate(qk, *tables.rope)  # q and k in one pass
        v = qkv[:, self.qkv_split[0] + self.qkv_split[1] :].reshape(qkv.shape[0], -1, hd)  # a view: stored as is
        a = self.kv.attend(i, qk[:, :n_q], qk[:, n_q:], v, step, tables)  # [T, heads * hd]
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
                dtype: torch.dtype, device: torch.device, kv: KVStore, lora: LoraFn, all_reduce: AllReduce,
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
