"""The image, built and started without Docker.

What the Dockerfile does, step by step, on this machine: the build context is
the repository filtered by .dockerignore (Docker's rules, dockerignore.py),
copied to a temporary folder; the build stage's ``pip wheel`` command builds
the wheel there; a fresh virtual environment (no system site packages) stands
in for the runtime stage and gets the runtime stage's ``pip install``
commands (dockerfile.py reads them, ``ARG`` defaults included, so NIXL too
when ``WITH_NIXL`` defaults to 1). Then every component the Helm chart runs
starts from that environment with the chart's own command, args and env
(rendered by Helm's engine, translated to this machine by pods.py), outside
the repository and with nothing of the source tree on its path; each must
answer SERVING, pass the chart's ``helm test`` pod, and exit 0 on SIGTERM.
The engine-with-bridge example runs the same way over the chart's two indexer
replicas, real vLLM event publishers standing in for its engine containers:
the engines publish through their bridges, the headless Service resolving to
both replicas, and the index must equal what the engines hold.

One environment serves the whole session. With a warm pip cache the module
takes well under a minute and a half; a cold cache downloads the
dependencies, hence the module's generous timeout.
"""

from __future__ import annotations

import asyncio
import dataclasses
import json
import os
import shutil
import signal
import subprocess
import sys
import time
import urllib.request
import zipfile
from collections.abc import Callable, Iterator
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import grpc
import helm_python
import pytest
from grpc_health.v1 import health_pb2, health_pb2_grpc

from lab.children import stop_all
from tests.install import dockerfile, pods
from tests.install.dockerignore import DockerIgnore

ROOT = Path(__file__).resolve().parents[2]
CHART = ROOT / "helm" / "kvmesh"
EXAMPLE = ROOT / "helm" / "examples" / "engine-with-xfer"
#: The top-level packages of the tree: every folder of the root with an __init__.py
#: but the tests (a new one must reach the wheel without anyone listing it here).
TOP_PACKAGES = tuple(
    sorted(p.name for p in ROOT.iterdir() if (p / "__init__.py").is_file() and p.name != "tests")
)

# A cold pip cache downloads every dependency (~100 MB); warm, the module needs ~30 s.
pytestmark = pytest.mark.timeout(900)

#: How long a component may take to answer SERVING (seconds): a cold start on a
#: busy two-core machine imports grpc, numpy, NIXL... in several processes at once.
READY_TIMEOUT_S = 90.0
#: How long a component may take to exit after SIGTERM (the indexer's drain grace is 10 s).
STOP_TIMEOUT_S = 30.0
#: Pages of each xfer pool: the chart's 4096 x 64 KiB would be 256 MiB per pool in
#: /dev/shm for no gain here; the geometry is otherwise the chart's.
POOL_PAGES = 256


@dataclass
class Image:
    """The stand-in for the image: a virtual environment and the image's environment."""

    root: Path
    venv: Path
    wheel: Path
    context: list[str]
    #: The image's environment (its ENV lines and a PATH whose first entry is the venv's).
    env: dict[str, str]
    #: Whether the Dockerfile installs NIXL by default (ARG WITH_NIXL).
    nixl: bool

    @property
    def python(self) -> Path:
        """The environment's interpreter."""
        return self.venv / "bin" / "python"

    def run(self, *argv: str, timeout: float = 120) -> subprocess.CompletedProcess[str]:
        """Run a command of the image in /tmp's stand-in, with the image's environment."""
        cwd = self.root / "work"
        cwd.mkdir(exist_ok=True)
        assert not cwd.resolve().is_relative_to(ROOT), "run the image outside the repository"
        return subprocess.run(
            list(argv), cwd=cwd, env=self.env, capture_output=True, text=True, timeout=timeout
        )


def _stages() -> tuple[dockerfile.Stage, dockerfile.Stage]:
    found = dockerfile.stages((ROOT / "Dockerfile").read_text("utf-8"))
    assert len(found) == 2, "expected a build stage and a runtime stage"
    return found[0], found[1]


def _copy_context(files: list[str], dest: Path) -> None:
    for rel in files:
        src, dst = ROOT / rel, dest / rel
        dst.parent.mkdir(parents=True, exist_ok=True)
        if src.is_symlink():
            os.symlink(os.readlink(src), dst)
        else:
            shutil.copy2(src, dst)


