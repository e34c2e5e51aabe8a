"""The LoRA kernel reads the admitted version's bytes: two versions of one adapter resident side by side.

A request admitted on version v0 holds its slot while the adapter is re-registered as v1; a batch then
runs one token on each version. Each token's LoRA delta must equal the one computed in fp32 from that
version's own file (and differ from the other version's). On the GPU through the Triton kernels (marker
``gpu``), on the CPU through their torch twin (the same pool, slot metadata and batch metadata).
"""

from __future__ import annotations

from pathlib import Path

import pytest
import torch
from safetensors import safe_open

from lora_cache.adapters.catalog import AdapterCatalog, CatalogConfig
from lora_cache.adapters.peft import AdapterSpec, peft_key
from lora_cache.adapters.shapes import MODULE_ORDER, SHAPES
from lora_cache.adapters.synth import write_adapter
from lora_cache.vocab import AdapterKey
from workers.cache import WorkerCache, WorkerConfig
from workers.kernels import BatchMeta, lora_apply_ref
from workers.staging.host_config import HostTierConfig

TINY = SHAPES["tiny"]
LAYER, MODULES = 1, ("q_proj", "k_proj", "v_proj")  # one fused group: columns side by side

DEVICES = [pytest.param("cpu", id="cpu-reference"),
           pytest.param("cuda", id="gpu-triton", marks=[pytest.mark.gpu, pytest.mark.skipif(
               not torch.cuda.is_available(), reason="needs a CUDA GPU")])]


def expected_delta(spec: AdapterSpec, x: torch.Tensor) -> torch.Tensor:
    """x [in] -> the LoRA delta of ``MODULES`` at ``LAYER``, in fp32 from the version's own file."""
    scale = {(m.layer, m.module): m.scaling for m in spec.modules}
    out = []
    with safe_open(str(spec.weights), framework="pt") as f:
        for module in MODULES:
            a = f.get_tensor(peft_key(LAYER, module, "A")).float()
            b = f.get_tensor(peft_key(LAYER, module, "B")).float()
            out.append(scale[(LAYER, module)] * (x.float() @ a.T) @ b.T)
    return torch.cat(out)


@pytest.mark.parametrize("device", DEVICES)
def test_the_kernel_reads_each_request_s_own_version(tmp_path: Path, device: str) -> None:
    for v, rank in enumerate((8, 16)):
        write_adapter(tmp_path / f"a-v{v}", TINY, rank, 2.0 * rank, list(MODULE_ORDER), torch.bfloat16,
                      torch.Generator().manual_seed(7 + v))
    catalog = AdapterCatalog(CatalogConfig(adapter_roots=(str(tmp_path),), model="tiny", max_rank=16))
    v0 = catalog.register("a", tmp_path / "a-v0")
    cache = WorkerCache(WorkerConfig(num_slots=3, device=device, dtype="bfloat16",
                                     host=HostTierConfig(host_bytes=8 << 20, pin=device == "cuda")), catalog)
    try:
        running = cache.acquire([AdapterKey("a", v0.version)])  # a request admitted on v0, still running
        v1 = catalog.register("a", tmp_path / "a-v1")
        batch = cache.acquire([AdapterKey("a", v0.version), AdapterKey("a", v1.version)])
        assert batch.keys == (AdapterKey("a", v0.version), AdapterKey("a", v1.version))
        assert batch.slots[0] == running.slots[0] != batch.slots[1]
        apply = lora_apply_ref
        if device == "cuda":
            from workers.kernels import lora_apply

            apply = lora_apply
        x = torch.randn(2, TINY.hidden_size, generator=torch.Generator().manual_seed(0))
        width = sum(TINY.dims(m)[1] for m in MODULES)
        y = torch.zeros(2, width, dtype=cache.dtype, device=cache.device)
        meta = BatchMeta(2, 2, cache.device, num_slots=3)
        meta.set_tokens(list(batch.slots))
        apply(x.to(cache.device, cache.dtype), y, cache.pool, cache.meta, meta, LAYER, MODULES)
        got = y.float().cpu()
        want = [expected_delta(spec, x[t].to(torch.bfloat16)) for t, spec in enumerate((v0, v1))]
        for t, spec in enumerate((v0, v1)):
            tol = 0.05 * float(want[t].abs().max()) + 1e-3  # bf16 slots and products
            assert torch.allclose(got[t], want[t], atol=tol, rtol=0.05), f"token {t} did not read {spec.version}"
            other = want[1 - t]
            assert float((got[t] - other).abs().max()) > 10 * tol, f"token {t} is as close to the other version"
        cache.release(batch)
        cache.release(running)
        cache.check_integrity()
    finally:
        cache.close()
