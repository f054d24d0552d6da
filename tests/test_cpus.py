"""``--cpus``: CPU lists, pinning every thread of a worker process, and ``up``'s per-role pinning."""

from __future__ import annotations

import os
import subprocess
import sys
import textwrap

import pytest

from splitserve.cpus import check_cpus, format_cpus, parse_cpus
from splitserve.launcher import up_cluster
from splitserve.services.worker_config import WorkerConfig
from splitserve.up_config import UpConfig, parse

pytestmark = pytest.mark.unit


def test_parse_and_format_round_trip():
    assert parse_cpus("0") == {0}
    assert parse_cpus("0,2-3, 5") == {0, 2, 3, 5}
    assert format_cpus({0, 2, 3, 5}) == "0,2-3,5"
    assert format_cpus(parse_cpus("1-4,7")) == "1-4,7"


@pytest.mark.parametrize("text", ["", "a", "1-", "3-1", "0,,1", "-1"])
def test_malformed_lists_are_refused(text):
    with pytest.raises(ValueError, match="CPU list"):
        parse_cpus(text)


def test_cpus_outside_the_allowed_set_are_refused_naming_them():
    beyond = max(os.sched_getaffinity(0)) + 1
    with pytest.raises(ValueError, match=rf"CPUs \[{beyond}\] are not available"):
        check_cpus(f"0,{beyond}")
    with pytest.raises(ValueError, match="--cpus"):
        WorkerConfig(model="m", cpus=str(beyond))
    with pytest.raises(ValueError, match="--decode-cpus"):
        UpConfig(model="m", decode_cpus=str(beyond))


def test_pin_process_pins_threads_started_before_and_after():
    cpu = min(os.sched_getaffinity(0))
    code = textwrap.dedent(f"""
        import os, threading, time
        from splitserve.cpus import pin_process
        stop = threading.Event()
        early = threading.Thread(target=stop.wait); early.start()
        pin_process("{cpu}")
        late = threading.Thread(target=stop.wait); late.start()
        import torch
        torch.set_num_threads(2); torch.ones(512, 512) @ torch.ones(512, 512)  # starts the intra-op pool
        masks = {{tid: os.sched_getaffinity(int(tid)) for tid in os.listdir("/proc/self/task")}}
        stop.set()
        print(len(masks), sorted({{c for m in masks.values() for c in m}}))
    """)
    out = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, timeout=120, check=True).stdout
    num_threads, cpus = out.split(" ", 1)
    assert int(num_threads) >= 3  # main + the two threads (+ torch's pool)
    assert cpus.strip() == f"[{cpu}]"


def test_up_pins_each_role_to_its_cpus_and_leaves_others_alone():
    cpu = str(min(os.sched_getaffinity(0)))
    config = parse(["--prefill", "2", "--decode", "1", "--prefill-cpus", cpu, "--no-store", "--http-port", "0", "--grpc-port", "0"])
    assert config.role_args() == {"prefill": ["--cpus", cpu]}
    cluster, _, _ = up_cluster(config)
    argvs = {c.name: c.argv for c in cluster.children}
    for name in ("prefill-0", "prefill-1"):
        argv = argvs[name]
        assert argv[argv.index("--cpus") + 1] == cpu
    assert "--cpus" not in argvs["decode-0"] and "--cpus" not in argvs["router"]

