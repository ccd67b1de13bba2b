"""Configuration of the indexer service: one typed model, four layers.

Precedence, highest first: command-line flags > environment variables
``KVMESH_INDEXER_<FIELD>`` (nested fields joined by ``__``, e.g.
``KVMESH_INDEXER_REDIS__URL``, ``KVMESH_INDEXER_LIMITS__MAX_MATCH_BLOCKS``) >
a config file (YAML, TOML or JSON, chosen by extension) > the defaults below.
Unknown keys are rejected in every layer, naming the key and where it came
from, so a typo never silently falls back to a default.

Example file (YAML)::

    host: 0.0.0.0
    backend: redis
    redis:
      url: redis://redis:6379/0
    block_size: 16
    model_block_sizes:
      deepseek-ai/DeepSeek-V3: 64
    limits:
      max_match_blocks: 16384
    quotas:
      max_instances_per_identity: 64
"""

from __future__ import annotations

import math
import os
from collections.abc import Mapping
from typing import Any, Literal

from pydantic import Field, SecretStr, field_serializer, model_validator

from kvmesh.auth import AuthSettings
from kvmesh.configfile import ConfigError, StrictModel, load_layered
from kvmesh.grpcsvc import ClientLimits
from kvmesh.tls import ServerTLS

__all__ = ["ConfigError", "IndexerConfig", "load_config"]

#: Prefix of the environment variables read by :func:`load_config`.
ENV_PREFIX = "KVMESH_INDEXER_"

#: Worst-case wire bytes of one token id in a packed ``repeated int64`` field
#: (a varint of a value below 2^32 takes at most 5 bytes).
_WIRE_BYTES_PER_TOKEN = 5


