"""docs/engines.md and the chart's NOTES.txt say only what the code accepts.

- Every ``vllm serve`` and ``sglang.launch_server`` line of docs/engines.md,
  and the engine command lines the example chart renders, parse with the
  engine's own argument parser (vLLM 0.33 in ``.venv-vllm``, SGLang 0.5.23 in
  ``.venv-sglang``, run in a subprocess): vLLM's refuses an unknown
  ``--kv-events-config`` key, SGLang's ignores one, so its keys are checked
  against SGLang's ``KVEventsConfig`` fields here.
- Each engine line and the ``kvmesh`` line after it agree: ports by
  data-parallel rank, who binds and who connects (each engine's own rule),
  block size.
- Every ``kvmesh ...`` line of the page and of NOTES.txt (rendered by Helm's
  engine for several value sets) parses with the real command-line parser,
  and ``kvmesh bridge`` / ``kvmesh indexer serve`` lines load as valid configs.
- Every YAML block loads: indexer configs as :class:`IndexerConfig`, bridge
  configs as :class:`BridgeConfig`, chart values by rendering the example chart.
- Every dotted config key the page names exists in the indexer's, bridge's or
  router's config model or in the chart's values.

Without the engine virtualenvs the engine tests fail saying to run ``make setup``.
"""

from __future__ import annotations

import argparse
import json
import os
import re
import shlex
import shutil
import subprocess
from collections.abc import Iterator
from pathlib import Path
from typing import Any

import pytest
import yaml
from pydantic import BaseModel

from indexer.bridge.config import BridgeConfig
from indexer.config import IndexerConfig
from kvmesh import cli
from lab.conformance import vllm_python
from lab.conformance_sglang import sglang_python
from router_client.config import RouterConfig

ROOT = Path(__file__).resolve().parents[2]
DOC = ROOT / "docs" / "engines.md"
CHART = ROOT / "helm" / "kvmesh"
EXAMPLE = ROOT / "helm" / "examples" / "engine-with-bridge"
#: The comment that marks a YAML block of the page as values of the example chart.
VALUES_MARK = "# values of helm/examples/engine-with-bridge"

_SGLANG_LAUNCH = ["python3", "-m", "sglang.launch_server"]

#: Run by vLLM's interpreter: each argv (after ``vllm serve``) through ``vllm serve``'s
#: own parser and EngineArgs; what the engine would be configured with, as JSON.
_VLLM_SCRIPT = """
import dataclasses, json, sys
from vllm.engine.arg_utils import EngineArgs
from vllm.entrypoints.common.cli_args import make_arg_parser
from vllm.utils.argparse_utils import FlexibleArgumentParser
parser = make_arg_parser(FlexibleArgumentParser(prog="vllm serve"))
out = []
for argv in json.load(sys.stdin):
    try:
        ns = parser.parse_args(argv)
    except SystemExit as e:
        out.append({"error": f"exit {e.code}"})
        continue
    if ns.model_tag:
        ns.model = ns.model_tag
    ea = EngineArgs.from_cli_args(ns)
    kv = ea.kv_events_config
    out.append({"kv": dataclasses.asdict(kv) if kv else None, "block_size": ea.block_size,
                "dp": ea.data_parallel_size})
print(json.dumps(out))
"""

#: Run by SGLang's interpreter (lab.engines.sglang_engine makes SGLang importable on a
#: CPU-only torch): each argv through ``sglang.launch_server``'s own parser.
_SGLANG_SCRIPT = """
import argparse, json, sys
import lab.engines.sglang_engine
from sglang.srt.disaggregation.kv_events import KVEventsConfig
from sglang.srt.server_args import ServerArgs
parser = argparse.ArgumentParser(prog="sglang serve")
ServerArgs.add_cli_args(parser)
out = []
for argv in json.load(sys.stdin):
    try:
        ns = parser.parse_args(argv)
    except SystemExit as e:
        out.append({"error": f"exit {e.code}"})
        continue
    raw = json.loads(ns.kv_events_config or "{}")
    cfg = KVEventsConfig.from_cli(ns.kv_events_config) if ns.kv_events_config else None
    out.append({"kv": cfg.model_dump() if cfg else None,
                "unknown": sorted(set(raw) - set(KVEventsConfig.model_fields)),
                "page_size": ns.page_size, "dp": ns.dp_size})
print(json.dumps(out))
"""

