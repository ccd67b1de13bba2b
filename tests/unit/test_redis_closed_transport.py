"""A write the event loop refuses on a connection that closed under redis-py is a
failed round trip (Unavailable to the caller), not an internal error.

Seen in ``kvmesh bench soak --kill-redis-every 4``: Redis killed while redis-py
reconnected made uvloop raise RuntimeError from the HELLO write, and two batches
of a PublishEventsStream were acknowledged INTERNAL.
"""

from __future__ import annotations

from typing import Any

import pytest
from redis.exceptions import ConnectionError as RedisConnectionError

from indexer.redis.backend import _closed_transport_as_connection_error
from indexer.redis.connection import CLIENT_ERRORS

CLOSED = (
    "unable to perform operation on <TCPTransport closed=True reading=False "
    "0x562b8a6ef2e0>; the handler is closed"
)


def _raising(exc: BaseException) -> Any:
    async def call(*args: Any, **kw: Any) -> Any:
        raise exc

    return call


async def test_a_closed_transport_is_a_connection_error() -> None:
    call = _closed_transport_as_connection_error(_raising(RuntimeError(CLOSED)))
    with pytest.raises(RedisConnectionError) as got:
        await call("EVALSHA", "sha", 0)
    assert isinstance(got.value, CLIENT_ERRORS)  # the backend maps these to Unavailable
    assert isinstance(got.value.__cause__, RuntimeError)


async def test_any_other_runtime_error_goes_through_as_it_is() -> None:
    bug = RuntimeError("dictionary changed size during iteration")
    call = _closed_transport_as_connection_error(_raising(bug))
    with pytest.raises(RuntimeError) as got:
        await call("GET", "k")
    assert got.value is bug


async def test_answers_pass_through() -> None:
    async def ok(*args: Any, **kw: Any) -> Any:
        return args

    assert await _closed_transport_as_connection_error(ok)("PING") == ("PING",)