class RedisSettings(StrictModel):
    """How to reach the shared Redis (used when ``backend`` is ``"redis"``)."""

    url: str = Field(
        default="redis://127.0.0.1:6379/0",
        description="Redis URL (redis://, rediss:// or unix://).",
    )
    prefix: str = Field(
        default="kvm",
        min_length=1,
        description="Prefix of every Redis key; replicas sharing an index use the same one.",
    )
    socket_timeout_s: float = Field(
        default=1.0,
        gt=0,
        description="Connect timeout, and the longest wait for the reply to what a router "
        "waits on (Match, the instance table, PING). A Match is one round trip, so a short "
        "timeout turns a hung Redis into UNAVAILABLE quickly instead of stalling routers; "
        "writes wait up to write_timeout_s.",
    )
    write_timeout_s: float = Field(
        default=10.0,
        gt=0,
        description="Longest wait for the reply to a write (an apply, a registration, a purge). "
        "One apply of a long engine event (a whole prompt: thousands of blocks at 16-token "
        "blocks) can hold a loaded Redis for most of a second; a write given up on still "
        "completes, and its retries pile up. Reads a router waits on keep socket_timeout_s.",
    )
    max_connections: int = Field(
        default=64,
        ge=1,
        le=10_000,
        description="Most Redis calls in flight from this replica (its pool, per node in "
        "cluster mode, may hold up to twice as many connections while some reconnect). A "
        "call beyond it waits for a free connection within its deadline instead of failing: "
        "ingest and Match share the connections.",
    )
    max_writes_in_flight: int | None = Field(
        default=None,
        ge=0,
        le=10_000,
        description="Most write scripts (applies, registrations, predictions, purges, "
        "removals) this "
        "replica has in flight at once; the others wait their turn here, where a Match does "
        "not queue behind them. Redis runs one script at a time and a Match sent behind 64 "
        "applies of long engine events waits for all of them. Lease renewals (a few "
        "commands each) do not take turns: an idle engine's renewal must not wait out "
        "write_timeout_s behind other engines' batches. None: 1 over a "
        "standalone Redis, 3 over a Cluster (about one per master of three: its masters "
        "apply in parallel; raise it with more masters); 0: no bound of its own (only "
        "max_connections).",
    )
    instance_cache_ttl_s: float = Field(
        default=0.25,
        gt=0,
        description="How long this replica trusts its cached instance table before a Match "
        "that sees a new generation refreshes it (staleness and removals made by other "
        "replicas show up within this time).",
    )
    parent_cache_size: int = Field(
        default=200_000,
        ge=0,
        description="Entries of the local (instance, engine hash) -> content key cache that "
        "saves the extra round trip for a stored block's parent. About 200 bytes each; a "
        "miss costs one HMGET, never a wrong key (the apply script checks every belief).",
    )
    apply_part_blocks: int = Field(
        default=1024,
        ge=0,
        description="Most blocks one apply script writes: a longer batch goes in parts, one "
        "script each (about 5 ms of Redis time at 1,024), so that no script holds the "
        "server (a Cluster's control master), and every other client's command, for long. "
        "Each part applies once whichever replica sends it; the batch's sequence is "
        "recorded by its last (KEYS.md, 'Apply in parts'). 0: every batch in one script. "
        "A batch with AllBlocksCleared goes in one script.",
    )
    cluster: bool = Field(
        default=False,
        description="Talk to a Redis Cluster (url names any node). Block keys are tagged by "
        "their chain's anchor block so a Match stays one script on one node (KEYS.md).",
    )
    cluster_anchor_depth: int | None = Field(
        default=None,
        ge=0,
        le=255,
        description="Cluster only: depth of the block whose hash tag places a chain, for every "
        "model; the shallower blocks are copied on every master. 0 tags by the root block, "
        "which puts every chain behind one shared system prompt on one shard. Unset: "
        "cluster_anchor_tokens over each model's block size. Every replica must agree.",
    )
    cluster_anchor_tokens: int = Field(
        default=512,
        ge=1,
        le=1 << 20,
        description="Cluster only, when cluster_anchor_depth is unset: a model's anchor is its "
        "first block past this many tokens (depth ceil(tokens / block size), at most 255): "
        "depth 1 at 512-token blocks, 32 at 16-token blocks, so a shared system prompt of up "
        "to this length does not put every chain on one shard.",
    )
    username: str = Field(
        default="",
        description="Redis ACL user to authenticate as ('' = the URL's user, else Redis's "
        "default user). SECURITY.md lists the least ACL rights the indexer needs.",
    )
    password_file: str = Field(
        default="",
        description="File holding the password of username (e.g. a mounted Kubernetes "
        "Secret; a trailing newline is ignored). Read at every new connection, so a rotated "
        "Secret is used after the next reconnect (at the latest the retry that follows an "
        "authentication failure) without a restart.",
    )
    password: SecretStr | None = Field(
        default=None,
        description="Password of username, for the environment variable "
        "KVMESH_INDEXER_REDIS__PASSWORD; keep it out of config files (prefer password_file). "
        "Never shown by repr, logs or --print-config. A password in url works too and is "
        "redacted wherever the url is printed. Give the password in one place only.",
    )
    tls_ca_file: str = Field(
        default="",
        description="rediss:// only: PEM CA bundle that signs the Redis server certificate "
        "('' = the system CAs).",
    )
    tls_cert_file: str = Field(
        default="",
        description="rediss:// only: PEM client certificate, for a Redis with "
        "tls-auth-clients yes (with tls_key_file).",
    )
    tls_key_file: str = Field(
        default="", description="rediss:// only: PEM private key of tls_cert_file."
    )
    tls_check_hostname: bool = Field(
        default=True,
        description="rediss:// only: check that the server certificate names the host of "
        "url (and of every cluster node). Turn off only for servers known by an address "
        "their certificate does not name.",
    )

    @staticmethod
    def _url_may_hold_credentials(url: str) -> bool:
        # Lets the common case skip importing the connection module (and redis-py).
        return "@" in url or "password" in url.lower()

    @model_validator(mode="after")
    def _security_checks(self) -> RedisSettings:
        url_user, url_password = "", None
        if self._url_may_hold_credentials(self.url):
            from indexer.redis.connection import split_url_credentials

            try:
                _, url_user, url_password = split_url_credentials(self.url)
            except ValueError as e:
                raise ValueError(f"url: cannot parse ({type(e).__name__})") from None
        tls_files = ("tls_ca_file", "tls_cert_file", "tls_key_file")
        if not self.url.lower().startswith("rediss://"):
            for name in tls_files:
                if getattr(self, name):
                    raise ValueError(f"{name}: set, but url is not rediss:// (TLS is off)")
        if bool(self.tls_cert_file) != bool(self.tls_key_file):
            raise ValueError("tls_cert_file and tls_key_file: give both or neither")
        sources = [
            name
            for name, given in (
                ("password_file", bool(self.password_file)),
                ("password", self.password is not None),
                ("url", url_password is not None),
            )
            if given
        ]
        if len(sources) > 1:
            raise ValueError(f"password: given in {' and '.join(sources)}; give it in one place")
        if self.username and url_user and self.username != url_user:
            raise ValueError(
                f"username: {self.username!r} differs from the url's user {url_user!r}"
            )
        return self

    @field_serializer("url", when_used="json")
    def _redacted_url(self, url: str) -> str:
        if not self._url_may_hold_credentials(url):
            return url
        from indexer.redis.connection import redact_url

        return redact_url(url)

    def __repr_args__(self) -> Any:
        for name, value in super().__repr_args__():
            yield name, self._redacted_url(value) if name == "url" else value