#: Lines no engine accepts: each parser must refuse (vLLM) or flag (SGLang) them.
_BAD_VLLM = ["M", "--kv-events-config", '{"enable_kv_cache_events": true, "endpont": "x"}']
_BAD_SGLANG = ["--model-path", "M", "--kv-events-config", '{"publisher": "zmq", "endpont": "x"}']


# -- reading the page ----------------------------------------------------------------


def code_blocks(text: str, lang: str) -> list[str]:
    """The bodies of the fenced ``lang`` blocks of ``text``."""
    return re.findall(rf"^```{lang}\n(.*?)^```", text, flags=re.M | re.S)


def command_lines(block: str) -> list[list[str]]:
    """The shell commands of a block as argv lists: continuation lines joined, and a
    quoted argument that spans lines kept whole."""
    out: list[list[str]] = []
    pending = ""
    for line in re.sub(r"\\\n", " ", block).splitlines():
        if not pending and (not line.strip() or line.lstrip().startswith("#")):
            continue
        pending = f"{pending}\n{line}" if pending else line
        try:
            argv = shlex.split(pending)
        except ValueError:  # an open quote: the command goes on
            continue
        out.append(argv)
        pending = ""
    assert not pending, f"unterminated command: {pending!r}"
    return out


def doc_text() -> str:
    return DOC.read_text()


def engine_of(argv: list[str]) -> str | None:
    """``vllm``, ``sglang`` or ``None`` for a command line."""
    if argv[:2] == ["vllm", "serve"]:
        return "vllm"
    if argv[:3] == _SGLANG_LAUNCH:
        return "sglang"
    return None


def engine_args(argv: list[str]) -> list[str]:
    """The arguments the engine's own parser reads (the program words dropped)."""
    return argv[2:] if engine_of(argv) == "vllm" else argv[3:]


def doc_commands() -> list[list[list[str]]]:
    """Per sh block of the page, its command lines."""
    return [command_lines(b) for b in code_blocks(doc_text(), "sh")]


def flag(argv: list[str], name: str) -> str | None:
    """The value of ``--name V`` in ``argv`` (None when absent)."""
    for i, word in enumerate(argv[:-1]):
        if word == name:
            return argv[i + 1]
    return None


# -- the engines' own parsers ---------------------------------------------------------


def run_engine_parser(engine: str, lines: list[list[str]]) -> list[dict[str, Any]]:
    """What the engine's own parser makes of each line (``{"error": ...}`` for a refusal)."""
    if engine == "vllm":
        python, script = vllm_python(), _VLLM_SCRIPT
        env = {**os.environ, "VLLM_TARGET_DEVICE": "cpu", "VLLM_LOGGING_LEVEL": "ERROR"}
    else:
        python, script = sglang_python(), _SGLANG_SCRIPT
        env = {**os.environ, "PYTHONPATH": str(ROOT)}
    proc = subprocess.run(
        [str(python), "-c", script],
        input=json.dumps(lines),
        capture_output=True,
        text=True,
        env=env,
        cwd=ROOT,
        timeout=300,
    )
    assert proc.returncode == 0, proc.stderr[-3000:]
    result: list[dict[str, Any]] = json.loads(proc.stdout.strip().splitlines()[-1])
    assert len(result) == len(lines)
    return result