def _pip(python: Path, args: list[str], cwd: Path, wheels: Path, env: dict[str, str]) -> None:
    """Run one of the Dockerfile's pip commands with the paths of this machine."""
    mapped: list[str] = []
    for arg in args:
        if arg == "--no-cache-dir":
            continue  # the image keeps no cache; here it would only re-download every run
        if arg.startswith("/wheels"):
            rest = arg[len("/wheels") :].lstrip("/")
            matches = sorted(wheels.glob(rest)) if rest else [wheels]
            assert matches, f"pip {' '.join(args)}: nothing matches {arg}"
            mapped += [str(m) for m in matches]
        else:
            mapped.append(arg)
    done = subprocess.run(
        [str(python), "-m", "pip", *mapped],
        cwd=cwd,
        env=env,
        capture_output=True,
        text=True,
        timeout=840,
    )
    assert done.returncode == 0, f"pip {' '.join(args)} failed:\n{done.stdout}\n{done.stderr}"


@pytest.fixture(scope="session")
def context_files() -> list[str]:
    """The build context: the repository's files that .dockerignore keeps."""
    return list(DockerIgnore.from_file(ROOT / ".dockerignore").context_files(ROOT))


@pytest.fixture(scope="session")
def image(tmp_path_factory: pytest.TempPathFactory, context_files: list[str]) -> Iterator[Image]:
    """Build the wheel and install it as the Dockerfile does (once per session).

    The environment (about 450 MB with NIXL) is removed at the end of the session.
    """
    build, runtime = _stages()
    root = tmp_path_factory.mktemp("image")
    src, wheels, venv = root / "src", root / "wheels", root / "venv"
    _copy_context(context_files, src)
    wheels.mkdir()
    subprocess.run([sys.executable, "-m", "venv", str(venv)], check=True, timeout=120)
    # pip keeps this machine's settings (index, cache); nothing of the source tree.
    pip_env = {
        k: v
        for k, v in os.environ.items()
        if k not in ("PYTHONPATH", "PYTHONHOME", "VIRTUAL_ENV", "PYTHONSTARTUP")
    }
    pip_env.update(runtime.env)
    python = venv / "bin" / "python"
    for args in dockerfile.pip_commands(build):
        _pip(python, args, src, wheels, pip_env)
    built = sorted(wheels.glob("kvmesh-*.whl"))
    assert len(built) == 1, f"the build stage made {built}"
    for args in dockerfile.pip_commands(runtime):
        _pip(python, args, src, wheels, pip_env)
    home = root / "home"
    home.mkdir()
    env = {
        "PATH": f"{venv / 'bin'}:/usr/local/bin:/usr/bin:/bin",
        "HOME": str(home),
        "LANG": "C.UTF-8",
        **runtime.env,
    }
    yield Image(
        root=root,
        venv=venv,
        wheel=built[0],
        context=context_files,
        env=env,
        nixl=runtime.args.get("WITH_NIXL") == "1",
    )
    shutil.rmtree(root, ignore_errors=True)


# -- the Dockerfile and the build context ----------------------------------------------


def test_the_build_stage_copies_the_whole_context() -> None:
    build, runtime = _stages()
    assert build.copies == [". ."], "the build stage must copy the context, not named folders"
    wheel_steps = [a for a in dockerfile.pip_commands(build) if a[:1] == ["wheel"]]
    assert len(wheel_steps) == 1 and "--no-deps" in wheel_steps[0], wheel_steps
    assert runtime.args.get("WITH_NIXL") in ("0", "1")


def test_the_context_keeps_the_packages_and_leaves_out_development_folders(
    context_files: list[str],
) -> None:
    files = set(context_files)
    assert {"pyproject.toml", "README.md"} <= files
    tops = {f.split("/")[0] for f in files}
    assert {"kvmesh", "indexer", "router_client", "tee", "xfer", "lab"} <= set(TOP_PACKAGES)
    assert set(TOP_PACKAGES) <= tops
    for left_out in ("tests", "docs", "helm", ".git", ".venv", "node_modules", "clients", "tools"):
        assert left_out not in tops, left_out
    for f in files:
        parts = f.split("/")
        assert "__pycache__" not in parts and "node_modules" not in parts, f
        assert not any(p.endswith(".egg-info") for p in parts), f
    for f in _tree_package_files():
        assert f in files, f"{f} is left out of the build context"


