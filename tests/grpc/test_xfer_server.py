"""XferService over gRPC: status codes for bad input, health, config and CLI.

Sidecars run in a thread of the test process (TCP backend) on free ports
(tests/grpc/conftest.py).
"""

from __future__ import annotations

import json
import os
import random
import time
from pathlib import Path
from typing import Any

import grpc
import pytest
from grpc_health.v1 import health_pb2, health_pb2_grpc

from indexer.config import ConfigError
from kvmesh.api.xfer.v1 import xfer_pb2 as pb
from kvmesh.api.xfer.v1 import xfer_pb2_grpc as pb_grpc
from kvmesh.errors import FailedPrecondition, InvalidArgument, NotFound
from lab.bench.xfer_procs import ThreadedSidecar
from tests.grpc.conftest import XFER_AUX, XFER_AUXN, XFER_PAGE, XFER_PAGES, xfer_config
from xfer import cli
from xfer.client import XferClient
from xfer.config import PoolSettings, load_config
from xfer.logic import AlreadyExists
from xfer.server import SERVICE_NAME


def _bootstrap(**kw: Any) -> pb.BootstrapRequest:
    base: dict[str, Any] = dict(
        room=1, generation=1, dst_page_indices=[1, 2], aux_index=0, peer_name="peer-x",
        peer_address="127.0.0.1:1", page_size=XFER_PAGE, page_count=XFER_PAGES, aux_size=XFER_AUX,
        aux_count=XFER_AUXN, transport="tcp",
    )  # fmt: skip
    base.update(kw)
    return pb.BootstrapRequest(**base)


def test_bad_input_maps_to_status_codes(sidecars: tuple[ThreadedSidecar, ThreadedSidecar]) -> None:
    p, d = sidecars
    with XferClient(p.address) as pc, XferClient(d.address) as dc:
        with pytest.raises(NotFound):
            pc.poll(12345)
        with pytest.raises(NotFound):
            dc.clear(12345)
        with pytest.raises(InvalidArgument, match="page index 64"):
            pc.add_transfer_request(1, [64], (0, 1), True, 0, 0)
        with pytest.raises(InvalidArgument, match="source pages for"):
            pc.add_transfer_request(1, [1, 2], (0, 3), True, 0, 0)
        with pytest.raises(InvalidArgument, match="page index"):
            dc.register_room(1, p.address, [XFER_PAGES + 5], 0)
        with pytest.raises(ValueError):  # uint32 on the wire: negatives cannot be sent
            pc.add_transfer_request(1, [-1], (0, 1), True, 0, 0)
        with pytest.raises(FailedPrecondition, match="needs decode"):
            pc.register_room(1, p.address, [1], 0)
    with grpc.insecure_channel(p.address) as ch:
        stub = pb_grpc.XferServiceStub(ch)
        with pytest.raises(grpc.RpcError) as e:
            stub.Bootstrap(_bootstrap())  # no metadata from a peer never seen
        assert e.value.code() == grpc.StatusCode.FAILED_PRECONDITION
        assert "unknown peer" in (e.value.details() or "")
        md = p.server.transport.metadata() if p.server else b""
        stub.Bootstrap(_bootstrap(agent_metadata=md))
        with pytest.raises(grpc.RpcError) as e:
            stub.Bootstrap(_bootstrap())
        assert e.value.code() == grpc.StatusCode.ALREADY_EXISTS
        with pytest.raises(grpc.RpcError) as e:
            stub.Bootstrap(_bootstrap(room=2, transport="nixl"))
        assert e.value.code() == grpc.StatusCode.FAILED_PRECONDITION
        with pytest.raises(grpc.RpcError) as e:
            stub.Bootstrap(_bootstrap(room=3, dst_page_indices=[1, XFER_PAGES]))
        assert e.value.code() == grpc.StatusCode.INVALID_ARGUMENT
        trailing = dict(e.value.trailing_metadata() or ())
        assert trailing.get("kvmesh-error-field") == "dst_page_indices"


