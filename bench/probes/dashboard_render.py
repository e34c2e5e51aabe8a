"""The Grafana dashboard's panels rendered against a live service, through a real Prometheus (issue 45 item 4).

Grafana is in neither Debian's packages nor PyPI, so this renders what Grafana would: it starts a service on a local
Ray cluster (2 replicas x TP 1, CPU workers, 16 tiny adapters, 2 slots each) whose adapters are in an S3-compatible
server (moto's server mode, a process of its own; a disk tier of 6 adapters' bytes, so the store is read again as it
evicts), a Prometheus (Debian's ``prometheus``
package: ``apt-get install prometheus``) that scrapes Ray's metrics export port every 2 s, drives the service for
``--seconds`` (each replica's queue reported from a Zipf draw every 0.25 s, an engine step on each worker over its
queue, router hints), then asks that Prometheus for every panel's every query (the dashboard's own PromQL, its
variables set to "all": ``$SessionName`` and ``$Replica`` to ``.*``, ``$__rate_interval`` to 15 s) over the run and
draws the panels in the dashboard's layout into one PNG. A query Prometheus refuses fails the probe with its error.

    python -m bench.probes.dashboard_render --out docs/dashboard.png [--seconds 90]
"""

from __future__ import annotations

import argparse
import contextlib
import json
import random
import shutil
import subprocess
import tempfile
import time
import urllib.parse
import urllib.request
from pathlib import Path
from typing import Any

import ray

from bench.probes.s3_local import moto_server, upload
from lora_cache.adapters.catalog import CatalogConfig
from lora_cache.adapters.synth import SynthConfig, make_adapters
from lora_cache.app.serve import ServeConfig, start
from lora_cache.planner import PlannerConfig
from lora_cache.runtime import dashboard
from lora_cache.runtime.ports import free_port
from lora_cache.vocab import WorkerId
from workers.cache import WorkerConfig
from workers.staging.disk_tier import DiskTierConfig
from workers.staging.host_config import HostTierConfig

VARIABLES = {"$SessionName": ".*", "$Replica": ".*", "$__rate_interval": "15s"}


def prometheus(metrics_port: int, workdir: Path) -> tuple[subprocess.Popen[bytes], str]:
    binary = shutil.which("prometheus")
    if binary is None:
        raise SystemExit("no prometheus binary: apt-get install prometheus (Debian's package)")
    port = free_port()
    config = workdir / "prometheus.yml"
    config.write_text(f"global:\n  scrape_interval: 2s\nscrape_configs:\n- job_name: ray\n  static_configs:\n"
                      f"  - targets: ['127.0.0.1:{metrics_port}']\n")
    proc = subprocess.Popen([binary, f"--config.file={config}", f"--storage.tsdb.path={workdir / 'tsdb'}",
                             f"--web.listen-address=127.0.0.1:{port}"], stdout=subprocess.DEVNULL,
                            stderr=subprocess.DEVNULL)
    url = f"http://127.0.0.1:{port}"
    for _ in range(100):
        try:
            urllib.request.urlopen(f"{url}/-/ready", timeout=1)
            return proc, url
        except OSError:
            time.sleep(0.2)
    proc.kill()
    raise SystemExit("prometheus did not become ready in 20 s")


@contextlib.contextmanager
def object_store(adapters: Path, bucket: str = "dashboard-bkt"):
    """A moto S3 server process holding every adapter under ``adapters`` at s3://BUCKET/adapters; its address and
    keys in this process's environment (so in the Ray cluster's, started after)."""
    with moto_server():
        upload(sorted(adapters.iterdir()), bucket, "adapters")
        yield f"s3://{bucket}/adapters"


def query_range(url: str, expr: str, start: float, end: float, step: float = 2.0) -> list[dict[str, Any]]:
    for name, value in VARIABLES.items():
        expr = expr.replace(name, value)
    params = urllib.parse.urlencode({"query": expr, "start": start, "end": end, "step": step})
    try:
        body = json.loads(urllib.request.urlopen(f"{url}/api/v1/query_range?{params}", timeout=30).read())
    except urllib.error.HTTPError as e:
        raise SystemExit(f"prometheus refused {expr}: {e.read().decode()[:500]}") from e
    return list(body["data"]["result"])