# -- the wheel -------------------------------------------------------------------------


def _tree_package_files() -> list[str]:
    """Every file the wheel must hold: the files of each package of the tree.

    A package is a folder with ``__init__.py`` under a top-level package other
    than tests; its files include data in plain subfolders (indexer/redis/lua,
    lab/data). Left out: bytecode, each folder's README.md, and hidden or backup
    files an editor may leave.
    """
    out: list[str] = []
    for top in TOP_PACKAGES:
        for dirpath, dirnames, filenames in os.walk(ROOT / top):
            dirnames[:] = [d for d in dirnames if d != "__pycache__" and not d.startswith(".")]
            for f in filenames:
                if f == "README.md" or f.startswith(".") or f.endswith((".pyc", ".pyo", "~")):
                    continue
                out.append((Path(dirpath) / f).relative_to(ROOT).as_posix())
    return sorted(out)


def _wheel_files(wheel: Path) -> set[str]:
    with zipfile.ZipFile(wheel) as z:
        record = next(n for n in z.namelist() if n.endswith(".dist-info/RECORD"))
        return {line.split(",")[0] for line in z.read(record).decode().splitlines() if line}


def test_the_wheel_holds_every_package_and_data_file_of_the_tree(image: Image) -> None:
    in_wheel = _wheel_files(image.wheel)
    missing = [f for f in _tree_package_files() if f not in in_wheel]
    assert not missing, "the wheel lacks:\n" + "\n".join(missing)
    packages = {f.rsplit("/", 1)[0] for f in _tree_package_files() if f.endswith("/__init__.py")}
    assert all(f"{p}/__init__.py" in in_wheel for p in packages)
    assert not any(f.startswith("tests/") for f in in_wheel)


def test_the_image_imports_the_installed_wheel_not_the_tree(image: Image) -> None:
    code = (
        "import importlib, sys\n"
        f"for name in {[*TOP_PACKAGES, 'kvmesh.api.indexer.v1.indexer_pb2']!r}:\n"
        "    print(importlib.import_module(name).__file__)\n"
        "print('\\n'.join(sys.path))\n"
    )
    for flags in ([], ["-I"]):
        done = image.run(str(image.python), *flags, "-c", code)
        assert done.returncode == 0, done.stderr
        site = str(image.venv)
        lines = [line for line in done.stdout.splitlines() if line]
        for path in lines[: len(TOP_PACKAGES) + 1]:
            assert path.startswith(site), path
        assert not any(line.startswith(str(ROOT)) for line in lines), lines
    done = image.run("kvmesh", "--help")
    assert done.returncode == 0, done.stderr
    assert "quickstart" in done.stdout and "indexer" in done.stdout
    assert shutil.which("kvmesh", path=image.env["PATH"]) == str(image.venv / "bin" / "kvmesh")


def test_quickstart_runs_from_the_image_on_the_bundled_trace(image: Image) -> None:
    done = image.run("kvmesh", "quickstart", "--requests", "200", "--prompts", "2")
    assert done.returncode == 0, done.stdout + done.stderr
    assert "Match latency p50" in done.stdout and "done in" in done.stdout


def test_nixl_is_in_the_image_when_the_dockerfile_installs_it(image: Image) -> None:
    done = image.run(
        str(image.python), "-c", "from xfer.transport import nixl_available as a; print(a())"
    )
    assert done.returncode == 0, done.stderr
    assert done.stdout.strip() == str(image.nixl)


# -- every component of the chart ------------------------------------------------------


def _render(chart: Path, values: dict[str, Any]) -> list[dict[str, Any]]:
    loaded = helm_python.Chart.load(str(chart))
    return pods.manifests(loaded.render(values, name="rel", namespace="ns"))