class Limits(StrictModel):
    """Request size caps and the overload guard."""

    max_match_blocks: int = Field(
        default=16384,
        ge=1,
        description="Most blocks one Match may look at (also the default when a request "
        "sends max_blocks=0). A longer prompt without max_blocks is INVALID_ARGUMENT. "
        "Left unset, it is lowered to what one max_message_bytes message can carry at the "
        "largest block size (e.g. 6,553 blocks of 512 tokens at 16 MiB).",
    )
    max_events_per_batch: int = Field(
        default=4096, ge=1, description="Most events in one EventBatch (INVALID_ARGUMENT beyond)."
    )
    max_blocks_per_event: int = Field(
        default=16384,
        ge=1,
        description="Most block hashes in one BlockStored/BlockRemoved event. vLLM stores a "
        "whole prompt's blocks in one event: 16,384 covers a 256k-token prompt at 16-token "
        "blocks. A longer event on a ZMQ stream is skipped and counted.",
    )
    max_message_bytes: int = Field(
        default=16 * 1024 * 1024,
        ge=4096,
        description="Largest request or response message; grpc itself answers "
        "RESOURCE_EXHAUSTED for a larger one.",
    )
    max_concurrent_rpcs: int = Field(
        default=1024,
        ge=0,
        description="Most IndexerService calls in flight on this replica (an open stream "
        "counts as one); beyond it a call is refused with RESOURCE_EXHAUSTED. 0: no limit.",
    )
    max_streams_per_connection: int = Field(
        default=0,
        ge=0,
        description="HTTP/2 MAX_CONCURRENT_STREAMS the server announces: calls one client "
        "connection may have in flight. Calls beyond it wait in the client, costing the "
        "server nothing, so one flooding connection cannot queue more than this many calls "
        "ahead of everyone else's (per_client limits refuse calls, but a refused call still "
        "costs most of an answered one). 0: gRPC's default (no limit).",
    )
    handshake_timeout_s: float = Field(
        default=10.0,
        gt=0,
        description="Longest a new connection may take to finish its handshake (TLS and "
        "HTTP/2 settings) before the server closes it: a client that opens connections and "
        "never starts TLS cannot hold file descriptors for gRPC's default two minutes.",
    )
    max_connections: int = Field(
        default=4096,
        ge=0,
        description="Most client connections the gRPC port holds at once (authenticated or "
        "still in their handshake); one more is closed as it is accepted. With "
        "handshake_timeout_s it bounds what clients that open connections and never finish "
        "a handshake can hold: at most this many file descriptors, each for at most the "
        "timeout. It cannot tell them from real clients while the cap is full: keep it above "
        "routers x replicas' channels plus bridges, and let a NetworkPolicy decide who may "
        "connect. 0: no cap.",
    )
    max_connection_age_s: float = Field(
        default=300.0,
        ge=0,
        description="Age after which the server ends a client connection (HTTP/2 GOAWAY, "
        "jittered by ±10%): the client reconnects and, dialling a name (a headless "
        "Service), resolves it again, so replicas added since (an autoscaler's) get "
        "connections and calls too. Without it a router's connection stays on the replica "
        "it first reached for as long as both live. 0: connections never age.",
    )
    max_connection_age_grace_s: float = Field(
        default=30.0,
        gt=0,
        description="After max_connection_age_s, how long calls in flight on the old "
        "connection may go on before it is closed; streams still open then end UNAVAILABLE "
        "(the router client moves its MatchStreams sooner, see its match_stream_max_age_s, "
        "and a stream client reopens on the new connection).",
    )
    max_lease_ttl_s: float = Field(
        default=3600.0, gt=0, description="Longest lease a registration may ask for."
    )
    prediction_ttl_ms: int = Field(
        default=2000,
        ge=1,
        description="Life of a route-time prediction (PredictPlacement) that asks for "
        "ttl_ms=0: about the lag of an engine's KV events behind the routing of a request "
        "(its prefill plus the event's trip), after which the events confirm or replace it.",
    )
    max_prediction_ttl_ms: int = Field(
        default=30000,
        ge=1,
        description="Longest life a PredictPlacement may ask for; a longer ttl_ms is cut to it "
        "(the response says the ttl applied).",
    )
    max_predicted_blocks_per_instance: int = Field(
        default=65536,
        ge=1,
        description="Most predicted blocks one instance holds (every router's predictions "
        "together); past it the oldest predictions go first.",
    )
    max_namespaces: int = Field(
        default=1024,
        ge=1,
        description="Most namespaces (model + LoRA) with registered instances; a registration "
        "that would add one more is RESOURCE_EXHAUSTED. Checked per replica against the shared "
        "instance table, so concurrent registrations on several replicas may overshoot by a few.",
    )
    max_instances_per_namespace: int = Field(
        default=4096,
        ge=1,
        description="Most registered instances of one namespace (RESOURCE_EXHAUSTED beyond).",
    )
    per_client: ClientLimits = Field(
        default_factory=ClientLimits,
        description="Per-client in-flight cap and rates of Match and publish (a client is a "
        "policy identity, or a peer host when authorization is off).",
    )


