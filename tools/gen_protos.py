"""Regenerate the Python stubs under kvmesh/<service>/v1/ from proto/.

Run: python tools/gen_protos.py [--check]

Generated files (``*_pb2.py``, ``*_pb2.pyi``, ``*_pb2_grpc.py``,
``*_pb2_grpc.pyi``) are committed. ``--check`` regenerates into a temporary
folder and fails when the committed files differ, so CI catches stale stubs.
"""

from __future__ import annotations

import argparse
import filecmp
import shutil
import sys
import tempfile
from pathlib import Path

from grpc_tools import protoc

ROOT = Path(__file__).resolve().parent.parent
PROTO_ROOT = ROOT / "proto"
OUT_ROOT = ROOT  # proto path kvmesh/x/v1/y.proto -> python module kvmesh.x.v1.y_pb2
INIT_TEXT = '"""Generated from proto/: do not edit. Regenerate with tools/gen_protos.py."""\n'


def _protos() -> list[Path]:
    return sorted(PROTO_ROOT.rglob("*.proto"))


def generate(out: Path) -> list[Path]:
    """Generate stubs for every proto into ``out``; return the files written."""
    protos = _protos()
    include = Path(protoc.__file__).resolve().parent / "_proto"
    args = [
        "protoc",
        f"-I{PROTO_ROOT}",
        f"-I{include}",
        f"--python_out={out}",
        f"--pyi_out={out}",
        f"--grpc_python_out={out}",
        f"--plugin=protoc-gen-mypy_grpc={Path(sys.executable).parent / 'protoc-gen-mypy_grpc'}",
        f"--mypy_grpc_out={out}",
        *[str(p.relative_to(PROTO_ROOT)) for p in protos],
    ]
    if protoc.main(args) != 0:
        raise SystemExit("protoc failed")
    written: list[Path] = []
    for proto in protos:
        pkg_dir = out / proto.relative_to(PROTO_ROOT).parent
        # Every generated folder is a regular package so that tools resolve it.
        d = pkg_dir
        while d != out and d != out / "kvmesh":
            init = d / "__init__.py"
            if not init.exists():
                init.write_text(INIT_TEXT)
            d = d.parent
        stem = proto.stem
        for suffix in ("_pb2.py", "_pb2.pyi", "_pb2_grpc.py", "_pb2_grpc.pyi"):
            written.append(pkg_dir / f"{stem}{suffix}")
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
        (tmp_path / "kvmesh").mkdir()
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