def render_example(values: dict[str, Any], dest: Path) -> list[dict[str, Any]]:
    """The example engine chart (this kvmesh chart vendored) rendered with ``values``."""
    import helm_python

    if not dest.exists():
        shutil.copytree(EXAMPLE, dest)
        shutil.copytree(CHART, dest / "charts" / "kvmesh")
    out = helm_python.Chart.load(str(dest)).render(values, name="rel", namespace="ns")
    docs: list[dict[str, Any]] = []
    for path, text in sorted(out.items()):
        if path.endswith(".yaml"):
            docs += [d for d in yaml.safe_load_all(text) if d]
    return docs


def doc_values() -> list[dict[str, Any]]:
    """The chart values blocks of the page."""
    return [yaml.safe_load(b) for b in code_blocks(doc_text(), "yaml") if b.startswith(VALUES_MARK)]


def chart_engine_lines(tmp: Path) -> list[list[str]]:
    """The engine containers' command lines the example chart renders: its defaults for
    vLLM and for SGLang, and each values block of the page."""
    value_sets = [{"engine": {"kind": "vllm"}}, {"engine": {"kind": "sglang"}}, *doc_values()]
    lines = []
    for values in value_sets:
        for doc in render_example(values, tmp / "chart"):
            if doc["kind"] == "Deployment":
                spec = doc["spec"]["template"]["spec"]
                (engine,) = [c for c in spec["containers"] if c["name"] == "engine"]
                lines.append([*engine["command"], *engine["args"]])
    return lines


@pytest.fixture(scope="module")
def engine_results(tmp_path_factory: pytest.TempPathFactory) -> dict[str, Any]:
    """Every engine line (the page's, the chart's, and one bad line per engine) with what
    the engine's parser made of it."""
    tmp = tmp_path_factory.mktemp("engine-docs")
    lines = [argv for block in doc_commands() for argv in block if engine_of(argv)]
    lines += chart_engine_lines(tmp)
    out: dict[str, Any] = {}
    for engine, bad in (("vllm", _BAD_VLLM), ("sglang", _BAD_SGLANG)):
        mine = [argv for argv in lines if engine_of(argv) == engine]
        results = run_engine_parser(engine, [*(engine_args(a) for a in mine), bad])
        out[engine] = list(zip(mine, results[:-1], strict=True))
        out[f"{engine}-bad"] = results[-1]
    return out


def test_the_page_shows_both_engines_with_and_without_the_bridge() -> None:
    pairs = {
        (engine_of(b[0]), " ".join(b[1][:3]))
        for b in doc_commands()
        if len(b) == 2 and engine_of(b[0])
    }
    for engine in ("vllm", "sglang"):
        assert (engine, "kvmesh bridge --indexer") in pairs
        assert (engine, "kvmesh indexer serve") in pairs


def test_engine_lines_parse_with_the_engines_own_parsers(engine_results: dict[str, Any]) -> None:
    assert engine_results["vllm"] and engine_results["sglang"]
    for engine in ("vllm", "sglang"):
        for argv, got in engine_results[engine]:
            assert "error" not in got, f"{engine} refuses {shlex.join(argv)}"
            kv = got["kv"]
            assert kv is not None and kv["publisher"] == "zmq", argv
            if engine == "vllm":
                assert kv["enable_kv_cache_events"] is True, argv
            else:
                assert got["unknown"] == [], f"SGLang ignores {got['unknown']} in {argv}"
                assert kv["format"] == "default", argv
            raw = json.loads(flag(argv, "--kv-events-config") or "{}")
            assert {k: kv[k] for k in raw} == raw, argv  # every key taken as written


def test_the_parsers_refuse_what_they_do_not_know(engine_results: dict[str, Any]) -> None:
    """The check itself: a misspelt key is refused by vLLM and flagged for SGLang."""
    assert "error" in engine_results["vllm-bad"]
    assert engine_results["sglang-bad"]["unknown"] == ["endpont"]


def _engine_binds(engine: str, endpoint: str, bind: bool | None) -> bool:
    """Whether the engine binds its PUB endpoint (vLLM's and SGLang's own rules)."""
    if engine == "sglang" and bind is not None:
        return bind
    host_wild = "*" in endpoint or "::" in endpoint or endpoint.startswith(("ipc://", "inproc://"))
    return host_wild or (engine == "sglang" and "0.0.0.0" in endpoint)


