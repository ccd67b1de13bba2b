"""``proto/buf.gen.yaml`` generates TypeScript and Python stubs of the whole API.

buf (node_modules, from ``make setup``; installed here when missing) runs the
template as ``make stubs`` does, into a temporary folder: the TypeScript has a
service descriptor for each service of proto/kvmesh/ and a schema for each of
its messages, and the Python carries the same file descriptors as the committed
stubs under kvmesh/api/ (those come from tools/gen_protos.py; buf adds each
field's json_name, which protoc's Python output leaves out, so json_name is
cleared before comparing).
"""

from __future__ import annotations

import ast
import re
import shutil
import subprocess
from pathlib import Path

import pytest
from google.protobuf import descriptor_pb2

from kvmesh.api.indexer.v1 import indexer_pb2
from kvmesh.api.tee.v1 import tee_pb2
from kvmesh.api.xfer.v1 import xfer_pb2

ROOT = Path(__file__).resolve().parents[2]
BUF = ROOT / "node_modules" / ".bin" / "buf"
PROTOC_GEN_ES = ROOT / "node_modules" / ".bin" / "protoc-gen-es"

#: proto path -> (committed module, services it defines).
PROTOS = {
    "kvmesh/indexer/v1/indexer.proto": (indexer_pb2, ("IndexerService",)),
    "kvmesh/tee/v1/tee.proto": (tee_pb2, ("TeeService", "CacheSimService")),
    "kvmesh/xfer/v1/xfer.proto": (xfer_pb2, ("XferService",)),
}


@pytest.fixture(scope="module")
def out(tmp_path_factory: pytest.TempPathFactory) -> Path:
    """The template's output; node_modules installed first (``npm ci``, as the
    Makefile does) when buf or protoc-gen-es is missing."""
    if not (BUF.exists() and PROTOC_GEN_ES.exists()):
        npm = shutil.which("npm")
        assert npm is not None, "npm is not on PATH and node_modules lacks buf or protoc-gen-es"
        subprocess.run(
            [npm, "ci", "--no-audit", "--no-fund", "--loglevel=error"],
            cwd=ROOT,
            check=True,
            timeout=300,
        )
    out = tmp_path_factory.mktemp("stubs")
    proc = subprocess.run(
        [str(BUF), "generate", "--template", "buf.gen.yaml", "-o", str(out)],
        cwd=ROOT / "proto",
        capture_output=True,
        text=True,
        timeout=60,
    )
    assert proc.returncode == 0, proc.stderr
    return out


def _serialized_file(path: Path) -> descriptor_pb2.FileDescriptorProto:
    """The file descriptor a generated ``_pb2.py`` adds to the pool (read, not imported:
    the committed stubs already hold the same file names in the default pool)."""
    for node in ast.walk(ast.parse(path.read_text())):
        if (
            isinstance(node, ast.Call)
            and isinstance(node.func, ast.Attribute)
            and node.func.attr == "AddSerializedFile"
        ):
            arg = node.args[0]
            assert isinstance(arg, ast.Constant) and isinstance(arg.value, bytes)
            return descriptor_pb2.FileDescriptorProto.FromString(arg.value)
    raise AssertionError(f"no AddSerializedFile in {path}")


def _without_json_names(
    fd: descriptor_pb2.FileDescriptorProto,
) -> descriptor_pb2.FileDescriptorProto:
    fd = descriptor_pb2.FileDescriptorProto.FromString(fd.SerializeToString())
    todo = list(fd.message_type)
    while todo:
        msg = todo.pop()
        for field in msg.field:
            field.ClearField("json_name")
        todo += msg.nested_type
    return fd


@pytest.mark.parametrize("proto", sorted(PROTOS))
def test_typescript_defines_every_service_and_message(out: Path, proto: str) -> None:
    module, services = PROTOS[proto]
    ts = (out / "ts" / proto.replace(".proto", "_pb.ts")).read_text()
    for service in services:
        assert re.search(rf"^export const {service}: GenService<", ts, re.MULTILINE), service
    for message in module.DESCRIPTOR.message_types_by_name:
        assert re.search(rf"^export type {message} = Message<", ts, re.MULTILINE), message
        assert f"export const {message}Schema: GenMessage<{message}>" in ts, message


@pytest.mark.parametrize("proto", sorted(PROTOS))
def test_python_matches_the_committed_stubs(out: Path, proto: str) -> None:
    module, _ = PROTOS[proto]
    generated = _serialized_file(out / "python" / proto.replace(".proto", "_pb2.py"))
    committed = descriptor_pb2.FileDescriptorProto.FromString(module.DESCRIPTOR.serialized_pb)
    assert generated.name == committed.name == proto
    assert [m.name for m in generated.message_type] == [m.name for m in committed.message_type]
    assert _without_json_names(generated) == _without_json_names(committed)
    assert (out / "python" / proto.replace(".proto", "_pb2.pyi")).is_file()