class Running:
    """A component's process, its log, and how to tell that it serves."""

    def __init__(self, pod: pods.LocalPod, image: Image) -> None:
        self.pod = pod
        exe = shutil.which(pod.argv[0], path=pod.env["PATH"])
        assert exe is not None and exe.startswith(str(image.venv)), (pod.argv, exe)
        self.log_path = pod.cwd / f"{pod.name}.log"
        with self.log_path.open("wb") as log:
            self.proc = subprocess.Popen(
                [exe, *pod.argv[1:]], cwd=pod.cwd, env=pod.env, stdout=log, stderr=log
            )

    def log(self) -> str:
        """The tail of the component's output."""
        return self.log_path.read_text("utf-8", "replace")[-4000:]

    def check(self, service: str = "") -> str:
        """The grpc.health.v1 status of ``service`` on the readiness probe's port."""
        assert self.pod.grpc_probe_port is not None
        with grpc.insecure_channel(f"127.0.0.1:{self.pod.grpc_probe_port}") as channel:
            try:
                reply = health_pb2_grpc.HealthStub(channel).Check(
                    health_pb2.HealthCheckRequest(service=service), timeout=2
                )
            except grpc.RpcError as e:
                return str(e.code())
        return str(health_pb2.HealthCheckResponse.ServingStatus.Name(reply.status))

    def stop(self) -> int:
        """SIGTERM, then the exit code (SIGKILL and a failure past the timeout)."""
        if self.proc.poll() is None:
            self.proc.send_signal(signal.SIGTERM)
        try:
            return self.proc.wait(STOP_TIMEOUT_S)
        except subprocess.TimeoutExpired:
            self.proc.kill()
            self.proc.wait()
            pytest.fail(f"{self.pod.name} did not exit {STOP_TIMEOUT_S} s after SIGTERM")


def _http_ok(url: str) -> bool:
    try:
        with urllib.request.urlopen(url, timeout=2) as r:
            return bool(r.status == 200)
    except OSError:
        return False


def _wait_serving(running: list[Running], extra: dict[str, list[str]]) -> None:
    """Until each component answers SERVING (and ``extra`` services), or fail."""
    deadline = time.monotonic() + READY_TIMEOUT_S
    waiting = {r.pod.name: r for r in running}
    while waiting:
        for name, r in list(waiting.items()):
            if r.proc.poll() is not None:
                pytest.fail(f"{name} exited with {r.proc.returncode} at start:\n{r.log()}")
            ok = all(r.check(s) == "SERVING" for s in ["", *extra.get(name, [])])
            if ok and "http" in r.pod.ports:
                ok = _http_ok(f"http://{r.pod.address('http')}/healthz")
            if ok:
                del waiting[name]
        if waiting and time.monotonic() > deadline:
            states = {n: r.check() for n, r in waiting.items()}
            logs = "\n".join(f"--- {n}\n{r.log()}" for n, r in waiting.items())
            pytest.fail(f"not SERVING after {READY_TIMEOUT_S} s: {states}\n{logs}")
        time.sleep(0.2)


@pytest.fixture
def redis_for_the_chart() -> Iterator[tuple[str, str]]:
    """A Redis with the chart's ACL user (kvmesh) on a free port: (address, password)."""
    from lab.redisproc import RedisProcess

    password = "install-test-password"
    with RedisProcess(users={"kvmesh": password}) as proc:
        yield f"127.0.0.1:{proc.port}", password


@pytest.fixture
def shm_volume(tmp_path: Path) -> Iterator[Path]:
    """A folder of /dev/shm (a memory-backed volume, as the chart's) removed afterwards."""
    base = Path("/dev/shm") if Path("/dev/shm").is_dir() else tmp_path
    path = base / f"kvmesh-install-{os.getpid()}-{time.monotonic_ns()}"
    path.mkdir()
    yield path
    shutil.rmtree(path, ignore_errors=True)


