"""The Node.js client's command line (clients/node/generate.js) without a server: ``--help`` prints every option
with its default and exits 0, a usage error is one line and exit 2; both before `npm ci` too (the gRPC
packages load only when a call is made)."""

from __future__ import annotations

import re
import shutil
import subprocess
from pathlib import Path

import pytest

GENERATE = Path(__file__).resolve().parents[1] / "clients" / "node" / "generate.js"


@pytest.fixture(scope="module")
def node() -> str:
    path = shutil.which("node")
    if path is None:
        pytest.skip("node not installed")
    return path


def run(node: str, *args: str, **env: str) -> subprocess.CompletedProcess:
    return subprocess.run([node, str(GENERATE), *args], capture_output=True, text=True, timeout=30, env=env or None)


@pytest.mark.parametrize("flag", ["--help", "-h"])
def test_help_lists_every_option_and_exits_0(node, flag):
    out = run(node, flag, "ignored prompt")
    assert out.returncode == 0 and out.stderr == "", out.stderr
    assert out.stdout.startswith("usage: node generate.js [options] PROMPT")
    declared = re.findall(r"^  '?([a-z-]+)'?: \{ type:", GENERATE.read_text(), re.MULTILINE)
    assert len(declared) >= 9
    for name in declared:
        line = next((line for line in out.stdout.splitlines() if f"--{name}" in line), None)
        assert line is not None, f"--{name} missing from --help"
        assert len(line.split(None, 2 if name in ("json", "help") else 3)) > 2, line  # described
    assert "(default: 127.0.0.1:50050)" in out.stdout and "(default: 64)" in out.stdout


def test_help_shows_the_environment_router_but_never_the_api_key(node):
    env = {"PATH": "/usr/bin:/bin", "PD_ROUTER_GRPC": "example:1234", "PD_API_KEY": "sekrit-node-key"}
    out = run(node, "--help", **env)
    assert out.returncode == 0 and "(default: example:1234)" in out.stdout and "sekrit-node-key" not in out.stdout


@pytest.mark.parametrize("args", [["--bogus", "hi"], [], ["one", "two"]])
def test_usage_errors_exit_2_with_one_error_line(node, args):
    out = run(node, *args)
    assert out.returncode == 2 and out.stdout == ""
    lines = out.stderr.splitlines()
    assert lines[0] == "usage: node generate.js [options] PROMPT" and lines[1].startswith("error: ") and len(lines) == 2
