"""Every element of kvmesh's own API in proto/kvmesh/ has a leading comment.

The protos are compiled with protoc (grpc_tools) into a FileDescriptorSet with
source info, and every message, field, oneof, enum, enum value, service and
rpc is looked up among its file's comment locations. Map-entry messages and
the synthetic oneof of a proto3 ``optional`` field are protoc's own and have
no source to comment. SGLang's ``proto/kv_indexer/`` is left out: it is kept
as SGLang ships it.
"""

from __future__ import annotations

import importlib.util
import subprocess
import sys
from pathlib import Path

from google.protobuf import descriptor_pb2

ROOT = Path(__file__).resolve().parents[2]
PROTO_ROOT = ROOT / "proto"

# Field numbers of the descriptor messages, as source_code_info paths use them.
_FILE_MESSAGE, _FILE_ENUM, _FILE_SERVICE = 4, 5, 6
_MESSAGE_FIELD, _MESSAGE_NESTED, _MESSAGE_ENUM, _MESSAGE_ONEOF = 2, 3, 4, 8
_ENUM_VALUE = 2
_SERVICE_METHOD = 2


def _descriptor_set(
    proto_root: Path, protos: list[Path], out: Path
) -> descriptor_pb2.FileDescriptorSet:
    """Compile ``protos`` (below ``proto_root``) into one FileDescriptorSet with source info."""
    # protoc runs in a child process: grpc_tools loaded into the test process
    # makes a later import of NIXL abort it (two copies of protobuf's C++).
    spec = importlib.util.find_spec("grpc_tools")
    assert spec is not None and spec.submodule_search_locations
    include = Path(next(iter(spec.submodule_search_locations))) / "_proto"
    args = [
        sys.executable,
        "-m",
        "grpc_tools.protoc",
        "--include_source_info",
        "--include_imports",
        f"--descriptor_set_out={out}",
        f"-I{proto_root}",
        f"-I{include}",
        *[str(p.relative_to(proto_root)) for p in protos],
    ]
    done = subprocess.run(args, capture_output=True, text=True, timeout=120)
    assert done.returncode == 0, f"protoc failed on {protos}: {done.stderr}"
    return descriptor_pb2.FileDescriptorSet.FromString(out.read_bytes())


def _message_elements(
    msg: descriptor_pb2.DescriptorProto, path: tuple[int, ...], name: str
) -> list[tuple[tuple[int, ...], str]]:
    out = [(path, f"message {name}")]
    synthetic = {f.oneof_index for f in msg.field if f.proto3_optional}
    for i, oneof in enumerate(msg.oneof_decl):
        if i not in synthetic:
            out.append(((*path, _MESSAGE_ONEOF, i), f"oneof {name}.{oneof.name}"))
    for i, field in enumerate(msg.field):
        out.append(((*path, _MESSAGE_FIELD, i), f"field {name}.{field.name}"))
    for i, nested in enumerate(msg.nested_type):
        if not nested.options.map_entry:
            out += _message_elements(nested, (*path, _MESSAGE_NESTED, i), f"{name}.{nested.name}")
    for i, enum in enumerate(msg.enum_type):
        out += _enum_elements(enum, (*path, _MESSAGE_ENUM, i), f"{name}.{enum.name}")
    return out


def _enum_elements(
    enum: descriptor_pb2.EnumDescriptorProto, path: tuple[int, ...], name: str
) -> list[tuple[tuple[int, ...], str]]:
    out = [(path, f"enum {name}")]
    for i, value in enumerate(enum.value):
        out.append(((*path, _ENUM_VALUE, i), f"enum value {name}.{value.name}"))
    return out


def undocumented(fds: descriptor_pb2.FileDescriptorSet, files: set[str]) -> list[str]:
    """The elements of ``files`` (paths below the proto root) without a leading comment."""
    missing: list[str] = []
    for f in fds.file:
        if f.name not in files:
            continue
        pkg = f"{f.package}." if f.package else ""
        elements: list[tuple[tuple[int, ...], str]] = []
        for i, msg in enumerate(f.message_type):
            elements += _message_elements(msg, (_FILE_MESSAGE, i), pkg + msg.name)
        for i, enum in enumerate(f.enum_type):
            elements += _enum_elements(enum, (_FILE_ENUM, i), pkg + enum.name)
        for i, svc in enumerate(f.service):
            elements.append(((_FILE_SERVICE, i), f"service {pkg}{svc.name}"))
            for j, rpc in enumerate(svc.method):
                elements.append(
                    ((_FILE_SERVICE, i, _SERVICE_METHOD, j), f"rpc {pkg}{svc.name}.{rpc.name}")
                )
        commented = {
            tuple(loc.path) for loc in f.source_code_info.location if loc.leading_comments.strip()
        }
        missing += [f"{f.name}: {what}" for path, what in elements if path not in commented]
    return missing


def test_every_element_of_the_kvmesh_protos_is_documented(tmp_path: Path) -> None:
    protos = sorted((PROTO_ROOT / "kvmesh").rglob("*.proto"))
    assert len(protos) >= 3, protos
    fds = _descriptor_set(PROTO_ROOT, protos, tmp_path / "kvmesh.binpb")
    files = {str(p.relative_to(PROTO_ROOT)) for p in protos}
    assert files <= {f.name for f in fds.file}
    missing = undocumented(fds, files)
    assert not missing, "elements without a leading comment:\n" + "\n".join(missing)


def test_an_undocumented_element_is_listed(tmp_path: Path) -> None:
    (tmp_path / "demo.proto").write_text(
        'syntax = "proto3";\n'
        "package demo.v1;\n"
        "// A documented message.\n"
        "message Thing {\n"
        "  // Documented.\n"
        "  string name = 1;\n"
        "  uint32 size = 2;  // trailing only: not a leading comment\n"
        "  // Documented.\n"
        "  optional uint32 weight = 3;\n"
        "  // Documented.\n"
        "  map<string, uint32> tags = 4;\n"
        "  // Documented.\n"
        "  oneof choice {\n"
        "    // Documented.\n"
        "    string a = 5;\n"
        "    string b = 6;\n"
        "  }\n"
        "}\n"
        "// A documented enum.\n"
        "enum Color {\n"
        "  // Documented.\n"
        "  COLOR_UNSPECIFIED = 0;\n"
        "  COLOR_RED = 1;\n"
        "}\n"
        "service Things {\n"
        "  // Documented.\n"
        "  rpc Get(Thing) returns (Thing);\n"
        "  rpc Put(Thing) returns (Thing);\n"
        "}\n"
    )
    fds = _descriptor_set(tmp_path, [tmp_path / "demo.proto"], tmp_path / "demo.binpb")
    assert undocumented(fds, {"demo.proto"}) == [
        "demo.proto: field demo.v1.Thing.size",
        "demo.proto: field demo.v1.Thing.b",
        "demo.proto: enum value demo.v1.Color.COLOR_RED",
        "demo.proto: service demo.v1.Things",
        "demo.proto: rpc demo.v1.Things.Put",
    ]