def _offset(endpoint: str, rank: int) -> str:
    """vLLM's and SGLang's offset_endpoint_port for tcp endpoints."""
    if rank == 0:
        return endpoint
    base, _, port = endpoint.rpartition(":")
    return f"{base}:{int(port) + rank}"


def _port(endpoint: str | None) -> str | None:
    return endpoint.rpartition(":")[2] if endpoint and endpoint.startswith("tcp://") else endpoint


def _kvmesh_config(argv: list[str], monkeypatch: pytest.MonkeyPatch) -> Any:
    words, ns = parse_kvmesh(argv, monkeypatch)
    if words == ("bridge",):
        from indexer.bridge.cli import config_from_args as bridge_config

        return bridge_config(ns)
    from indexer.cli import config_from_args as indexer_config

    return indexer_config(ns)


def test_each_engine_line_and_its_kvmesh_line_agree(
    engine_results: dict[str, Any], monkeypatch: pytest.MonkeyPatch
) -> None:
    """Ports by rank, bind on exactly one side, the block size: engine and kvmesh alike."""
    parsed = {
        tuple(argv): got for engine in ("vllm", "sglang") for argv, got in engine_results[engine]
    }
    checked = 0
    for block in doc_commands():
        if len(block) != 2 or not engine_of(block[0]) or block[1][0] != "kvmesh":
            continue
        engine, (eng, kv_line) = engine_of(block[0]), block
        got = parsed[tuple(eng)]
        kv = got["kv"]
        config = _kvmesh_config(kv_line, monkeypatch)
        endpoints = config.engine_events.endpoints
        ranks = sorted(ep.dp_rank for ep in endpoints)
        assert ranks == list(range(got["dp"] or 1)), (kv_line, got["dp"])
        binds = _engine_binds(engine, kv["endpoint"], kv.get("bind"))
        for ep in endpoints:
            assert ep.bind is not binds, f"{ep.worker_id}: both or neither side binds {ep.endpoint}"
            want = _offset(kv["endpoint"], ep.dp_rank)
            want_replay = (
                _offset(kv["replay_endpoint"], ep.dp_rank) if kv["replay_endpoint"] else None
            )
            if kv_line[1] == "bridge":
                # Beside the engine: the very endpoint (loopback or the pod's ipc path).
                assert ep.endpoint == want and ep.replay_endpoint == want_replay, ep
            else:
                # Across the network: the engine's host instead of its wildcard.
                assert _port(ep.endpoint) == _port(want), ep
                assert _port(ep.replay_endpoint) == _port(want_replay), ep
            assert ep.topic == kv["topic"], ep
        size = got["block_size"] if engine == "vllm" else got["page_size"]
        if isinstance(config, IndexerConfig):
            assert config.block_size_for(endpoints[0].model) == size
        if engine == "sglang":
            assert all(ep.keys == "engine_hashes" for ep in endpoints)
        checked += 1
    assert checked >= 6


# -- kvmesh command lines --------------------------------------------------------------


class _Parsed(Exception):
    """Raised from a command's parse_args with what it parsed, so that nothing runs."""

    def __init__(self, ns: argparse.Namespace) -> None:
        super().__init__()
        self.ns = ns


def parse_kvmesh(
    argv: list[str], monkeypatch: pytest.MonkeyPatch
) -> tuple[tuple[str, ...], argparse.Namespace]:
    """``argv`` (``kvmesh ...``) parsed by the command's own parser, nothing run."""
    assert argv[0] == "kvmesh"
    found = cli._lookup(argv[1:])
    assert found is not None, f"not a kvmesh command: {shlex.join(argv)}"
    original = argparse.ArgumentParser.parse_args

    def capture(self: argparse.ArgumentParser, *args: Any, **kwargs: Any) -> Any:
        raise _Parsed(original(self, *args, **kwargs))

    with monkeypatch.context() as m:
        m.setattr(argparse.ArgumentParser, "parse_args", capture)
        try:
            cli.main(argv[1:])
        except _Parsed as p:
            return found[0], p.ns
        except SystemExit as e:
            raise AssertionError(f"{shlex.join(argv)} does not parse (exit {e.code})") from None
    raise AssertionError(f"{shlex.join(argv)} ran without parsing its arguments")


