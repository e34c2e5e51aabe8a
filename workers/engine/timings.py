"""Per-request timings and the summary, with SGLang ``bench_serving`` field names."""

from __future__ import annotations

from collections.abc import Sequence
from dataclasses import dataclass, field

import numpy as np
import torch


@dataclass(frozen=True)
class RequestRecord:
    """What happened to one request; times in seconds since the engine started serving."""

    rid: int
    adapter: str | None
    input_len: int
    output_len: int
    arrival_s: float
    prefill_s: float | None  # start of its prefill step (None: never admitted)
    token_s: tuple[float, ...]  # when each output token was ready; token_s[0] is the first token
    load_wait_s: float  # time it spent waiting on adapter loads (in blocked steps, or held back by admission)
    error: str | None = None
    outputs: torch.Tensor | None = field(default=None, repr=False)  # [tokens, hidden] float32, if recorded
    version: str | None = None  # the adapter version it was admitted with, on every rank (None: unversioned)
    received_s: float | None = None  # a streamed submit's: when rank 0's feed got it (this clock); None: given up front

    @property
    def ok(self) -> bool:
        return self.error is None and len(self.token_s) == self.output_len

    @property
    def ttft_s(self) -> float:
        return self.token_s[0] - self.arrival_s

    @property
    def e2e_s(self) -> float:
        return self.token_s[-1] - self.arrival_s

    @property
    def tpot_s(self) -> float | None:
        """Mean time per output token after the first (None for one-token outputs)."""
        n = len(self.token_s)
        return (self.token_s[-1] - self.token_s[0]) / (n - 1) if n > 1 else None

    @property
    def itl_s(self) -> list[float]:
        return [b - a for a, b in zip(self.token_s, self.token_s[1:])]


PERCENTILES = (90, 99)


def _stats(prefix: str, values_s: Sequence[float], percentiles: tuple[int, ...] = PERCENTILES) -> dict[str, float]:
    ms = np.asarray(values_s, dtype=np.float64) * 1e3
    if not len(ms):
        ms = np.zeros(1)
    out = {f"mean_{prefix}_ms": float(ms.mean()), f"median_{prefix}_ms": float(np.median(ms)),
           f"std_{prefix}_ms": float(ms.std())}
    out.update({f"p{p}_{prefix}_ms": float(np.percentile(ms, p)) for p in percentiles})
    return out


def summarize(records: Sequence[RequestRecord]) -> dict[str, float]:
    """bench_serving's summary of completed requests (duration: first arrival to last token).

    Latencies as ``{mean,median,std,p90,p99}_{ttft,tpot,itl,e2el,load_wait}_ms`` (``e2el``: end-to-end
    latency, as bench_serving and vLLM name it); ``load_wait`` is the adapter stall per request."""
    done = [r for r in records if r.ok]
    start = min((r.arrival_s for r in records), default=0.0)
    duration = max((r.token_s[-1] for r in done), default=start) - start
    inputs, outputs = sum(r.input_len for r in done), sum(len(r.token_s) for r in done)
    per_s = 1 / duration if duration > 0 else 0.0
    summary: dict[str, float] = {
        "completed": len(done), "failed": len(records) - len(done), "duration": duration,
        "total_input_tokens": inputs, "total_output_tokens": outputs,
        "request_throughput": len(done) * per_s, "input_throughput": inputs * per_s,
        "output_throughput": outputs * per_s, "total_throughput": (inputs + outputs) * per_s,
    }
    summary |= _stats("ttft", [r.ttft_s for r in done])
    summary |= _stats("tpot", [t for r in done if (t := r.tpot_s) is not None])
    summary |= _stats("itl", [x for r in done for x in r.itl_s], (90, 95, 99))
    summary |= _stats("e2el", [r.e2e_s for r in done])
    summary |= _stats("load_wait", [r.load_wait_s for r in done])
    return summary


def format_summary(summary: dict[str, float], title: str) -> str:
    """A bench_serving-style table."""
    lines = [f"{f' {title} ':=^56}"]
    for key, value in summary.items():
        text = f"{value:.2f}" if isinstance(value, float) else str(value)
        lines.append(f"{key:<40}{text:>16}")
    return "\n".join([*lines, "=" * 56])