def test_every_component_of_the_chart_starts_serves_and_stops(
    image: Image, tmp_path: Path, redis_for_the_chart: tuple[str, str], shm_volume: Path
) -> None:
    from indexer.sglang.server import SGLANG_SERVICE_NAME
    from xfer.pool import KVPool, PoolGeometry

    redis_address, redis_password = redis_for_the_chart
    # The release with the chart's defaults (indexer on Redis, tee, cache simulator, the
    # helm test pod), an indexer on the memory backend (SGLang API on, the default),
    # and the example engine chart's prefill and decode sidecars.
    release = _render(CHART, {})
    memory = _render(CHART, {"indexer": {"backend": "memory", "replicas": 1}})
    engine_chart = tmp_path / "engine-with-xfer"
    shutil.copytree(EXAMPLE, engine_chart)
    shutil.copytree(CHART, engine_chart / "charts" / "kvmesh")
    transport = "nixl" if image.nixl else "tcp"
    engine = _render(
        engine_chart,
        {"kvmesh": {"xfer": {"transport": transport, "pool": {"pageCount": POOL_PAGES}}}},
    )

    cluster = pods.Cluster()
    cluster.add_services(release)
    # The chart's internal Redis runs Redis's own image: a local redis-server stands in.
    cluster.outside["rel-kvmesh-redis:6379"] = redis_address
    secrets = tmp_path / "redis-auth"
    secrets.mkdir()
    (secrets / "password").write_text(redis_password)

    def place(
        spec: dict[str, Any], name: str, mounts: dict[str, Path] | None = None
    ) -> pods.LocalPod:
        tmp = tmp_path / f"{name}-tmp"
        tmp.mkdir()
        return pods.localize(
            spec,
            name=name,
            cluster=cluster,
            mounts={"/tmp": tmp, **(mounts or {})},
            base_env=image.env,
        )

    cachesim = place(
        pods.container(release, "Deployment", "rel-kvmesh-cachesim", "cachesim"), "cachesim"
    )
    cluster.pods["cachesim"] = cachesim
    tee = place(pods.container(release, "Deployment", "rel-kvmesh-tee", "tee"), "tee")
    cluster.pods["tee"] = tee
    indexer = place(
        pods.container(release, "Deployment", "rel-kvmesh-indexer", "indexer"),
        "indexer-redis",
        {"/etc/kvmesh/redis-auth": secrets},
    )
    cluster.pods["indexer"] = indexer
    indexer_memory = place(
        pods.container(memory, "Deployment", "rel-kvmesh-indexer", "indexer"), "indexer-memory"
    )
    specs: list[pods.LocalPod] = [cachesim, tee, indexer, indexer_memory]
    sidecars: list[pods.LocalPod] = []
    for role in ("prefill", "decode"):
        pod_shm = shm_volume / role
        pod_shm.mkdir()
        sidecars.append(
            place(
                pods.container(engine, "Deployment", f"rel-{role}", "kvmesh-xfer"),
                f"xfer-{role}",
                {"/dev/shm": pod_shm},
            )
        )
        assert sidecars[-1].env["KVMESH_XFER_TRANSPORT"] == transport
    health_pod = place(
        pods.container(release, "Pod", "rel-kvmesh-test-health", "health"), "helm-test"
    )

    pools: list[KVPool] = []
    running: list[Running] = []
    try:
        # The engine creates the pool; the sidecar attaches to it.
        for env in (s.env for s in sidecars):
            geometry = PoolGeometry(
                page_size=int(env["KVMESH_XFER_POOL__PAGE_SIZE"]),
                page_count=int(env["KVMESH_XFER_POOL__PAGE_COUNT"]),
                aux_size=int(env["KVMESH_XFER_POOL__AUX_SIZE"]),
                aux_count=int(env["KVMESH_XFER_POOL__AUX_COUNT"]),
            )
            pools.append(KVPool.create(env["KVMESH_XFER_POOL__PATH"], geometry))
        for spec in [*specs, *sidecars]:
            running.append(Running(spec, image))
        _wait_serving(running, {"indexer-memory": [SGLANG_SERVICE_NAME]})
        # The chart's `helm test` pod, run from the image against the three Services.
        exe = shutil.which(health_pod.argv[0], path=health_pod.env["PATH"])
        assert exe == str(image.python), exe
        done = subprocess.run(
            [exe, *health_pod.argv[1:]],
            cwd=health_pod.cwd,
            env=health_pod.env,
            capture_output=True,
            text=True,
            timeout=60,
        )
        assert done.returncode == 0, done.stdout + done.stderr
        assert done.stdout.count(": SERVING") == 3, done.stdout
        codes = {r.pod.name: r.stop() for r in running}
        bad = {n: c for n, c in codes.items() if c != 0}
        logs = "\n".join(f"--- {r.pod.name}\n{r.log()}" for r in running if r.pod.name in bad)
        assert not bad, f"exit codes after SIGTERM: {bad}\n{logs}"
    finally:
        for r in running:
            if r.proc.poll() is None:
                r.proc.kill()
                r.proc.wait()
        for pool in pools:
            pool.close()
            pool.unlink()