def doc_kvmesh_lines() -> list[list[str]]:
    return [argv for block in doc_commands() for argv in block if argv[0] == "kvmesh"]


def test_every_kvmesh_line_of_the_page_parses_and_loads(
    monkeypatch: pytest.MonkeyPatch, capsys: pytest.CaptureFixture[str]
) -> None:
    lines = doc_kvmesh_lines()
    assert len(lines) >= 7
    for argv in lines:
        words, _ = parse_kvmesh(argv, monkeypatch)
        if words in (("bridge",), ("indexer", "serve")):
            config = _kvmesh_config(argv, monkeypatch)
            assert config.engine_events.endpoints, argv


def test_the_parse_check_catches_a_wrong_flag(monkeypatch: pytest.MonkeyPatch) -> None:
    with pytest.raises(AssertionError, match="does not parse"):
        parse_kvmesh(["kvmesh", "replay", "--indexer", "x:1", "--tls-ca", "ca.crt"], monkeypatch)
    with pytest.raises(AssertionError, match="not a kvmesh command"):
        parse_kvmesh(["kvmesh", "bridges"], monkeypatch)


def _notes(values: dict[str, Any]) -> str:
    import helm_python

    out = helm_python.Chart.load(str(CHART)).render(values, name="rel", namespace="ns")
    notes: str = out["kvmesh/templates/NOTES.txt"]
    return notes


_POLICY = {"identities": [{"name": "r", "roles": ["router"], "token_sha256": ["ab" * 32]}]}
NOTES_VALUES: dict[str, dict[str, Any]] = {
    "defaults": {},
    "memory": {
        "indexer": {"backend": "memory", "replicas": 1},
        "redis": {"internal": {"enabled": False}},
    },
    "mtls-policy": {"tls": {"secretName": "t"}, "auth": {"enabled": True, "policy": _POLICY}},
    "tokens": {
        "tls": {"secretName": "t", "clientAuth": "optional"},
        "auth": {"enabled": True, "policy": _POLICY},
    },
    "tls-only": {"tls": {"secretName": "t", "mutual": False}},
}


@pytest.mark.parametrize("name", sorted(NOTES_VALUES))
def test_every_command_notes_print_works_as_written(
    name: str, monkeypatch: pytest.MonkeyPatch
) -> None:
    """Each ``kvmesh`` line parses; TLS releases print only commands that speak TLS."""
    notes = _notes(NOTES_VALUES[name])
    lines = [shlex.split(line) for line in notes.splitlines() if line.startswith("  kvmesh ")]
    assert lines, notes
    tls = "tls" in NOTES_VALUES[name]
    for argv in lines:
        words, ns = parse_kvmesh(argv, monkeypatch)
        if words == ("replay",):
            assert not tls, "kvmesh replay dials plaintext only"
        if words == ("cachesim", "report") and tls:
            assert ns.url.startswith("https://") and ns.ca_file, argv
    tools = [
        line.split()
        for line in notes.splitlines()
        if line.strip().startswith(("curl ", "grpcurl "))
    ]
    for words in tools:
        assert tls, words
        assert "--cacert" in words or "-cacert" in words, words
    if name == "tokens":
        assert sum("Bearer" in " ".join(w) for w in tools) == 2
        assert any(argv[-2:] == ["--token-file", "token"] for argv in lines)
    if not tls:
        assert "dns:///rel-kvmesh-indexer-headless.ns.svc:50051" in notes


# -- config blocks and keys --------------------------------------------------------------