def test_register_bootstraps_and_duplicate_is_already_exists(
    sidecars: tuple[ThreadedSidecar, ThreadedSidecar],
) -> None:
    p, d = sidecars
    with XferClient(p.address) as pc, XferClient(d.address) as dc:
        dc.register_room(7, p.address, [3, 4], 1)
        with pytest.raises(AlreadyExists):
            dc.register_room(7, p.address, [3, 4], 1)
        pc.add_transfer_request(7, [10, 11], (0, 2), True, 2, 0)
        deadline = time.monotonic() + 5
        while dc.poll(7)[0] != 4 and time.monotonic() < deadline:
            time.sleep(0.005)
        assert dc.poll(7) == (4, "")
        assert p.server is not None and d.server is not None
        pp, dp = p.server.pool, d.server.pool
        assert bytes(pp.page(10)) + bytes(pp.page(11)) == bytes(dp.page(3)) + bytes(dp.page(4))


def test_bootstrap_to_a_missing_prefill_fails_the_room(
    sidecars: tuple[ThreadedSidecar, ThreadedSidecar],
) -> None:
    _, d = sidecars
    with XferClient(d.address) as dc:
        dc.register_room(9, "127.0.0.1:1", [1], 0)
        deadline = time.monotonic() + 10
        while dc.poll(9)[0] != 0 and time.monotonic() < deadline:
            time.sleep(0.01)
        status, reason = dc.poll(9)
        assert status == 0 and "bootstrap failed: UNAVAILABLE" in reason


def test_health_serving(sidecars: tuple[ThreadedSidecar, ThreadedSidecar]) -> None:
    p, _ = sidecars
    with grpc.insecure_channel(p.address) as ch:
        stub = health_pb2_grpc.HealthStub(ch)
        for name in ("", SERVICE_NAME):
            resp = stub.Check(health_pb2.HealthCheckRequest(service=name))
            assert resp.status == health_pb2.HealthCheckResponse.SERVING


def test_config_layers_and_unknown_keys(tmp_path: Path) -> None:
    f = tmp_path / "x.yaml"
    f.write_text(
        "role: prefill\nqueues: 2\npool: {path: /dev/shm/x, page_size: 4096, page_count: 8}\n"
    )
    cfg = load_config(f, environ={"KVMESH_XFER_QUEUES": "3"}, cli={"queues": None})
    assert (cfg.role, cfg.queues, cfg.pool.page_size) == ("prefill", 3, 4096)
    cfg = load_config(f, environ={"KVMESH_XFER_QUEUES": "3"}, cli={"queues": 5})
    assert cfg.queues == 5
    with pytest.raises(ConfigError, match="queuez"):
        load_config(f, environ={"KVMESH_XFER_QUEUEZ": "3"})
    with pytest.raises(ConfigError, match=r"pool\.page_size"):
        load_config(f, environ={"KVMESH_XFER_POOL__PAGE_SIZE": "0"})


def test_cli_print_config(capsys: pytest.CaptureFixture[str]) -> None:
    rc = cli.main(
        ["--role", "decode", "--pool-path", "/dev/shm/y", "--page-size", "64",
         "--page-count", "4", "--transport", "tcp", "--print-config"]
    )  # fmt: skip
    assert rc == 0
    out = json.loads(capsys.readouterr().out)
    assert out["role"] == "decode" and out["pool"]["page_count"] == 4 and out["queues"] == 4
    with pytest.raises(SystemExit):
        cli.main(["--role", "sideways"])
    assert cli.main(["--pool-path", "/x", "--page-size", "1", "--page-count", "1"]) == 2


def test_pool_file_missing_is_a_clear_start_error(tmp_path: Path) -> None:
    path = tmp_path / f"missing-{random.getrandbits(16)}"
    cfg = xfer_config("decode", path).model_copy(
        update={"pool": PoolSettings(path=str(path), page_size=XFER_PAGE, page_count=XFER_PAGES)}
    )
    with pytest.raises(FileNotFoundError):
        ThreadedSidecar(cfg).start()
    assert not os.path.exists(path)
