"""Pinning a shared host arena (issue 30 item 3), ``python -m bench.probes.cold_read --arena-pin GIB``.

A split of ``cold_read.py`` along its seam: the cold-load probe measures loads through the worker cache; this is
a measurement of its own, run alone: pinning an arena in place against in the background, with GPU work of a
warm-up's kind timed meanwhile, and (next round's candidate) a memfd registered piece by piece.
"""

from __future__ import annotations

import os
import statistics
import time
from collections.abc import Callable
from typing import Any

import torch


def med(xs: list[float]) -> float:
    return statistics.median(xs)


def arena_pin(nbytes: int) -> dict[str, Any]:
    """Pinning an ``nbytes`` shared arena (``workers.staging.arena.HostArena``): in place (the worker's start-up
    waited for it before issue 30 item 3), then in the background: how soon the constructor returns, how long until it
    is pinned, and what GPU work of a warm-up's kind (a small matmul and a host copy, each synchronized) costs per
    step meanwhile against after (``cudaHostRegister`` may hold a driver lock: then the overlap buys little)."""
    from workers.staging.arena import HostArena

    gpu = torch.cuda.is_available()
    out: dict[str, Any] = {"bytes": nbytes, "gpu": gpu, "device": torch.cuda.get_device_name(0) if gpu else "cpu"}
    t0 = time.perf_counter()
    arena = HostArena(nbytes, pin=True, shared=True)
    out["in_place_s"] = time.perf_counter() - t0
    arena.close()
    del arena
    a = torch.randn(256, 256, device="cuda" if gpu else "cpu")
    host = torch.zeros(1 << 16)

    def step() -> float:
        s0 = time.perf_counter()
        (a @ a).sum().item()
        host.copy_(a.flatten()[: 1 << 16].cpu())
        return (time.perf_counter() - s0) * 1e3

    for _ in range(20):
        step()
    t0 = time.perf_counter()
    arena = HostArena(nbytes, pin=True, shared=True, background=True)
    out["background_returns_s"] = time.perf_counter() - t0
    during: list[float] = []
    while arena.pin_pending:
        during.append(step())
    out["background_pinned_s"] = time.perf_counter() - t0
    out["pin_s"], out["pin_error"] = arena.pin_s, arena.pin_error
    after = [step() for _ in range(max(20, min(len(during), 2000)))]
    out["steps_during"], out["step_ms_during_p50"] = len(during), med(during) if during else 0.0
    out["step_ms_during_max"] = max(during) if during else 0.0
    out["step_ms_after_p50"], out["step_ms_after_max"] = med(after), max(after)
    arena.close()
    del arena
    if gpu:
        out["pieces"] = pinned_in_pieces(nbytes, step)
    return out


def pinned_in_pieces(nbytes: int, step: Callable[[], float], piece: int = 256 << 20) -> dict[str, Any]:
    """For the next round (not what the arena does): a memfd registered piece by piece on a thread, each piece's
    cudaHostRegister letting go of the driver between pieces, with the same GPU steps timed meanwhile; then
    whether a copy across two pieces' registrations is right and how fast it runs against one inside a piece."""
    import mmap
    import threading

    fd = os.memfd_create("lora-pin-probe", os.MFD_CLOEXEC)
    os.ftruncate(fd, nbytes)
    buf = torch.frombuffer(mmap.mmap(fd, nbytes), dtype=torch.uint8)
    codes: list[int] = []
    device = torch.cuda.current_device()

    def register() -> None:
        torch.cuda.set_device(device)
        for at in range(0, nbytes, piece):
            codes.append(int(torch.cuda.cudart().cudaHostRegister(buf.data_ptr() + at, min(piece, nbytes - at), 0)))

    t0 = time.perf_counter()
    thread = threading.Thread(target=register)
    thread.start()
    during = []
    while thread.is_alive():
        during.append(step())
    out: dict[str, Any] = {"piece_bytes": piece, "pinned_s": time.perf_counter() - t0, "codes": sorted(set(codes)),
                           "steps_during": len(during), "step_ms_during_p50": med(during) if during else 0.0,
                           "step_ms_during_max": max(during) if during else 0.0}
    n = 64 << 20
    for name, at in (("inside", piece // 4), ("across", piece - n // 2)):
        src = buf[at : at + n]
        src.copy_(torch.randint(0, 255, (n,), dtype=torch.uint8))
        dst = torch.empty(n, dtype=torch.uint8, device="cuda")
        stream = torch.cuda.Stream()
        try:
            t1 = time.perf_counter()
            with torch.cuda.stream(stream):
                dst.copy_(src, non_blocking=True)
            stream.synchronize()
            out[f"copy_{name}_GBps"] = n / (time.perf_counter() - t1) / 1e9
            out[f"copy_{name}_right"] = bool(torch.equal(dst.cpu(), src))
        except RuntimeError as e:
            out[f"copy_{name}_error"] = str(e)
    for at in range(0, nbytes, piece):
        torch.cuda.cudart().cudaHostUnregister(buf.data_ptr() + at)
    os.close(fd)
    return out