class Quotas(StrictModel):
    """What one engine identity of the policy may hold (SECURITY.md, "Quotas").

    Counted in the index itself (Redis: shared by every replica, kept by the
    scripts that write), per policy identity; an identity's ``quotas`` entry
    in the policy overrides any of them for it. Admin identities have none
    (an operator can always register and remove), and without a policy every
    caller is one anonymous client, so only ``max_blocks_per_instance``
    applies. A refusal is RESOURCE_EXHAUSTED naming the field; stores past a
    block quota are skipped and counted (``kvmesh_indexer_events_skipped_total``
    ``reason="quota"``), the rest of the batch applies. 0: no cap.
    """

    max_instances_per_identity: int = Field(
        default=256,
        ge=0,
        description="Most instances one identity may hold; a registration of one more is "
        "refused. Far below limits.max_instances_per_namespace (4,096), so one identity "
        "cannot fill a namespace for the others.",
    )
    max_namespaces_per_identity: int = Field(
        default=64,
        ge=0,
        description="Most namespaces one identity's instances may hold: their models, and "
        "each LoRA name one of them stored blocks under since it registered, reset or "
        "cleared. A registration that would add one more is refused; a store in one more "
        "LoRA namespace is skipped and counted. Far below limits.max_namespaces (1,024).",
    )
    max_dp_rank: int = Field(
        default=1023,
        ge=0,
        lt=1 << 32,
        description="Highest data-parallel rank an identity may register.",
    )
    max_blocks_per_instance: int = Field(
        default=1 << 20,
        ge=0,
        description="Most blocks one instance may hold (the larger of its (block, tier) "
        "entries and its engine block hashes), whoever writes them, a ZMQ stream and an "
        "anonymous client included. A memory replica holds about 100 bytes a block at 16-token "
        "blocks (docs/benchmarks.md); a flood of an identity's 2,097,152 blocks in batches of "
        "65,536 grew one's RSS by 468 MB, the batches' own buffers included.",
    )
    max_blocks_per_identity: int = Field(
        default=1 << 21,
        ge=0,
        description="Most blocks the instances of one identity may hold together (470 MB "
        "of RSS growth measured for a flood over 8 dp ranks).",
    )
    publish_blocks_per_s: float = Field(
        default=200_000.0,
        ge=0,
        allow_inf_nan=False,
        description="Blocks one identity may store per second on one replica (a batch "
        "beyond it is refused with a retry delay, nothing applied): several times what an "
        "8-GPU engine publishes at full prefill.",
    )
    publish_blocks_burst: int = Field(
        default=0,
        ge=0,
        description="Bucket size of publish_blocks_per_s; 0: one second's worth. A batch "
        "larger than the bucket passes when it is full and empties it for as long as the "
        "rate takes to pay for it.",
    )


