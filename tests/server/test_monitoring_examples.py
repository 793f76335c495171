"""examples/monitoring: the Grafana dashboard, Prometheus scrape config and docker compose parse (they
cannot run here), and every metric the dashboard queries is one /metrics exposes."""

from __future__ import annotations

import json
import re
from pathlib import Path

import httpx
import yaml
from prometheus_client.parser import text_string_to_metric_families

from tests.server.conftest import MODEL_NAME

MONITORING = Path(__file__).parents[2] / "examples" / "monitoring"
DASHBOARD = MONITORING / "grafana" / "dashboards" / "jaxpaged.json"


def dashboard_queries() -> list[str]:
    board = json.loads(DASHBOARD.read_text())
    exprs = [t["expr"] for p in board["panels"] for t in p["targets"]]
    exprs += [v["definition"] for v in board["templating"]["list"] if v.get("definition")]
    return exprs


def exposed_samples(live) -> set[str]:
    text = httpx.get(live.url + "/metrics", timeout=10).text
    return {s.name for family in text_string_to_metric_families(text) for s in family.samples}


def test_every_dashboard_metric_is_exposed(live):
    r = httpx.post(live.v1 + "/completions", json={"model": MODEL_NAME, "prompt": "hi", "max_tokens": 3},
                   timeout=60)  # one finished request: the labelled counters and histograms have samples
    assert r.status_code == 200
    live.wait_idle()
    exposed = exposed_samples(live)
    queried = {name for expr in dashboard_queries() for name in re.findall(r"vllm:[a-zA-Z0-9_]+", expr)}
    assert len(queried) >= 14  # throughput, running/waiting, 4 histograms, KV, prefix cache, preemptions, reasons
    missing = sorted(queried - exposed)
    assert not missing, f"the dashboard queries metrics /metrics does not expose: {missing}"
    panels = [e for e in dashboard_queries() if not e.startswith("label_values(vllm:num_requests_running, ")]
    assert all("model_name=~\"$model_name\"" in e for e in panels)


def test_dashboard_shape():
    board = json.loads(DASHBOARD.read_text())
    ids = [p["id"] for p in board["panels"]]
    assert len(ids) == len(set(ids)) and board["uid"] and board["title"] == "jaxpaged"
    titles = " ".join(p["title"] for p in board["panels"]).lower()
    for needed in ("throughput", "first token", "inter-token", "running", "kv cache", "prefix cache", "preemption",
                   "by replica"):
        assert needed in titles, needed


def test_prometheus_and_compose_files_parse():
    prometheus = yaml.safe_load((MONITORING / "prometheus.yml").read_text())
    (job,) = prometheus["scrape_configs"]
    assert job["metrics_path"] == "/metrics" and job["static_configs"][0]["targets"] == ["jaxpaged:8000"]
    compose = yaml.safe_load((MONITORING / "docker-compose.yml").read_text())
    assert set(compose["services"]) == {"jaxpaged", "prometheus", "grafana"}
    mounts = " ".join(compose["services"]["prometheus"]["volumes"] + compose["services"]["grafana"]["volumes"])
    for path in re.findall(r"\./([\w./-]+):", mounts):
        if path != "api_key":  # made by the operator (see the file's comment)
            assert (MONITORING / path).exists(), path
    datasource = yaml.safe_load((MONITORING / "grafana/provisioning/datasources/prometheus.yml").read_text())
    assert datasource["datasources"][0]["url"] == "http://prometheus:9090"
    provider = yaml.safe_load((MONITORING / "grafana/provisioning/dashboards/jaxpaged.yml").read_text())
    assert provider["providers"][0]["options"]["path"] == "/var/lib/grafana/dashboards"
