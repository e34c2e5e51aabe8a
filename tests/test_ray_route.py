"""The real path routing online on a local Ray (CPU, tiny model): replicas of TP 1, the gateway's ``Route``
(or ``Lookup``) choosing each request's replica, hints sent there, the request submitted there at its arrival.

One policy run through ``bench.real.run_policy`` in this process (its own Ray, shut down at the end):
every request is served once, by the replica the router's ``Route`` answer chose (the router's record
against the engines' own records), every adapter request's hint went to that replica, and nothing failed.
"""

from __future__ import annotations

from pathlib import Path

import pytest

ray = pytest.importorskip("ray")

from bench.policies import BENCH_POLICIES  # noqa: E402
from bench.real import RealConfig, run_policy  # noqa: E402
from bench.workloads import WorkloadSpec, make_workload  # noqa: E402
from lora_cache.adapters.synth import SynthConfig, make_adapters  # noqa: E402
from lora_cache.vocab import NAMESPACE  # noqa: E402
from tests.ray_local import init_local  # noqa: E402

pytestmark = pytest.mark.ray


@pytest.mark.parametrize(("router", "replicas", "attach", "lead_s"),
                         [("lora-cache", 4, False, 0.1), ("affinity", 2, True, 0.1), ("lora-cache", 2, False, 0.0)])
def test_routing_through_the_gateway_serves_each_request_where_the_router_chose(
        tmp_path: Path, router: str, replicas: int, attach: bool, lead_s: float) -> None:
    """lora-cache (Route, told each finished request) over four hosted replicas; affinity (Lookup) over two replicas
    of attached engine processes (their requests and finished ids over the processes' feed pipes); lora-cache at
    lead 0, where a request is routed at its arrival: it is submitted before its hint is sent (the hint call is off
    its path)."""
    make_adapters(tmp_path, SynthConfig(model="tiny", count=8, rank="8,16"))
    names = sorted(p.name for p in tmp_path.iterdir() if (p / "adapter_config.json").is_file())
    spec = WorkloadSpec(arrivals="poisson:30", popularity="zipf:0.9", requests=40, random_input_len=32,
                        random_output_len=4, random_range_ratio=0.5, num_adapters=len(names))
    workload = make_workload(spec, names)
    config = RealConfig(model="tiny", replicas=replicas, tp=1, slots=3, max_rank=16, max_running=8, max_adapters=2,
                        max_prefill_tokens=256, max_seq_len=128, hint_lead_s=lead_s, host_bytes=1 << 24,
                        worker_cpus=0.1, router=router, engine={"share_weights": True}, timeout_s=300, attach=attach)
    init_local(namespace=NAMESPACE, log_to_driver=False, num_cpus=2)
    try:
        run = run_policy(config, BENCH_POLICIES["global"], str(tmp_path), names, workload)
    finally:
        ray.shutdown()
    rids = sorted(r.rid for r in workload.requests)
    assert sorted(r.rid for r in run.records) == rids and all(r.ok for r in run.records)
    routing = run.routing
    assert routing["router"] == router
    calls = routing["route_calls" if router == "lora-cache" else "lookup_calls"]
    assert 0 < calls <= len(rids)  # one per batch due together (per adapter of it: Lookup)
    # Route heard of the finishes (issue 42: the adapters in flight are the unfinished requests'), each once: every
    # request that finished before the last Route call; affinity's router tells none (it never calls Route)
    told = routing["finishes_told"]
    assert (0 < told < len(rids)) if router == "lora-cache" else told == 0
    assert sorted(int(k) for k in routing["choices"]) == rids
    assert routing["served_by"] == routing["choices"]  # the engines' records: served where Route chose
    with_adapter = {str(r.rid) for r in workload.requests if r.adapter is not None}
    assert routing["hints"] == {k: v for k, v in routing["choices"].items() if k in with_adapter}
    assert sum(routing["requests_per_replica"].values()) == len(rids)
    arrival = {str(r.rid): r.arrival_s for r in workload.requests}
    assert sorted(routing["submitted_s"]) == sorted(arrival)
    assert all(routing["submitted_s"][k] >= arrival[k] for k in arrival)  # never before its arrival
    assert set(routing["submit_lag_ms"]) == {"mean", "p99", "max"} and routing["submit_lag_ms"]["mean"] >= 0
    if lead_s == 0:  # routed at arrival: forwarded first, the cache told on the side
        assert all(routing["submitted_s"][k] <= routing["hint_sent_s"][k] for k in routing["hints"])
    assert len(set(routing["choices"].values())) >= 2  # spread (sticky hashing; least loaded when not ready)
    assert {r["replica"] for r in run.ranks} == {f"replica-{i}" for i in range(replicas)}