# -- the engine + bridge install -------------------------------------------------------

BRIDGE_EXAMPLE = ROOT / "helm" / "examples" / "engine-with-bridge"
#: The example's engine pods (its default 2 replicas), named as a ReplicaSet names them.
ENGINE_PODS = ("rel-engine-5c7d9-a1b2c", "rel-engine-5c7d9-d3e4f")
#: The workload: the first trace requests, each cut to its first trace blocks (512 tokens,
#: 32 engine blocks each), and what an engine holds before it evicts, in trace blocks.
BRIDGE_REQUESTS = 12
BRIDGE_PROMPT_BLOCKS = 3
BRIDGE_CAPACITY = 8


def _keys_of_trace_blocks(
    parent: dict[int, int | None], model: str, block_size: int
) -> Callable[[int], list[int]]:
    """The index's keys of each trace block: its 512 tokens at the engine's block size."""
    from kvmesh.blockkeys import chain_keys, namespace_seed
    from lab.engines.vllm_publishers import trace_tokens

    seed = namespace_seed(model)
    memo: dict[int, list[int]] = {}

    def of(h: int) -> list[int]:
        path: list[int] = []
        node: int | None = h
        while node is not None and node not in memo:
            path.append(node)
            node = parent.get(node)
        last = seed if node is None else memo[node][-1]
        for b in reversed(path):
            memo[b] = chain_keys(last, trace_tokens([b])[0].tolist(), block_size)
            last = memo[b][-1]
        return memo[h]

    return of


def _get(url: str) -> str:
    """The body of an HTTP 200 answer to GET ``url``."""
    with urllib.request.urlopen(url, timeout=2) as r:
        assert r.status == 200, (url, r.status)
        return str(r.read().decode("utf-8", "replace"))


def _arg_after(argv: list[str], flag: str) -> str:
    return argv[argv.index(flag) + 1]