#: Top-level keys only a bridge config has.
_BRIDGE_ONLY = set(BridgeConfig.model_fields) - set(IndexerConfig.model_fields)


def test_every_yaml_block_loads(tmp_path: Path) -> None:
    blocks = code_blocks(doc_text(), "yaml")
    kinds = []
    for block in blocks:
        data = yaml.safe_load(block)
        if block.startswith(VALUES_MARK):
            docs = render_example(data, tmp_path / "chart")
            assert any(d["kind"] == "Deployment" for d in docs)
            kinds.append("values")
        elif _BRIDGE_ONLY & set(data):
            BridgeConfig.model_validate(data)
            kinds.append("bridge")
        else:
            IndexerConfig.model_validate(data)
            kinds.append("indexer")
    assert {"values", "indexer"} <= set(kinds)


def _values(path: Path) -> dict[str, Any]:
    data: dict[str, Any] = yaml.safe_load(path.read_text())
    return data


#: Where a dotted key of the page may live: config models and the charts' values.
_SOURCES: list[type[BaseModel] | dict[str, Any]] = [
    IndexerConfig,
    BridgeConfig,
    RouterConfig,
    _values(CHART / "values.yaml"),
    _values(EXAMPLE / "values.yaml"),
]


def _resolves(source: type[BaseModel] | dict[str, Any], parts: list[str]) -> bool:
    node: Any = source
    for part in parts:
        if isinstance(node, dict):
            if part not in node:
                return False
            node = node[part]
            continue
        fields = getattr(node, "model_fields", None)
        if fields is None or part not in fields:
            return False
        node = _model_of(fields[part].annotation)
        if node is None:
            return part == parts[-1]
    return True


def _model_of(annotation: Any) -> Any:
    """The model a field holds (through list[...], dict[...], X | None), or None."""
    if isinstance(annotation, type) and issubclass(annotation, BaseModel):
        return annotation
    for arg in getattr(annotation, "__args__", ()):
        found = _model_of(arg)
        if found is not None:
            return found
    return None


_KEY = re.compile(r"^[a-z][a-z0-9_]*(\.[a-zA-Z_][a-zA-Z0-9_]*|\[[^\]]*\])+$")


def unknown_keys(text: str) -> list[str]:
    """Backticked dotted keys of ``text`` (``a.b``, ``a[x]``) whose first name is a
    top-level key of a config or the charts' values but which resolve in none."""
    tops = set()
    for s in _SOURCES:
        tops |= set(s) if isinstance(s, dict) else set(s.model_fields)
    bad = []
    for token in re.findall(r"`([^`\s]+)`", text):
        token = token.split(":")[0]
        if not _KEY.match(token) or token.startswith("kvmesh."):
            continue
        parts = [p for p in re.sub(r"\[[^\]]*\]", "", token).split(".") if p]
        if parts[0] not in tops:
            continue
        if not any(_resolves(s, parts) for s in _SOURCES):
            bad.append(token)
    return bad


def test_every_config_key_the_page_names_exists() -> None:
    assert unknown_keys(doc_text()) == []


def test_the_key_check_catches_a_misspelt_key() -> None:
    text = (
        "`engine_events.endpoint` `engine_events.endpoints` `buffer.max_batches` "
        "`model_block_sizes[model]` `bridge.bindEvents` `indexer.service.headless` "
        "`indexer.stream_max_age` `sglang.page_size` `redis.clusters`"
    )
    assert unknown_keys(text) == [
        "engine_events.endpoint",
        "indexer.stream_max_age",
        "redis.clusters",
    ]


@pytest.fixture(autouse=True)
def _no_stray_env(monkeypatch: pytest.MonkeyPatch) -> Iterator[None]:
    """Config loads read the environment: keep the machine's KVMESH_* out of them."""
    for name in list(os.environ):
        if name.startswith(("KVMESH_INDEXER_", "KVMESH_BRIDGE_")):
            monkeypatch.delenv(name)
    yield
