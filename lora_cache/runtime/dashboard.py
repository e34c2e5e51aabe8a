"""The Grafana dashboard of every ``ray_lora_cache_*`` metric (``metrics.py``), in Ray's own dashboard conventions.

Ray ships Grafana dashboards for its own metrics (``ray/dashboard/modules/metrics/dashboards``): a hidden
``datasource`` variable of type prometheus, a ``SessionName`` variable that every query filters on, panels on a
24-column grid, two per row, rates over ``$__rate_interval``. This one follows them, so it imports next to Ray's
(Dashboards -> New -> Import, pick the Prometheus that scrapes the cluster) and reads the same Prometheus: Ray's
metrics agent on every node exports our metrics with Ray's labels (``SessionName``, ``NodeAddress``, ``WorkerId``)
beside ours (``replica``, ``rank``, ``tier``, ...). A ``Replica`` variable narrows the per-replica panels.

The file is generated, never edited by hand: ``python -m lora_cache.runtime.dashboard`` writes
``deploy/grafana/lora_cache_grafana_dashboard.json``; ``--check`` fails when it differs from this module (CI runs the
same comparison in ``tests/test_dashboard.py``, which also holds every query to the metrics the service exports).

Rows, in the order of an adapter's life: hit rates per tier; time to ready (per source) and the host-to-GPU copy;
bytes moved per path (store -> disk -> host -> GPU) and the host tier's fill; queues, READY adapters and slots;
prefetch accuracy and retirements, evictions, failed loads; the planner's latency, commands sent and refused,
router hints; the object store's fetches and bytes.
"""

from __future__ import annotations

import argparse
import json
import sys
from dataclasses import dataclass
from pathlib import Path

UID = "rayLoraCacheDashboard"
OUT = Path(__file__).resolve().parents[2] / "deploy" / "grafana" / "lora_cache_grafana_dashboard.json"
SESSION = 'SessionName=~"$SessionName"'  # Ray's global filter: one cluster session at a time
REPLICA = 'replica=~"$Replica"'
RATE = "[$__rate_interval]"
PANEL_W, PANEL_H = 12, 8  # Ray's: two panels per row


@dataclass(frozen=True)
class Target:
    expr: str
    legend: str


@dataclass(frozen=True)
class Panel:
    title: str
    description: str
    unit: str  # a Grafana unit id: percentunit, s, Bps, bytes, ops, short
    targets: tuple[Target, ...]
    stack: bool = False


def sel(metric: str, *filters: str) -> str:
    """``ray_lora_cache_<metric>{SessionName=~..., filters...}``."""
    return f"ray_lora_cache_{metric}{{{','.join((SESSION, *filters))}}}"


def rate(metric: str, by: str, *filters: str) -> str:
    return f"sum(rate({sel(metric, *filters)}{RATE})) by ({by})"


def quantiles(metric: str, by: str, *filters: str) -> tuple[Target, ...]:
    """p50 and p99 of a ``_seconds`` histogram, per ``by``."""
    buckets = f"sum(rate({sel(metric + '_bucket', *filters)}{RATE})) by (le, {by})"
    return tuple(Target(f"histogram_quantile({q}, {buckets})", f"p{round(q * 100)} {{{{{by}}}}}") for q in (0.5, 0.99))


def hit_rate(by: str) -> str:
    hits, misses = rate("hits_total", by, REPLICA), rate("misses_total", by, REPLICA)
    return f"{hits} / ({hits} + {misses})"