class ZmqEndpointSettings(StrictModel):
    """One engine's KV-event stream (vLLM or SGLang ``ZmqEventPublisher``) and its instance.

    One subscriber per engine endpoint, and each endpoint in the config of
    exactly one replica: two replicas subscribed to one engine would race each
    other's re-registrations after a publisher restart.
    """

    worker_id: str = Field(min_length=1, description="Instance worker id.")
    dp_rank: int = Field(
        default=0,
        ge=0,
        lt=1 << 32,
        description="Instance data-parallel rank. vLLM and SGLang publish each rank on its own "
        "port (base port + rank), so each rank is its own endpoint entry.",
    )
    model: str = Field(min_length=1, description="Model (namespace) the engine serves.")
    address: str = Field(
        default="", description="URL a router sends requests to, returned by Match."
    )
    endpoint: str = Field(
        min_length=1, description="The engine's PUB endpoint, e.g. tcp://10.0.0.5:5557."
    )
    bind: bool = Field(
        default=False,
        description="Bind the SUB socket at endpoint (the engine connects) instead of "
        "connecting to it (the engine binds, vLLM's default).",
    )
    replay_endpoint: str | None = Field(
        default=None,
        description="The engine's replay ROUTER endpoint; without it a sequence gap cannot be "
        "filled (see engine_events.on_unrecoverable_gap).",
    )
    topic: str = Field(default="", description="ZMQ topic to subscribe to ('' = all).")
    keys: Literal["tokens", "engine_hashes"] = Field(
        default="tokens",
        description="tokens: block keys are kvmesh content keys chained from token_ids (Match "
        "by tokens works across engines); engine_hashes: the engine's block hashes are the "
        "block keys (what an SGLang router sends to MatchExternalKvPrefix).",
    )
    lease_ttl_s: float = Field(
        default=0, ge=0, description="Instance lease; 0 takes default_lease_ttl_s."
    )
    curve_server_key: str = Field(
        default="",
        description="The engine PUB socket's CURVE public key (Z85, 40 characters): the "
        "subscriber then authenticates the engine and the stream is encrypted (an SGLang or "
        "vLLM build whose publisher sets curve_server). Empty: plain ZMQ — restrict the "
        "engine's ports to the indexer at the network level (SECURITY.md).",
    )
    curve_secret_key_file: str = Field(
        default="",
        description="File holding this subscriber's CURVE secret key (Z85); required with "
        "curve_server_key. Its public key is derived from it.",
    )

    @model_validator(mode="after")
    def _curve(self) -> ZmqEndpointSettings:
        if bool(self.curve_server_key) != bool(self.curve_secret_key_file):
            raise ValueError("curve_server_key and curve_secret_key_file go together")
        if self.curve_server_key and len(self.curve_server_key) != 40:
            raise ValueError("curve_server_key must be a 40-character Z85 public key")
        if self.curve_server_key and self.bind:
            raise ValueError("CURVE needs bind: false (the engine's socket is the CURVE server)")
        return self