def drive(svc, names: list[str], seconds: float, seed: int) -> None:
    rng = random.Random(seed)
    weights = [1 / (i + 1) for i in range(len(names))]
    replicas = sorted({w.replica for w in svc.workers})
    end, tick = time.monotonic() + seconds, 0
    while time.monotonic() < end:
        now = time.time()
        for replica in replicas:
            queue = rng.choices(names, weights, k=3)
            ray.get(svc.controller.report_queue.remote(replica, [(a, now) for a in queue]))
            ray.get(svc.controller.hint.remote([(f"h{tick}-{replica}", queue[0], replica, 0.2)]))
            worker = svc.workers[WorkerId(replica, 0)]
            with contextlib.suppress(ray.exceptions.RayTaskError):  # every slot busy: an engine would wait
                ray.get(worker.step.remote(sorted(set(queue[:2]))))
        tick += 1
        time.sleep(0.25)


def render(url: str, start: float, end: float, out: Path) -> int:
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    rows = dashboard.ROWS
    lines = sum((len(row) + 1) // 2 for _, row in rows)
    height = 3.1 * lines + 0.4 * len(rows)
    fig = plt.figure(figsize=(16, height), facecolor="#111217")
    grid = fig.add_gridspec(lines, 2, hspace=0.75, wspace=0.12, top=1 - 0.8 / height, bottom=0.4 / height)
    line, series = 0, 0
    for row_title, row in rows:
        for i, panel in enumerate(row):
            ax = fig.add_subplot(grid[line + i // 2, i % 2], facecolor="#181b1f")
            for target in panel.targets:
                for result in query_range(url, target.expr, start, end):
                    labels = result["metric"]
                    legend = target.legend
                    for key, value in labels.items():
                        legend = legend.replace("{{" + key + "}}", str(value))
                    points = result["values"]
                    ax.plot([float(t) - start for t, _ in points], [float(v) for _, v in points], lw=1,
                            label=legend)
                    series += 1
            ax.set_title(f"{row_title} / {panel.title} [{panel.unit}]", color="#d8d9da", fontsize=9, loc="left")
            ax.tick_params(colors="#9fa7b3", labelsize=7)
            for spine in ax.spines.values():
                spine.set_color("#333")
            ax.set_xlabel("seconds into the run", color="#9fa7b3", fontsize=7)
            if ax.get_legend_handles_labels()[0]:
                ax.legend(fontsize=6, loc="upper left", ncol=2, framealpha=0.3)
            else:
                ax.text(0.5, 0.5, "no data", transform=ax.transAxes, color="#9fa7b3", ha="center")
        line += (len(row) + 1) // 2
    fig.suptitle("lora-cache (deploy/grafana/lora_cache_grafana_dashboard.json), queried from a live Prometheus",
                 color="#d8d9da", y=1 - 0.25 / height)
    out.parent.mkdir(parents=True, exist_ok=True)
    fig.savefig(out, dpi=70, facecolor=fig.get_facecolor(), bbox_inches="tight")
    return series


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    parser.add_argument("--out", type=Path, default=Path("docs/dashboard.png"))
    parser.add_argument("--seconds", type=float, default=90.0)
    parser.add_argument("--seed", type=int, default=0)
    ns = parser.parse_args(argv)
    work = Path(tempfile.mkdtemp(prefix="lora-cache-dashboard-"))
    names = [p.name for p in make_adapters(work / "adapters", SynthConfig(model="tiny", count=16, rank="8,16"))]
    metrics_port = free_port()
    one = sum(f.stat().st_size for f in (work / "adapters" / names[-1]).iterdir())
    with object_store(work / "adapters") as store:
        ray.init(num_cpus=2, namespace="lora-cache", include_dashboard=False, _metrics_export_port=metrics_port,
                 _system_config={"metrics_report_interval_ms": 1000})
        prom, url = prometheus(metrics_port, work)
        try:
            disk = DiskTierConfig(disk_cache=str(work / "disk"), disk_cache_bytes=max(6 * one, 1 << 16),
                                  fetch_part_bytes=0)
            svc = start(ServeConfig(adapters=store, replicas=2, tp=1), CatalogConfig(model="tiny", max_rank=16),
                        PlannerConfig(policy="global"),
                        WorkerConfig(num_slots=2, host=HostTierConfig(host_bytes=1 << 20, pin=False), disk=disk))
            try:
                t0 = time.time()
                drive(svc, names, ns.seconds, ns.seed)
                time.sleep(6)  # the last export and scrape
                series = render(url, t0, time.time(), ns.out)
            finally:
                svc.stop()
        finally:
            prom.terminate()
            ray.shutdown()
    queries = len(dashboard.queries())
    print(f"{ns.out}: {queries} queries, {series} series drawn from {url} over {ns.seconds:.0f} s")
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
