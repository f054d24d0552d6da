"""The KV transfer flags shared by the worker commands (:mod:`splitserve.services.kv_transfer_config`): the same argv
gives the same settings under ``splitserve prefill`` / ``decode`` and ``splitserve worker``, and each is checked the
same way."""

from __future__ import annotations

import pytest

from splitserve.services.decode import config as decode_config
from splitserve.services.prefill import config as prefill_config
from splitserve.services.worker import config as worker_config

SOURCE = ["--data-host", "10.0.0.7", "--data-port", "7001", "--data-advertise", "kv.example:9", "--kv-lease-s", "4.5"]
PULL = ["--kv-transfer-timeout-s", "3", "--kv-transfer-failure", "error", "--kv-checksum"]


def _fields(cfg, names):
    return {n: getattr(cfg, n) for n in names}


def test_kv_source_flags_parse_alike_for_prefill_and_worker():
    names = ("data_host", "data_port", "data_advertise", "kv_lease_s")
    want = {"data_host": "10.0.0.7", "data_port": 7001, "data_advertise": "kv.example:9", "kv_lease_s": 4.5}
    assert _fields(prefill_config.parse(SOURCE), names) == want == _fields(worker_config.parse(SOURCE), names)


def test_kv_pull_flags_parse_alike_for_decode_and_worker():
    names = ("kv_transfer_timeout_s", "kv_transfer_failure", "kv_checksum")
    want = {"kv_transfer_timeout_s": 3.0, "kv_transfer_failure": "error", "kv_checksum": True}
    assert _fields(decode_config.parse(PULL), names) == want == _fields(worker_config.parse(PULL), names)
    assert worker_config.parse(["--no-kv-checksum"]).kv_checksum is False


@pytest.mark.parametrize("argv, match", [(["--kv-lease-s", "0"], "kv_lease_s"), (["--data-port", "70000"], "--data-port"),
                                         (["--data-advertise", "nocolon"], "data_advertise")])
def test_bad_kv_source_values_are_refused_by_both(argv, match):
    for mod in (prefill_config, worker_config):
        with pytest.raises(ValueError, match=match):
            mod.parse(argv)


def test_bad_kv_pull_values_are_refused_by_both():
    for mod in (decode_config, worker_config):
        with pytest.raises(ValueError, match="kv_transfer_timeout_s"):
            mod.parse(["--kv-transfer-timeout-s", "0"])
        with pytest.raises(SystemExit):  # argparse: not one of the choices
            mod.parse(["--kv-transfer-failure", "bogus"])