class EngineEventSettings(StrictModel):
    """ZMQ subscribers to engine KV-event streams, run inside ``kvmesh indexer serve``."""

    endpoints: list[ZmqEndpointSettings] = Field(
        default_factory=list, description="Engine endpoints to subscribe to; empty: none."
    )
    on_unrecoverable_gap: Literal["reset", "stale"] = Field(
        default="reset",
        description="When replay cannot fill a gap (no replay endpoint, timeout, or batches "
        "already out of the engine's buffer): reset drops the instance's blocks and goes on "
        "from the next batch (Match sees a subset of the engine's cache at once); stale keeps "
        "them and lets the index mark the instance stale (hidden from Match) until the engine "
        "clears its cache.",
    )
    replay_timeout_s: float = Field(
        default=2.0,
        gt=0,
        description="How long to wait for each reply frame of a replay request before giving "
        "the gap up as unrecoverable.",
    )
    vllm_hash_seeds: list[str] = Field(
        default_factory=list,
        description="PYTHONHASHSEED values of vLLM engines that set it. A hybrid model's "
        "prompt tail that ends two or more hash units into a block is found by vLLM's own "
        "hash of the prompt (indexer/enginehash.py); without PYTHONHASHSEED vLLM seeds it "
        "with a fixed default, tried first. A seed is used only once it reproduced a hash "
        "the engine published.",
    )
    receive_hwm: int = Field(
        default=100_000,
        ge=0,
        description="ZMQ receive high-water mark (batches queued while the backend is slow). "
        "Beyond it ZMQ drops batches and the subscriber replays them.",
    )


class SglangApiSettings(StrictModel):
    """SGLang's external KV indexer API (``kv_indexer.v1.KVIndexer``) on the same port."""

    enabled: bool = Field(default=True, description="Serve kv_indexer.v1.KVIndexer.")
    model: str = Field(
        default="sglang",
        min_length=1,
        description="Namespace (model) of workers fed through this API; the API names no "
        "model. ZMQ endpoints with keys=engine_hashes and this model share its index.",
    )
    lease_ttl_s: float = Field(
        default=600.0,
        gt=0,
        description="Lease of a worker fed through this API, renewed by each batch and each "
        "ConfigureExpectedWorkers naming it. Long because an idle worker sends nothing.",
    )
    max_hit_counters: int = Field(
        default=1_000_000,
        ge=0,
        description="Hashes whose hit counts this replica keeps (oldest dropped first).",
    )
    page_size: int = Field(
        default=1,
        ge=1,
        le=65536,
        description="The engines' --page-size (tokens per hash). Hybrid workers' sliding-"
        "window rule counts a page as this many tokens; a REPORT whose block_sizes differ is "
        "refused.",
    )


class WatchSettings(StrictModel):
    """Followers of a replica (WatchIndex): routers that hold a copy of the index.

    A memory replica serves its own index. A replica over Redis (standalone or
    Cluster) keeps a copy of the shared index in its memory, fed by the change
    stream every replica appends to while one watches (indexer/redis/KEYS.md,
    "Watching"), and serves that.
    """

    enabled: bool = Field(
        default=True,
        description="Serve WatchIndex (memory backend; over Redis through a copy of the "
        "shared index kept in this replica's memory, made at the first follower).",
    )
    max_followers: int = Field(
        default=64, ge=0, le=4096, description="Followers one replica serves at once."
    )
    buffer: int = Field(
        default=4096,
        ge=1,
        le=1_000_000,
        description="Changes a follower may fall behind before it is told to resync and "
        "sent a new snapshot (bounds the replica's memory per follower).",
    )
    redis_max_pairs: int = Field(
        default=0,
        ge=0,
        description="Redis backend: the most (block, instance) pairs this replica's copy of the "
        "index may hold (0: no bound; about 150 bytes each). Past it the copy is dropped and "
        "WatchIndex answers RESOURCE_EXHAUSTED for a minute: followers go remote.",
    )
    redis_backlog: int = Field(
        default=16384,
        ge=64,
        le=10_000_000,
        description="Redis backend: entries the change stream keeps (about; Redis trims "
        "whole nodes). A watching replica that falls further behind copies the index "
        "again; every replica's writes pay one stream append each while one watches.",
    )


