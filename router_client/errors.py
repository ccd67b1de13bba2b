"""Errors of the router client.

A router embedding :mod:`router_client` sees exactly two: :class:`ConfigError`
when it loads a bucket configuration, and :class:`NoHealthyWorker` when a
request cannot go anywhere (map it to HTTP 503). Every other trouble (the
indexer slow, down or overloaded; load reports missing; a request longer than
every bucket) degrades the choice, never fails it.
"""

from __future__ import annotations


class RouterError(Exception):
    """Base class of router client errors."""


class ConfigError(RouterError, ValueError):
    """An invalid bucket configuration.

    ``field`` is the path of the first offending field, e.g.
    ``buckets[2].workers[0]``; the message lists every problem.
    """

    def __init__(self, message: str, *, field: str = "") -> None:
        super().__init__(f"{field}: {message}" if field else message)
        self.field = field


class NoHealthyWorker(RouterError):
    """No healthy worker serves the stage asked for: the router answers 503.

    ``stage`` is ``"prefill"`` or ``"decode"``.
    """

    def __init__(self, stage: str, detail: str = "") -> None:
        msg = f"no healthy {stage} worker"
        super().__init__(f"{msg}: {detail}" if detail else msg)
        self.stage = stage
