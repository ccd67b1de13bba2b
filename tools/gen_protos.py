"""Regenerate the Python stubs under kvmesh/api/ from proto/.

Run: python tools/gen_protos.py [--check]

All generated code lives in one place: proto ``kvmesh/<service>/v1/x.proto``
becomes ``kvmesh/api/<service>/v1/x_pb2*.py`` and SGLang's
``kv_indexer/v1/kv_indexer.proto`` becomes ``kvmesh/api/kv_indexer/v1/``. The
proto packages (and so the wire: service and message full names) are
unchanged; protoc writes imports for the proto paths, and this script rewrites
them to the ``kvmesh.api`` package (the only edit made to protoc's output).
Generated files (``*_pb2.py``, ``*_pb2.pyi``, ``*_pb2_grpc.py``,
``*_pb2_grpc.pyi``) are committed. ``--check`` regenerates into a temporary
folder and fails when the committed files differ, so CI catches stale stubs.
"""

from __future__ import annotations

import argparse
import filecmp
import re
import shutil
import sys
import tempfile
from pathlib import Path

from grpc_tools import protoc

ROOT = Path(__file__).resolve().parent.parent
PROTO_ROOT = ROOT / "proto"
OUT_ROOT = ROOT / "kvmesh" / "api"  # proto kvmesh/x/v1/y.proto -> kvmesh.api.x.v1.y_pb2
INIT_TEXT = '"""Generated from proto/: do not edit. Regenerate with tools/gen_protos.py."""\n'


def _protos() -> list[Path]:
    return sorted(PROTO_ROOT.rglob("*.proto"))


def _api_path(proto: Path) -> Path:
    """Where a proto's stubs go below ``kvmesh/api``: its path without a leading ``kvmesh/``."""
    rel = proto.relative_to(PROTO_ROOT)
    return rel.relative_to("kvmesh") if rel.parts[0] == "kvmesh" else rel


#: protoc's import of another generated module (``from kvmesh.x.v1 import y_pb2``).
_IMPORT = re.compile(r"^(\s*)(from|import) (kvmesh\.(?!api\.)|kv_indexer\.)", re.MULTILINE)


def _rewrite_imports(text: str) -> str:
    def repl(m: re.Match[str]) -> str:
        sub = "kv_indexer." if m.group(3) == "kv_indexer." else ""
        return f"{m.group(1)}{m.group(2)} kvmesh.api.{sub}"

    return _IMPORT.sub(repl, text)


def generate(out: Path) -> list[Path]:
    """Generate stubs for every proto into ``out`` (the ``kvmesh/api`` folder); return them."""
    with tempfile.TemporaryDirectory() as raw:
        return _generate(Path(raw), out)


def _generate(raw: Path, out: Path) -> list[Path]:
    protos = _protos()
    include = Path(protoc.__file__).resolve().parent / "_proto"
    args = [
        "protoc",
        f"-I{PROTO_ROOT}",
        f"-I{include}",
        f"--python_out={raw}",
        f"--pyi_out={raw}",
        f"--grpc_python_out={raw}",
        f"--plugin=protoc-gen-mypy_grpc={Path(sys.executable).parent / 'protoc-gen-mypy_grpc'}",
        f"--mypy_grpc_out={raw}",
        *[str(p.relative_to(PROTO_ROOT)) for p in protos],
    ]
    if protoc.main(args) != 0:
        raise SystemExit("protoc failed")
    written: list[Path] = []
    for proto in protos:
        src_dir = raw / proto.relative_to(PROTO_ROOT).parent
        pkg_dir = out / _api_path(proto).parent
        pkg_dir.mkdir(parents=True, exist_ok=True)
        # Every generated folder is a regular package so that tools resolve it.
        d = pkg_dir
        while d != out:
            init = d / "__init__.py"
            if not init.exists():
                init.write_text(INIT_TEXT)
            d = d.parent
        for suffix in ("_pb2.py", "_pb2.pyi", "_pb2_grpc.py", "_pb2_grpc.pyi"):
            name = f"{proto.stem}{suffix}"
            (pkg_dir / name).write_text(_rewrite_imports((src_dir / name).read_text()))
            written.append(pkg_dir / name)
    return written


def main() -> int:
    parser = argparse.ArgumentParser(description=__doc__)
    parser.add_argument("--check", action="store_true", help="fail if committed stubs are stale")
    ns = parser.parse_args()
    if not ns.check:
        generate(OUT_ROOT)
        return 0
    with tempfile.TemporaryDirectory() as tmp:
        tmp_path = Path(tmp)
        stale = []
        for f in generate(tmp_path):
            rel = f.relative_to(tmp_path)
            committed = OUT_ROOT / rel
            if not committed.exists() or not filecmp.cmp(f, committed, shallow=False):
                stale.append(str(rel))
        if stale:
            print("stale generated stubs (run python tools/gen_protos.py):", *stale, sep="\n  ")
            return 1
        shutil.rmtree(tmp_path, ignore_errors=True)
    print("generated stubs are fresh")
    return 0


if __name__ == "__main__":
    sys.exit(main())