class IndexerConfig(StrictModel):
    """Configuration of one indexer replica (``kvmesh indexer serve``).

    The default ``host`` is loopback and, without ``tls`` and ``auth``, the
    service trusts every caller, so listening on every interface is an
    explicit choice. A container sets ``KVMESH_INDEXER_HOST=0.0.0.0`` (the Helm
    chart does, with TLS and a policy when certificates are given).
    """

    host: str = Field(
        default="127.0.0.1",
        min_length=1,
        description="Address to listen on for gRPC and metrics; 0.0.0.0 (or ::) in a container.",
    )
    port: int = Field(default=50051, ge=0, le=65535, description="gRPC port; 0 picks a free one.")
    metrics_port: int = Field(
        default=9464,
        ge=0,
        le=65535,
        description="Prometheus /metrics port; 0 disables the endpoint.",
    )
    backend: Literal["memory", "redis"] = Field(
        default="memory",
        description="memory: in-process, for one replica; redis: shared by all replicas.",
    )
    redis: RedisSettings = Field(default_factory=RedisSettings)
    block_size: int = Field(
        default=16, ge=1, le=65536, description="Tokens per block, for models without an override."
    )
    model_block_sizes: dict[str, int] = Field(
        default_factory=dict,
        description="Per-model block size overrides, model name -> tokens per block.",
    )
    limits: Limits = Field(default_factory=Limits)
    quotas: Quotas = Field(default_factory=Quotas)
    tls: ServerTLS = Field(default_factory=ServerTLS)
    auth: AuthSettings = Field(default_factory=AuthSettings)
    health_port: int = Field(
        default=0,
        ge=0,
        le=65535,
        description="Extra plaintext port serving only grpc.health.v1 (for kubelet gRPC "
        "probes, which present no certificate); 0: none.",
    )
    engine_events: EngineEventSettings = Field(default_factory=EngineEventSettings)
    sglang: SglangApiSettings = Field(default_factory=SglangApiSettings)
    watch: WatchSettings = Field(default_factory=WatchSettings)
    default_lease_ttl_s: float = Field(
        default=30.0, gt=0, description="Lease of a registration that asks for 0 seconds."
    )
    reap_interval_s: float = Field(
        default=5.0,
        gt=0,
        description="How often expired instances are dropped with their blocks. Expired "
        "instances are invisible to Match at once; reaping only frees memory.",
    )
    health_check_interval_s: float = Field(
        default=1.0,
        gt=0,
        description="How often the backend is pinged to drive grpc.health.v1 status.",
    )
    shutdown_grace_s: float = Field(
        default=10.0, ge=0, description="On SIGTERM, how long in-flight calls may take to finish."
    )
    log_level: Literal["DEBUG", "INFO", "WARNING", "ERROR"] = "INFO"
    log_format: Literal["text", "json"] = Field(
        default="text", description="json: one JSON object per line, for log collectors."
    )

    @model_validator(mode="after")
    def _cross_checks(self) -> IndexerConfig:
        for model, size in self.model_block_sizes.items():
            if not model:
                raise ValueError("model_block_sizes: empty model name")
            if not 1 <= size <= 65536:
                raise ValueError(f"model_block_sizes[{model!r}]: must be in [1, 65536]")
        if self.metrics_port and self.metrics_port == self.port:
            raise ValueError(f"metrics_port and port are both {self.port}")
        if self.health_port and self.health_port in (self.port, self.metrics_port):
            raise ValueError(f"health_port {self.health_port} is also port or metrics_port")
        lim = self.limits
        if self.default_lease_ttl_s > lim.max_lease_ttl_s:
            raise ValueError(
                f"default_lease_ttl_s ({self.default_lease_ttl_s}) exceeds "
                f"limits.max_lease_ttl_s ({lim.max_lease_ttl_s})"
            )
        if lim.prediction_ttl_ms > lim.max_prediction_ttl_ms:
            raise ValueError(
                f"limits.prediction_ttl_ms ({lim.prediction_ttl_ms}) exceeds "
                f"limits.max_prediction_ttl_ms ({lim.max_prediction_ttl_ms})"
            )
        # A prompt at the block cap must fit in one message, else the cap's
        # INVALID_ARGUMENT could never be reached (grpc would refuse first).
        per_block = self.max_block_size * _WIRE_BYTES_PER_TOKEN
        need = lim.max_match_blocks * per_block + 1024
        if need > lim.max_message_bytes and "max_match_blocks" not in lim.model_fields_set:
            # The default cap: lowered to what a message carries, so that
            # defaults load at every block size.
            fits = max(1, (lim.max_message_bytes - 1024) // per_block)
            object.__setattr__(self, "limits", lim.model_copy(update={"max_match_blocks": fits}))
        elif need > lim.max_message_bytes:
            raise ValueError(
                f"limits.max_message_bytes ({lim.max_message_bytes}) cannot carry a prompt of "
                f"limits.max_match_blocks ({lim.max_match_blocks}) blocks of "
                f"{self.max_block_size} tokens (~{need} bytes); raise it or lower the cap"
            )
        for name in ("reap_interval_s", "health_check_interval_s", "shutdown_grace_s"):
            if not math.isfinite(getattr(self, name)):
                raise ValueError(f"{name}: must be finite")
        for name in ("max_connection_age_s", "max_connection_age_grace_s"):
            if not math.isfinite(getattr(lim, name)):
                raise ValueError(f"limits.{name}: must be finite (0 turns the age off)")
        seen: set[tuple[str, int]] = set()
        for i, ep in enumerate(self.engine_events.endpoints):
            if (ep.worker_id, ep.dp_rank) in seen:
                raise ValueError(
                    f"engine_events.endpoints[{i}]: instance {ep.worker_id}/dp{ep.dp_rank} "
                    "is listed twice (one subscriber per engine endpoint)"
                )
            seen.add((ep.worker_id, ep.dp_rank))
            if ep.lease_ttl_s > lim.max_lease_ttl_s:
                raise ValueError(
                    f"engine_events.endpoints[{i}].lease_ttl_s exceeds limits.max_lease_ttl_s"
                )
        if self.sglang.lease_ttl_s > lim.max_lease_ttl_s:
            raise ValueError("sglang.lease_ttl_s exceeds limits.max_lease_ttl_s")
        return self

    @property
    def max_block_size(self) -> int:
        """The largest block size of any model."""
        return max([self.block_size, *self.model_block_sizes.values()])

    def block_size_for(self, model: str) -> int:
        """Tokens per block for ``model`` (its override, else ``block_size``)."""
        return self.model_block_sizes.get(model, self.block_size)

    def cluster_anchor_for(self, model: str) -> int:
        """Depth of the anchor block of ``model``'s chains on a Redis Cluster
        (``redis.cluster_anchor_depth``, else ``redis.cluster_anchor_tokens``
        over the model's block size, rounded up, at most 255)."""
        r = self.redis
        if r.cluster_anchor_depth is not None:
            return r.cluster_anchor_depth
        return min(255, -(-r.cluster_anchor_tokens // self.block_size_for(model)))

    @property
    def cluster_anchor_rule(self) -> str:
        """How :meth:`cluster_anchor_for` places chains, as the index records it."""
        r = self.redis
        if r.cluster_anchor_depth is not None:
            return f"depth {r.cluster_anchor_depth}"
        return f"tokens {r.cluster_anchor_tokens}"


# -- loading ------------------------------------------------------------------


def load_config(
    file: str | os.PathLike[str] | None = None,
    *,
    environ: Mapping[str, str] | None = None,
    cli: Mapping[str, Any] | None = None,
) -> IndexerConfig:
    """Build the config from defaults < ``file`` < environment < ``cli`` overrides.

    ``cli`` is a nested dict of values given on the command line (``None``
    values are skipped). Raises :class:`ConfigError` listing unknown keys with
    their source, or every validation problem with its field
    (:func:`kvmesh.configfile.load_layered`).
    """
    return load_layered(
        IndexerConfig, path=file, env_prefix=ENV_PREFIX, overrides=cli, environ=environ
    )