ROWS: tuple[tuple[str, tuple[Panel, ...]], ...] = (
    ("Hit rates", (
        Panel("Hit rate per tier", "Lookups that found the adapter in the tier, over all lookups: gpu (an engine's "
              "acquire found it resident), host (a load found its shard in the pinned host tier), disk (an "
              "object-store adapter's copy was on this node's disk).", "percentunit",
              (Target(hit_rate("tier"), "{{tier}}"),)),
        Panel("Hits and misses per tier", "Lookups per second that found (hit) or missed the adapter in each tier; a "
              "disk-tier miss is a fetch from the object store.", "ops",
              (Target(rate("hits_total", "tier", REPLICA), "hit {{tier}}"),
               Target(rate("misses_total", "tier", REPLICA), "miss {{tier}}"))),
    )),
    ("Time to ready", (
        Panel("Time to ready", "From a prefetch or a miss to READY on a rank, by where the shard came from (host: "
              "a host-tier hit; disk: read from the adapter's file or the node's copy of a store object).", "s",
              quantiles("time_to_ready_seconds", "source", REPLICA)),
        Panel("Host-to-GPU copy", "The one host-to-device copy of a shard, per replica.", "s",
              quantiles("h2d_copy_seconds", "replica", REPLICA)),
    )),
    ("Bytes moved", (
        Panel("Bytes moved per path", "Bytes per second copied along each path an adapter takes: store_to_disk (a "
              "whole object fetched from the store), disk_to_host (a shard read into the host tier), host_to_gpu "
              "(a shard's copy into its GPU slot).", "Bps", (Target(rate("moved_bytes_total", "path", REPLICA),
                                                                    "{{path}}"),), stack=True),
        Panel("Host tier in use", "Bytes of each rank's pinned host tier holding shards (its size is --host-bytes).",
              "bytes", (Target(f"max({sel('host_tier_used_bytes', REPLICA)}) by (replica, rank)",
                               "{{replica}}/{{rank}}"),)),
        Panel("Cold reads by way", "Host-tier reads per second of local adapter files found out of the page cache, "
              "by the way each went (direct_reads / read_ahead): direct (O_DIRECT), preadv (the page cache), ahead "
              "(the page cache, the file asked for whole first). None with both off.", "ops",
              (Target(rate("cold_reads_total", "way", REPLICA), "{{way}}"),)),
    )),
    ("Queues and slots", (
        Panel("Queue depth", "Requests waiting at each replica, as its engine last reported them to the controller.",
              "short", (Target(f"max({sel('queue_depth', REPLICA)}) by (replica)", "{{replica}}"),)),
        Panel("READY adapters", "Adapter versions every rank of a replica holds READY (what routing may count on).",
              "short", (Target(f"max({sel('ready_adapters', REPLICA)}) by (replica)", "{{replica}}"),)),
        Panel("GPU slots by state", "Slots per rank holding a READY shard or one being loaded.", "short",
              (Target(f"max({sel('slots', REPLICA)}) by (replica, rank, state)", "{{replica}}/{{rank}} {{state}}"),),
              stack=True),
        Panel("Prefetch accuracy", "Prefetched adapters a batch used before their eviction, over prefetched adapters "
              "freed, per rank.", "percentunit",
              (Target(f"max({sel('prefetch_accuracy', REPLICA)}) by (replica, rank)", "{{replica}}/{{rank}}"),)),
        Panel("Prefetches retired", "Prefetched adapters freed per second, by whether a batch used them first.",
              "ops", (Target(rate("prefetches_retired_total", "outcome", REPLICA), "{{outcome}}"),)),
        Panel("Evictions and failed loads", "Slots freed per second, loads that failed on a rank, and failed loads "
              "the controller heard of.", "ops",
              (Target(rate("evictions_total", "replica", REPLICA), "evictions {{replica}}"),
               Target(rate("load_failures_total", "replica", REPLICA), "failed loads {{replica}}"),
               Target(f"sum(rate({sel('load_failures_reported_total')}{RATE}))", "failed loads reported"))),
    )),
    ("Planner and commands", (
        Panel("Planner latency", "Time to compute one plan, by scope (dirty: the replicas whose inputs changed; full: "
              "every replica, on a resync).", "s", quantiles("planner_latency_seconds", "scope")),
        Panel("Commands sent", "Commands the controller sent to workers per second, by kind.", "ops",
              (Target(rate("commands_sent_total", "kind"), "{{kind}}"),), stack=True),
        Panel("Commands refused", "Commands a worker refused per second: stale_epoch (planned before the worker's "
              "last restart), error (the command could not apply).", "ops",
              (Target(rate("commands_rejected_total", "reason"), "{{reason}}"),)),
        Panel("Router hints", "Hints from routers per second: accepted (planned for), ignored (a replica that "
              "is lost, an adapter that is not registered).", "ops",
              (Target(rate("hints_total", "outcome"), "{{outcome}}"),)),
    )),
    ("Object store", (
        Panel("Store fetches", "Whole objects fetched from the object store into a node's disk tier per second "
              "(a disk-tier miss), and disk-tier hits.", "ops",
              (Target(rate("misses_total", "replica", 'tier="disk"', REPLICA), "fetches {{replica}}"),
               Target(rate("hits_total", "replica", 'tier="disk"', REPLICA), "disk hits {{replica}}"))),
        Panel("Store bytes", "Bytes per second read from the object store.", "Bps",
              (Target(rate("moved_bytes_total", "replica", 'path="store_to_disk"', REPLICA), "{{replica}}"),)),
    )),
)


