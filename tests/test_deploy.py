"""deploy/kubernetes without a cluster: every manifest against Kubernetes' own OpenAPI schemas (kubernetes-validate,
its bundled offline copies, strict: unknown fields fail), and the wiring between them: labels the router
discovers, probes on /health, the GPU, the compilation cache volume, the API key from a Secret, Prometheus
annotations, and both programs' flags parsed by the programs' own parsers."""

from __future__ import annotations

from pathlib import Path

import pytest
import yaml

from server.__main__ import build_parser

kubernetes_validate = pytest.importorskip("kubernetes_validate", reason="pip install kubernetes-validate")

KUBERNETES = Path(__file__).resolve().parents[1] / "deploy" / "kubernetes"
ENGINE_LABELS = {"app.kubernetes.io/name": "jaxpaged", "app.kubernetes.io/component": "engine"}


def resources() -> list[dict]:
    kustomization = yaml.safe_load((KUBERNETES / "kustomization.yaml").read_text())
    listed = kustomization["resources"]
    assert sorted(listed) == sorted(p.name for p in KUBERNETES.glob("*.yaml") if p.name != "kustomization.yaml")
    return [doc for name in listed for doc in yaml.safe_load_all((KUBERNETES / name).read_text()) if doc]


def by_kind(kind: str, name: str) -> dict:
    (found,) = [r for r in resources() if r["kind"] == kind and r["metadata"]["name"] == name]
    return found


def container(deployment: dict) -> dict:
    (c,) = deployment["spec"]["template"]["spec"]["containers"]
    return c


def test_every_manifest_is_valid_kubernetes():
    docs = resources()
    assert {d["kind"] for d in docs} == {"Deployment", "PersistentVolumeClaim", "Service", "ServiceAccount", "Role",
                                         "RoleBinding"}
    version = kubernetes_validate.latest_version()
    for doc in docs:
        kubernetes_validate.validate(doc, version, strict=True)  # raises ValidationError naming the field
    broken = by_kind("Deployment", "jaxpaged-engine")
    broken["spec"]["template"]["spec"]["containers"][0]["readinessProbe"]["httpGet"]["pathh"] = "/health"
    with pytest.raises(kubernetes_validate.ValidationError):  # the validator does reject a typo
        kubernetes_validate.validate(broken, version, strict=True)


def test_engine_replicas_gpu_probes_cache_and_key():
    engine = by_kind("Deployment", "jaxpaged-engine")
    template = engine["spec"]["template"]
    assert engine["spec"]["selector"]["matchLabels"] == ENGINE_LABELS == template["metadata"]["labels"]
    c = container(engine)
    assert c["resources"]["limits"]["nvidia.com/gpu"] == 1
    port = c["ports"][0]
    for probe in ("startupProbe", "readinessProbe", "livenessProbe"):
        assert c[probe]["httpGet"] == {"path": "/health", "port": port["name"]}
    ns = build_parser().parse_args(c["args"])  # the server's own parser accepts the container's flags
    assert ns.port == port["containerPort"]
    assert template["spec"]["terminationGracePeriodSeconds"] > ns.shutdown_timeout
    env = {e["name"]: e for e in c["env"]}
    assert env["JAXPAGED_API_KEY"]["valueFrom"]["secretKeyRef"] == {"name": "jaxpaged-api-key", "key": "api-key"}
    (mount,) = c["volumeMounts"]
    assert env["XDG_CACHE_HOME"]["value"] == mount["mountPath"]  # the compilation cache lives under it
    (volume,) = template["spec"]["volumes"]
    claim = by_kind("PersistentVolumeClaim", volume["persistentVolumeClaim"]["claimName"])
    assert volume["name"] == mount["name"] and claim["spec"]["accessModes"] == ["ReadWriteMany"]
    annotations = template["metadata"]["annotations"]
    assert annotations["prometheus.io/scrape"] == "true" and annotations["prometheus.io/port"] == str(ns.port)


def test_router_discovers_the_engines_and_the_service_reaches_it():
    router_args = pytest.importorskip("vllm_router.launch_router").parse_router_args
    router = by_kind("Deployment", "jaxpaged-router")
    c = container(router)
    args = router_args(c["args"])  # vllm-router's own parser accepts the container's flags
    assert args.service_discovery and args.policy == "cache_aware"
    assert args.selector == ENGINE_LABELS
    engine = container(by_kind("Deployment", "jaxpaged-engine"))
    assert args.service_discovery_port == engine["ports"][0]["containerPort"]
    ports = {p["name"]: p["containerPort"] for p in c["ports"]}
    assert (args.port, args.prometheus_port) == (ports["http"], ports["metrics"])
    assert c["readinessProbe"]["httpGet"]["path"] == "/readiness"
    assert c["livenessProbe"]["httpGet"]["path"] == "/liveness"
    annotations = router["spec"]["template"]["metadata"]["annotations"]
    assert annotations["prometheus.io/port"] == str(args.prometheus_port)
    account = router["spec"]["template"]["spec"]["serviceAccountName"]
    binding = by_kind("RoleBinding", account)
    assert binding["subjects"] == [{"kind": "ServiceAccount", "name": account}]
    (rule,) = by_kind("Role", binding["roleRef"]["name"])["rules"]
    assert rule["resources"] == ["pods"] and {"list", "watch"} <= set(rule["verbs"])
    service = by_kind("Service", "jaxpaged")
    assert service["spec"]["selector"] == router["spec"]["template"]["metadata"]["labels"]
    assert service["spec"]["ports"][0]["targetPort"] == "http"