async def test_engines_publish_through_their_bridges_to_every_indexer_replica(
    image: Image, tmp_path: Path, redis_for_the_chart: tuple[str, str]
) -> None:
    """The engine-with-bridge example over the chart's two indexer replicas, as rendered.

    The kvmesh chart (release ``kvmesh`` in namespace ``kvmesh``, the target the
    example's values name) runs its two indexer replicas on Redis; each of the
    example's two engine pods runs its ``kvmesh-bridge`` container as rendered,
    and a real vLLM ``ZmqEventPublisher`` stands in for its engine container on
    the endpoints the engine's ``--kv-events-config`` names (the pod's loopback,
    where the bridge binds). The headless Service resolves to both replicas.
    Once both pods are registered, replica A is stopped (SIGTERM, exit 0): the
    engines then publish, and the bridges must reach replica B through the same
    target; the index (DumpIndex) and a router's Matches (IndexerClient, round
    robin over the target the bridges dial) must equal what the engines hold.
    """
    from kvmesh.api.indexer.v1 import indexer_pb2_grpc as pb_grpc
    from lab.engines.vllm_publishers import TRACE_BLOCK_TOKENS
    from lab.traces import load_mooncake
    from lab.workload import TRACE_MODEL
    from router_client.config import IndexerClientSettings
    from router_client.indexer_client import IndexerClient
    from tests.integration.test_bridge import (
        EventStreams,
        applied_through,
        assert_index_is_truth,
        dumped,
        listed,
        plan_fleet,
        wait_for,
    )

    redis_address, redis_password = redis_for_the_chart
    # A short drain, so that replica A's SIGTERM ends its streams soon (a chart value).
    release = pods.manifests(
        helm_python.Chart.load(str(CHART)).render(
            {"indexer": {"shutdownGraceSeconds": 1}}, name="kvmesh", namespace="kvmesh"
        )
    )
    engine_chart = tmp_path / "engine-with-bridge"
    shutil.copytree(BRIDGE_EXAMPLE, engine_chart)
    shutil.copytree(CHART, engine_chart / "charts" / "kvmesh")
    # The engines serve the trace's model (any name; the helpers read this one).
    engines = _render(engine_chart, {"engine": {"model": TRACE_MODEL}})
    replicas = next(d for d in release if d["metadata"]["name"] == "kvmesh-indexer")
    assert replicas["spec"]["replicas"] == 2
    engine_deployment = next(d for d in engines if d["metadata"]["name"] == "rel-engine")
    assert engine_deployment["spec"]["replicas"] == len(ENGINE_PODS)

    cluster = pods.Cluster()
    cluster.add_services(release)
    assert "kvmesh-indexer-headless" in cluster.headless
    cluster.outside["kvmesh-redis:6379"] = redis_address
    secrets = tmp_path / "redis-auth"
    secrets.mkdir()
    (secrets / "password").write_text(redis_password)

    def folder(name: str) -> Path:
        path = tmp_path / f"{name}-tmp"
        path.mkdir()
        return path

    indexer_spec = pods.container(release, "Deployment", "kvmesh-indexer", "indexer")
    indexers = [
        pods.localize(
            indexer_spec,
            name=f"indexer-{x}",
            cluster=cluster,
            mounts={"/tmp": folder(f"indexer-{x}"), "/etc/kvmesh/redis-auth": secrets},
            base_env=image.env,
        )
        for x in "ab"
    ]
    for pod in indexers:
        cluster.add_replica("indexer", pod)
    bridges: list[pods.LocalPod] = []
    downwards: list[dict[str, str]] = []
    publishers: list[list[str]] = []
    block_sizes: set[int] = set()
    for i, pod_name in enumerate(ENGINE_PODS):
        loopback: dict[int, int] = {}  # the pod's network namespace: its containers share it
        downward = {"metadata.name": pod_name, "metadata.uid": f"0b1c{i}-uid-{pod_name}"}
        downwards.append(downward)

        def in_pod(
            container: str,
            name: str,
            downward: dict[str, str] = downward,
            loopback: dict[int, int] = loopback,
        ) -> Any:
            """The pod's ``container``, run here as ``name`` (its own /tmp)."""
            return pods.localize(
                pods.container(engines, "Deployment", "rel-engine", container),
                name=name,
                cluster=cluster,
                mounts={"/tmp": folder(name)},
                base_env=image.env,
                downward=downward,
                loopback=loopback,
            )

        engine = in_pod("engine", f"engine-{i}")
        bridges.append(in_pod("kvmesh-bridge", f"bridge-{i}"))
        events = json.loads(_arg_after(engine.argv, "--kv-events-config"))
        assert events["publisher"] == "zmq" and events["topic"] == "", events
        publishers.append([events["endpoint"], events["replay_endpoint"]])
        block_sizes.add(int(_arg_after(engine.argv, "--block-size")))
        api_port = int(_arg_after(engine.argv, "--port"))
    # Each pod's stream stays on its own loopback, one local port per pod.
    assert len({tuple(p) for p in publishers}) == len(ENGINE_PODS), publishers
    # The bridges (and the router below) dial every replica the headless Service lists.
    target = bridges[0].env["KVMESH_BRIDGE_INDEXER__TARGET"]
    assert target == "ipv4:" + ",".join(p.address("grpc") for p in indexers), target
    assert all(b.env["KVMESH_BRIDGE_INDEXER__TARGET"] == target for b in bridges)
    (block_size,) = block_sizes
    assert indexers[0].env["KVMESH_INDEXER_BLOCK_SIZE"] == str(block_size)

    requests = [
        dataclasses.replace(r, hash_ids=r.hash_ids[:BRIDGE_PROMPT_BLOCKS])
        for r in load_mooncake(limit=BRIDGE_REQUESTS)
    ]
    fleet = plan_fleet(requests, len(ENGINE_PODS), BRIDGE_CAPACITY)
    keys = _keys_of_trace_blocks(fleet.parent, TRACE_MODEL, block_size)
    truth = {
        pod_name: {k for h in held for k in keys(h)}
        for pod_name, held in zip(ENGINE_PODS, fleet.held, strict=True)
    }
    plan = {
        "block_size": block_size,
        "buffer_steps": 10_000,
        "interval_s": 0.05,
        "streams": fleet.streams,
        "endpoints": publishers,
    }

    work = tmp_path / "engines"
    work.mkdir()
    streams = EventStreams(work)
    streams.start()  # vLLM imports while the image's processes start
    t0 = time.monotonic()
    at: dict[str, float] = {}
    running: list[Running] = []
    client: IndexerClient | None = None
    channel = None
    try:
        running = [Running(p, image) for p in [*indexers, *bridges]]
        _wait_serving(running, {})
        at["serving"] = time.monotonic() - t0
        loop = asyncio.get_running_loop()
        for b in bridges:
            url = f"http://{b.address('bridge-metrics')}/metrics"
            assert "kvmesh_bridge_" in await loop.run_in_executor(None, _get, url), url
        await loop.run_in_executor(None, streams.wait_ready)
        at["vllm"] = time.monotonic() - t0
        streams.open(0, plan)

        channel = grpc.aio.insecure_channel(indexers[1].address("grpc"))
        stub = pb_grpc.IndexerServiceStub(channel)

        async def registered() -> bool:
            return set(await listed(stub)) == set(ENGINE_PODS)

        await wait_for(registered, 20.0, "both engine pods registered")
        infos = await listed(stub)
        for i, pod_name in enumerate(ENGINE_PODS):
            # The instance is the pod: its name, the engine's API on the pod IP, its uid.
            api = bridges[i].loopback[api_port]
            assert infos[pod_name].address == f"http://{pods.POD_IP}:{api}", infos[pod_name]
            assert infos[pod_name].incarnation.startswith(downwards[i]["metadata.uid"])
        # Replica A leaves (as on a rollout): its streams end, the bridges move to B.
        a = running[0]
        assert a.stop() == 0, a.log()
        at["replica_a_stopped"] = time.monotonic() - t0
        streams.command("go 0", "go 0")
        await loop.run_in_executor(None, lambda: streams.child.wait_line(60.0, word="OK"))
        last_seq = {w: len(s) - 1 for w, s in zip(ENGINE_PODS, fleet.streams, strict=True)}

        await wait_for(
            lambda: applied_through(stub, last_seq),
            20.0,
            "every engine's last batch applied through replica B",
        )
        at["caught_up"] = time.monotonic() - t0
        got = await dumped(stub)
        assert_index_is_truth(got, truth)

        # A router dials the same target, round robin, and Matches every prompt.
        client = IndexerClient(
            target,
            settings=IndexerClientSettings(load_balancing="round_robin", deadline_ms=3000),
            model=TRACE_MODEL,
        )
        seen: set[str] = set()
        for req in requests:
            prompt = [k for h in req.hash_ids for k in keys(h)]
            outcome = await client.match(prompt)
            assert outcome.ok, outcome
            want_depths = {}
            for pod_name, held in zip(ENGINE_PODS, fleet.held, strict=True):
                d = 0
                while d < len(req.hash_ids) and req.hash_ids[d] in held:
                    d += 1
                if d:
                    want_depths[pod_name] = d * (TRACE_BLOCK_TOKENS // block_size)
            answer = {w: m.depth for w, m in outcome.matches.items()}
            assert answer == want_depths, req.hash_ids
            seen |= answer.keys()
        assert seen == set(ENGINE_PODS), seen

        # The bridges first (their streams end), then the last replica.
        codes = {r.pod.name: r.stop() for r in [*running[2:], running[1]]}
        at["stopped"] = time.monotonic() - t0
        print(
            f"\nengine + bridge install: {fleet.stored} trace blocks stored, "
            f"{fleet.removed} removed, {fleet.clears} cleared; index blocks "
            f"{ {w: len(k) for w, k in got.items()} }; seconds since start: "
            f"{ {k: round(v, 1) for k, v in at.items()} }"
        )
        bad = {n: c for n, c in codes.items() if c != 0}
        logs = "\n".join(f"--- {r.pod.name}\n{r.log()}" for r in running if r.pod.name in bad)
        assert not bad, f"exit codes after SIGTERM: {bad}\n{logs}"
    finally:
        if client is not None:
            await client.close()
        if channel is not None:
            await channel.close()
        for r in running:
            if r.proc.poll() is None:
                r.proc.kill()
                r.proc.wait()
        stop_all([streams.child])
