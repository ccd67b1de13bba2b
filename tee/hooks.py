"""Adapters that feed a :class:`tee.logic.Tee` from a router.

``router_client`` never imports the tee; a Python router wires the two with
``Router(..., on_decision=routed_request_hook(tee, model))``: every routed
prompt is offered (never blocking, never raising) as an ``/ingest_ids`` event
naming the prefill worker, which is what the cache simulator needs to model
per-worker caches.

Against a tee server with mutual TLS the router presents its own identity
(role ``router`` in the tee's policy)::

    tls = ClientTLS(ca_file="ca.crt", cert_file="router.crt", key_file="router.key")
    tee = await Tee([GrpcSink("tee:50061", tls=tls)]).start()
"""

from __future__ import annotations

from collections.abc import Callable
from typing import Any

from tee.events import ingest
from tee.logic import Tee


def routed_request_hook(tee: Tee, model: str) -> Callable[[Any, Any], bool]:
    """An ``on_decision`` hook offering each routed prompt to ``tee``.

    The hook reads ``req.token_ids`` (a request routed by block keys alone has
    no token ids to tee and is skipped), ``req.request_id`` and
    ``decision.prefill.worker``; it returns what :meth:`Tee.offer` returned
    (False also for a skipped request). Call it on the tee's event loop.
    """

    def hook(req: Any, decision: Any) -> bool:
        token_ids = getattr(req, "token_ids", None)
        if token_ids is None:
            return False
        event = ingest(model, list(token_ids), str(req.request_id), worker=decision.prefill.worker)
        return tee.offer(event)

    return hook
