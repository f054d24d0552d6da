"""deploy/k8s/: every manifest validates against the Kubernetes schemas (kubernetes-validate, offline, strict),
every container's args + environment is accepted by the real splitserve parsers, the router's worker lists match the
StatefulSets, and every pod has probes and resource requests. The GPU overlay's patch applies to the base."""

from __future__ import annotations

import copy
import os
import re
from pathlib import Path
from unittest import mock

import pytest

yaml = pytest.importorskip("yaml")
kubernetes_validate = pytest.importorskip("kubernetes_validate")

from tests.test_deploy_compose import PARSERS  # noqa: E402

K8S = Path(__file__).resolve().parents[1] / "deploy" / "k8s"
K8S_VERSION = "1.33.0"


def kustomization(path: Path) -> dict:
    return yaml.safe_load((path / "kustomization.yaml").read_text())


@pytest.fixture(scope="module")
def resources() -> list[dict]:
    docs = []
    for name in kustomization(K8S)["resources"]:
        docs += [d for d in yaml.safe_load_all((K8S / name).read_text()) if d]
    return docs


def by_kind(resources, kind):
    return {r["metadata"]["name"]: r for r in resources if r["kind"] == kind}


def test_kustomization_lists_every_manifest():
    listed = set(kustomization(K8S)["resources"])
    on_disk = {p.name for p in K8S.glob("*.yaml")} - {"kustomization.yaml"}
    assert listed == on_disk


def test_manifests_match_kubernetes_schemas(resources):
    for r in resources:
        try:
            kubernetes_validate.validate(r, K8S_VERSION, strict=True)
        except kubernetes_validate.ValidationError as exc:
            pytest.fail(f"{r['kind']}/{r['metadata']['name']}: {exc.message} at {list(exc.path)}")


def pod_env(resources, container: dict) -> dict[str, str]:
    """The environment a container gets: its envFrom ConfigMaps, then env (fieldRefs resolved to a sample pod name)."""
    config_maps = by_kind(resources, "ConfigMap")
    env = {}
    for src in container.get("envFrom", []):
        env.update(config_maps[src["configMapRef"]["name"]]["data"])
    for e in container.get("env", []):
        env[e["name"]] = e["value"] if "value" in e else f"{container['name']}-0"
    return env


def workloads(resources):
    return {**by_kind(resources, "Deployment"), **by_kind(resources, "StatefulSet")}


def test_every_container_is_a_valid_splitserve_invocation(resources):
    parsed = {}
    for name, w in workloads(resources).items():
        (c,) = w["spec"]["template"]["spec"]["containers"]
        assert c["args"][0] in PARSERS, f"{name}: {c['args']}"
        with mock.patch.dict(os.environ, pod_env(resources, c), clear=True):
            try:
                parsed[name] = PARSERS[c["args"][0]](c["args"][1:])
            except SystemExit as exc:
                pytest.fail(f"{name}: `splitserve {' '.join(c['args'])}` rejected by its parser (exit {exc.code})")
        ports = {p["containerPort"] for p in c["ports"]}
        cfg = parsed[name]
        listen = {cfg.http_port, cfg.grpc_port} if name == "router" else {cfg.port}
        assert listen <= ports, f"{name} listens on {listen}, declares {ports}"
        for probe in ("readinessProbe", "livenessProbe"):
            assert probe in c, f"{name}: no {probe}"
        assert c["resources"]["requests"]["cpu"] and c["resources"]["requests"]["memory"]
        assert w["spec"]["template"]["spec"]["securityContext"]["runAsNonRoot"] is True
    # the router's worker lists name every StatefulSet pod, through the headless Service, on the worker's port
    sets, services = by_kind(resources, "StatefulSet"), by_kind(resources, "Service")
    for role, addrs in (("prefill", parsed["router"].prefill), ("decode", parsed["router"].decode)):
        s = sets[role]
        assert services[s["spec"]["serviceName"]]["spec"]["clusterIP"] == "None"
        expected = [f"{role}-{i}.{s['spec']['serviceName']}:{parsed[role].port}" for i in range(s["spec"]["replicas"])]
        assert list(addrs) == expected
    master = parsed["prefill"].store.master
    host, _, port = master.rpartition(":")
    assert host in services and int(port) == parsed["kvstore-master"].port
    assert parsed["kvstore-node"].master == master == parsed["decode"].store.master


def test_services_select_their_pods(resources):
    loads = workloads(resources)
    for name, svc in by_kind(resources, "Service").items():
        labels = loads[name]["spec"]["template"]["metadata"]["labels"]
        assert svc["spec"]["selector"].items() <= labels.items(), name
        named = {p["name"] for p in loads[name]["spec"]["template"]["spec"]["containers"][0]["ports"]}
        assert {p["targetPort"] for p in svc["spec"]["ports"]} <= named, name


def test_gpu_overlay_patch_applies(resources):
    jsonpatch = pytest.importorskip("jsonpatch")
    overlay = kustomization(K8S / "gpu")
    assert overlay["resources"] == [".."]
    for entry in overlay["patches"]:
        pattern = re.compile(f"^(?:{entry['target']['name']})$")
        targets = [r for r in resources if r["kind"] == entry["target"]["kind"] and pattern.match(r["metadata"]["name"])]
        assert {t["metadata"]["name"] for t in targets} == {"prefill", "decode"}
        for t in targets:
            patched = jsonpatch.apply_patch(copy.deepcopy(t), yaml.safe_load(entry["patch"]))
            kubernetes_validate.validate(patched, K8S_VERSION, strict=True)
            container = patched["spec"]["template"]["spec"]["containers"][0]
            assert container["resources"]["limits"]["nvidia.com/gpu"] == 1
            assert {"name": "PD_DEVICE", "value": "cuda"} in container["env"]  # the workers compute on the GPU


def test_every_variable_set_is_read_by_someone(resources):
    used = set()
    for folder in ("splitserve",):
        for path in (K8S.parents[1] / folder).rglob("*.py"):
            used |= set(re.findall(r"""["'](PD_[A-Z0-9_]+)["']""", path.read_text()))
    set_vars = set()
    for w in workloads(resources).values():
        set_vars |= {k for k in pod_env(resources, w["spec"]["template"]["spec"]["containers"][0]) if k.startswith("PD_")}
    assert set_vars <= used, f"manifests set variables nothing reads: {set_vars - used}"
