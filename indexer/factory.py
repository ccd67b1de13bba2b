"""Backend factory: the :class:`~indexer.index.Index` a config names (beside the interface).

The config model (:mod:`indexer.config`) is a leaf; this module is where the
typed ``backend`` field becomes a backend object.
"""

from __future__ import annotations

from indexer.config import IndexerConfig
from indexer.index import Index


def build_index(config: IndexerConfig) -> Index:
    """The backend ``config.backend`` names, configured from ``config``.

    Building does not connect: a Redis that is down at start makes calls
    UNAVAILABLE (and health NOT_SERVING) until it comes up.
    """
    if config.backend == "memory":
        from indexer.memory import MemoryIndex

        return MemoryIndex()
    from indexer.redis.backend import RedisIndex

    r = config.redis
    return RedisIndex(
        r.url,
        prefix=r.prefix,
        socket_timeout_s=r.socket_timeout_s,
        write_timeout_s=r.write_timeout_s,
        max_connections=r.max_connections,
        max_writes_in_flight=r.max_writes_in_flight,
        instance_cache_ttl_s=r.instance_cache_ttl_s,
        parent_cache_size=r.parent_cache_size,
        apply_part_blocks=r.apply_part_blocks,
        cluster=r.cluster,
        anchor_depth=config.cluster_anchor_for,
        anchor_rule=config.cluster_anchor_rule,
        username=r.username,
        password=r.password.get_secret_value() if r.password is not None else None,
        password_file=r.password_file,
        tls_ca_file=r.tls_ca_file,
        tls_cert_file=r.tls_cert_file,
        tls_key_file=r.tls_key_file,
        tls_check_hostname=r.tls_check_hostname,
    )