def _variable(name: str, label: str, metric: str, description: str) -> dict[str, object]:
    query = f"label_values({metric}, {label})"
    return {
        "allValue": ".*", "current": {"selected": True, "text": ["All"], "value": ["$__all"]},
        "datasource": "${datasource}", "definition": query, "description": description, "hide": 0,
        "includeAll": True, "label": name, "multi": True, "name": name, "options": [],
        "query": {"query": query, "refId": "Prometheus-Variable-Query"}, "refresh": 2, "regex": "",
        "skipUrlSync": False, "sort": 1, "type": "query",
    }


def _panel(panel: Panel, pid: int, x: int, y: int) -> dict[str, object]:
    return {
        "datasource": "${datasource}", "description": panel.description, "id": pid, "title": panel.title,
        "type": "timeseries", "gridPos": {"h": PANEL_H, "w": PANEL_W, "x": x, "y": y},
        "fieldConfig": {"defaults": {"unit": panel.unit, "min": 0, "custom": {
            "drawStyle": "line", "lineWidth": 1, "fillOpacity": 10, "showPoints": "never",
            "stacking": {"mode": "normal" if panel.stack else "none", "group": "A"}}}, "overrides": []},
        "options": {"legend": {"displayMode": "table", "placement": "bottom", "calcs": ["mean", "max"]},
                    "tooltip": {"mode": "multi", "sort": "desc"}},
        "targets": [{"datasource": "${datasource}", "expr": t.expr, "legendFormat": t.legend, "interval": "",
                     "refId": chr(ord("A") + i)} for i, t in enumerate(panel.targets)],
    }


def build() -> dict[str, object]:
    """The dashboard's JSON model."""
    panels: list[dict[str, object]] = []
    y, pid = 0, 1
    for title, row in ROWS:
        panels.append({"collapsed": False, "gridPos": {"h": 1, "w": 24, "x": 0, "y": y}, "id": pid, "panels": [],
                       "title": title, "type": "row"})
        y, pid = y + 1, pid + 1
        for i, panel in enumerate(row):
            panels.append(_panel(panel, pid, PANEL_W * (i % 2), y + PANEL_H * (i // 2)))
            pid += 1
        y += PANEL_H * ((len(row) + 1) // 2)
    datasource = {"current": {"selected": False}, "description": "The Prometheus that scrapes the Ray cluster.",
                  "hide": 2, "includeAll": False, "multi": False, "name": "datasource", "options": [],
                  "query": "prometheus", "refresh": 1, "regex": "", "skipUrlSync": False, "type": "datasource"}
    session = _variable("SessionName", "SessionName", "ray_lora_cache_commands_sent_total",
                        "The Ray session (one start of the cluster) to show.")
    session.update(allValue=None, includeAll=False, multi=False, current={"selected": False}, sort=2)
    replica = _variable("Replica", "replica", f"ray_lora_cache_slots{{{SESSION}}}",
                        "The lora-cache replicas whose per-replica figures are shown.")
    return {
        "annotations": {"list": [{"builtIn": 1, "datasource": "-- Grafana --", "enable": True, "hide": True,
                                  "iconColor": "rgba(0, 211, 255, 1)", "name": "Annotations & Alerts",
                                  "type": "dashboard"}]},
        "description": "lora-cache: LoRA adapters in GPU memory ahead of the requests that need them "
                       "(ray_lora_cache_* metrics, exported by Ray's metrics agent on every node).",
        "editable": True, "graphTooltip": 1, "links": [], "panels": panels, "refresh": "30s", "schemaVersion": 27,
        "style": "dark", "tags": ["ray", "lora-cache"], "templating": {"list": [datasource, session, replica]},
        "time": {"from": "now-30m", "to": "now"}, "timepicker": {}, "timezone": "", "title": "lora-cache",
        "uid": UID, "version": 1,
    }


def render() -> str:
    return json.dumps(build(), indent=2) + "\n"


def queries() -> list[tuple[str, str]]:
    """(panel title, PromQL) of every panel's every target."""
    return [(panel.title, t.expr) for _, row in ROWS for panel in row for t in panel.targets]


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(prog="python -m lora_cache.runtime.dashboard", description=__doc__.split("\n")[0])
    parser.add_argument("--out", type=Path, default=OUT, help="where to write the dashboard's JSON")
    parser.add_argument("--check", action="store_true", help="exit 1 if --out differs from what would be written")
    ns = parser.parse_args(argv)
    text = render()
    if ns.check:
        same = ns.out.is_file() and ns.out.read_text() == text
        if not same:
            print(f"{ns.out} is not what lora_cache/runtime/dashboard.py generates: run "
                  "python -m lora_cache.runtime.dashboard", file=sys.stderr)
        return 0 if same else 1
    ns.out.parent.mkdir(parents=True, exist_ok=True)
    ns.out.write_text(text)
    print(ns.out)
    return 0


if __name__ == "__main__":
    sys.exit(main())
