"""The Grafana dashboard (``deploy/grafana``) against the metrics the service exports (issue 45 item 4): the
committed JSON is what ``lora_cache.runtime.dashboard`` generates; every query names only metrics and labels the
controller and the workers export (as Ray's agent names them); every exported metric is on some panel. The live
counterpart, every metric a panel names scraped from a running service, is in ``tests/test_ray_metrics.py``."""

from __future__ import annotations

import json
import re

from ray.util.metrics import Counter, Gauge, Histogram, Metric

from lora_cache.runtime import dashboard
from lora_cache.runtime.metrics import ControllerMetrics, WorkerMetrics

RAY_LABELS = {"SessionName", "NodeAddress", "WorkerId", "Component", "Version", "ray_io_cluster"}  # Ray's own
SELECTOR = re.compile(r"(ray_lora_cache_\w+)\{([^}]*)\}")
LABEL = re.compile(r'(\w+)\s*(?:=~|!~|!=|=)\s*"')
BY = re.compile(r"\bby \(([^)]*)\)")


def exported() -> dict[str, set[str]]:
    """Every series name Ray's agent exports for our metrics -> the labels it carries (ours; Ray adds its own)."""
    metrics: list[Metric] = []
    for owner in (ControllerMetrics("global"), WorkerMetrics("replica-0", 0, dict)):
        for value in vars(owner).values():
            metrics += [m for m in (value.values() if isinstance(value, dict) else [value]) if isinstance(m, Metric)]
    names: dict[str, set[str]] = {}
    for m in metrics:
        name, tags = m.info["name"], set(m.info["tag_keys"])
        if isinstance(m, Counter):
            names[f"ray_{name}_total"] = tags
        elif isinstance(m, Histogram):
            names.update({f"ray_{name}_{part}": tags | ({"le"} if part == "bucket" else set())
                          for part in ("bucket", "sum", "count")})
        else:
            assert isinstance(m, Gauge), m
            names[f"ray_{name}"] = tags
    return names


def used() -> list[tuple[str, str, str, set[str]]]:
    """(panel, query, metric, labels of its selector) for every metric named in a panel's query."""
    out = []
    for title, expr in dashboard.queries():
        for name, selector in SELECTOR.findall(expr):
            out.append((title, expr, name, set(LABEL.findall(selector))))
    return out


def test_the_committed_dashboard_is_the_generated_one() -> None:
    assert dashboard.OUT.read_text() == dashboard.render(), "run python -m lora_cache.runtime.dashboard"
    assert dashboard.main(["--check"]) == 0


def test_every_query_names_metrics_and_labels_the_service_exports() -> None:
    names = exported()
    assert len(names) >= 20, names  # both owners were read
    for title, expr, metric, labels in used():
        assert metric in names, f"panel {title!r} names {metric}, which the service does not export: {expr}"
        assert labels <= names[metric] | RAY_LABELS, f"panel {title!r}: {metric} has no label {labels - names[metric]}"
    for title, expr in dashboard.queries():
        metrics = {name for name, _ in SELECTOR.findall(expr)}
        assert metrics, f"panel {title!r} queries no lora-cache metric: {expr}"
        carried = set.union(*(names[m] for m in metrics)) | RAY_LABELS
        for group in BY.findall(expr):
            by = {label.strip() for label in group.split(",")}
            assert by <= carried, f"panel {title!r} groups by {by - carried}, a label none of {metrics} has"
        assert expr.count("(") == expr.count(")") and expr.count("{") == expr.count("}"), expr


def test_every_exported_metric_is_on_a_panel() -> None:
    shown = {metric for _, _, metric, _ in used()}
    base = {re.sub(r"_(bucket|sum|count)$", "", n) for n in exported()}
    missing = sorted(b for b in base if not any(s == b or s.startswith(b + "_") for s in shown))
    assert not missing, f"exported but on no panel: {missing}"


def test_the_layout_follows_rays_conventions() -> None:
    model = json.loads(dashboard.render())
    panels = model["panels"]
    assert len({p["id"] for p in panels}) == len(panels), "panel ids repeat"
    cells: set[tuple[int, int]] = set()
    for p in panels:
        g = p["gridPos"]
        assert g["x"] + g["w"] <= 24
        mine = {(x, y) for x in range(g["x"], g["x"] + g["w"]) for y in range(g["y"], g["y"] + g["h"])}
        assert not mine & cells, f"panel {p['title']!r} overlaps another"
        cells |= mine
    variables = {v["name"] for v in model["templating"]["list"]}
    assert variables == {"datasource", "SessionName", "Replica"}
    text = json.dumps(model)
    for ref in set(re.findall(r"\$(?:\{(\w+)\}|(\w+))", text)):
        name = ref[0] or ref[1]
        assert name in variables or name.startswith("__"), f"${name} is not a variable of the dashboard"
    for p in panels:
        if p["type"] != "row":
            assert p["datasource"] == "${datasource}" and p["description"] and p["targets"], p["title"]
            assert all('SessionName=~"$SessionName"' in t["expr"] for t in p["targets"]), p["title"]
            assert p["fieldConfig"]["defaults"]["unit"] in {"percentunit", "s", "Bps", "bytes", "ops", "short"}
