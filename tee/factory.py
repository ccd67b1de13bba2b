"""Tee factory: the :class:`~tee.logic.Tee` a config names, with its sinks.

The config model (:mod:`tee.config`) is a leaf; this module is where the
typed ``sinks`` entries become sink objects.
"""

from __future__ import annotations

from tee.config import HttpSinkConfig, TeeConfig
from tee.logic import Tee
from tee.sinks import GrpcSink, HttpSink, Sink


def build_tee(config: TeeConfig) -> Tee:
    """A :class:`tee.logic.Tee` (not started) with the sinks ``config`` names.

    Raises :class:`kvmesh.tls.TLSFileError` (a :class:`~kvmesh.configfile.ConfigError`)
    when a sink's certificate, key, CA or token file cannot be read.
    """
    sinks: list[Sink] = []
    for s in config.sinks:
        if isinstance(s, HttpSinkConfig):
            sinks.append(
                HttpSink(
                    s.url,
                    name=s.name,
                    # One keep-alive connection per in-flight send, never queued in the pool.
                    max_connections=config.send_concurrency,
                    extra_headers=s.headers,
                    tls=s.tls,
                )
            )
        else:
            sinks.append(GrpcSink(s.target, name=s.name, tls=s.tls))
    return Tee(
        sinks,
        queue_size=config.queue_size,
        concurrency=config.send_concurrency,
        send_timeout_s=config.send_timeout_s,
        max_input_ids=config.max_input_ids,
    )
