"""The call scope every kvmesh gRPC method runs in: decoding, identity, limits, statuses.

Every service registers its handlers through :func:`add_guarded` (or
:func:`add_generated` for grpc's own health and reflection services). Each
handler is rewritten once, at registration, so that a call

1. is authenticated and its role checked (:class:`kvmesh.auth.Authorizer`):
   UNAUTHENTICATED or PERMISSION_DENIED, counted per method;
2. passes the per-client limits (:class:`ClientLimits`): calls in flight per
   client and token-bucket rates per method class (``match``, ``publish``):
   RESOURCE_EXHAUSTED naming the limit;
3. has its request bytes decoded here rather than by grpc, so that
   undecodable bytes are INVALID_ARGUMENT naming the message type (grpc.aio
   would end such a call UNKNOWN);
4. runs with :func:`kvmesh.auth.current_client` set, for instance-ownership
   checks deeper in the service, and, for the methods marked
   :func:`observed`, inside the hooks of the service's :class:`CallObserver`
   (per-method metrics, an in-flight cap, server spans);
5. ends with the status its error names: a :class:`~kvmesh.errors.KvmeshError`
   maps to the status of its ``code`` (:func:`status_code`), its field in the
   message and in the :data:`~kvmesh.errors.ERROR_FIELD_METADATA` trailing
   metadata, and a ``google.rpc.Status`` in ``grpc-status-details-bin``
   (:func:`error_trailers`); any other exception is INTERNAL with a log line,
   so no call ever ends UNKNOWN.

A server stream's messages are written by the scope (``context.write``): a
caller that hangs up while a send is in flight ends the stream (the handler
closed at once, the call CANCELLED), where grpc, iterating the handler
itself, could log the failed send at ERROR.

The client key of the limits is the identity's name when the caller is
authenticated, else its peer address (host only).
"""

from __future__ import annotations

import asyncio
import contextlib
import importlib
import inspect
import logging
import math
import time
from collections import OrderedDict
from collections.abc import AsyncIterator, Awaitable, Callable, Iterable, Iterator, Mapping
from dataclasses import dataclass
from typing import Any, Never, TypeVar

import grpc
import grpc.aio
from google.protobuf import any_pb2, duration_pb2
from google.rpc import error_details_pb2, status_pb2
from grpc_status import rpc_status
from opentelemetry import context as otel_context
from pydantic import Field

from kvmesh.auth import (
    OPEN,
    Authorizer,
    Client,
    current_client,
    peer_host,
    reset_current_client,
    set_current_client,
)
from kvmesh.configfile import StrictModel
from kvmesh.errors import (
    ERROR_FIELD_METADATA,
    InvalidArgument,
    KvmeshError,
    PermissionDenied,
    ResourceExhausted,
    Unauthenticated,
)
from kvmesh.tracing import extract_context, tracing_enabled

log = logging.getLogger(__name__)

__all__ = [
    "CallObserver",
    "CallerTraceContext",
    "ClientLimits",
    "Guard",
    "MethodRule",
    "add_generated",
    "add_guarded",
    "capture_handlers",
    "error_trailers",
    "observed",
    "status_code",
]


class ClientLimits(StrictModel):
    """Per-client limits (a client is an identity, or a peer host when unauthenticated)."""

    max_in_flight: int = Field(
        default=256,
        ge=0,
        description="Most calls one client may have in flight on this replica (an open "
        "stream counts as one); beyond it RESOURCE_EXHAUSTED. 0: no limit.",
    )
    match_rps: float = Field(
        default=0.0,
        ge=0,
        description="Match (and other read) calls per second per client; 0: no limit.",
    )
    match_burst: int = Field(
        default=0, ge=0, description="Bucket size of match_rps; 0: one second's worth."
    )
    publish_rps: float = Field(
        default=0.0,
        ge=0,
        description="Event batches per second per client (unary or streamed); 0: no limit.",
    )
    publish_burst: int = Field(
        default=0, ge=0, description="Bucket size of publish_rps; 0: one second's worth."
    )
    max_clients: int = Field(
        default=10_000,
        ge=1,
        description="Clients tracked at once; the longest idle is forgotten beyond it.",
    )


#: Longest a server stream sends under a grant it was not checked against
#: (seconds): the send side's recheck of the caller against the current policy.
STREAM_RECHECK_S = 0.25


@dataclass(frozen=True, slots=True)
class MethodRule:
    """Who may call a method, and which rate class it counts against.

    ``roles`` empty: no authentication at all (health checks). ``("*",)``:
    any authenticated caller.
    """

    roles: tuple[str, ...]
    rate: str = ""  # "", "match" or "publish"

    @property
    def open(self) -> bool:
        """Whether the method needs no identity."""
        return not self.roles


class _Bucket:
    __slots__ = ("burst", "rate", "stamp", "tokens")

    def __init__(self, rate: float, burst: float) -> None:
        self.rate = rate
        self.burst = burst
        self.tokens = burst
        self.stamp = time.monotonic()

    def take(self, n: float = 1.0) -> bool:
        now = time.monotonic()
        self.tokens = min(self.burst, self.tokens + (now - self.stamp) * self.rate)
        self.stamp = now
        if self.tokens >= n:
            self.tokens -= n
            return True
        return False


class _ClientState:
    __slots__ = ("buckets", "in_flight")

    def __init__(self) -> None:
        self.in_flight = 0
        self.buckets: dict[str, _Bucket] = {}


class Guard:
    """Authentication, authorization and client limits of one server.

    ``caller_name(context)`` names the caller in the log line of a refusal
    the service raises past the guard (:meth:`refused`); by default the
    current client's identity.
    """

    def __init__(
        self,
        what: str,
        authorizer: Authorizer | None = None,
        limits: ClientLimits | None = None,
        *,
        limits_field: str = "limits.per_client",
        caller_name: Callable[[grpc.aio.ServicerContext[Any, Any]], str] | None = None,
    ) -> None:
        self.what = what
        self.authorizer = authorizer
        self.limits = limits if limits is not None else ClientLimits()
        self.limits_field = limits_field
        self._caller_name = caller_name
        self._clients: OrderedDict[str, _ClientState] = OrderedDict()
        #: Refusals by the limits: (method, limit name) -> count.
        self.limit_refusals: dict[tuple[str, str], int] = {}
        self.decode_errors: dict[str, int] = {}
        self._callbacks: list[Callable[[str, str], None]] = []

    def on_refusal(self, callback: Callable[[str, str], None]) -> None:
        """Call ``callback(method, code)`` for every refused call (auth, limit, decode)."""
        self._callbacks.append(callback)
        if self.authorizer is not None:
            self.authorizer.on_refusal(callback)

    # -- limits ---------------------------------------------------------------

    def _state(self, key: str) -> _ClientState:
        st = self._clients.get(key)
        if st is None:
            st = _ClientState()
            self._clients[key] = st
            if len(self._clients) > self.limits.max_clients:
                for k, old in list(self._clients.items()):
                    if old.in_flight == 0 and k != key:
                        del self._clients[k]
                        break
        else:
            self._clients.move_to_end(key)
        return st

    def _refuse_limit(
        self, method: str, name: str, message: str, retry_after_s: float | None = None
    ) -> ResourceExhausted:
        k = (method, name)
        self.limit_refusals[k] = self.limit_refusals.get(k, 0) + 1
        for cb in self._callbacks:
            cb(method, "RESOURCE_EXHAUSTED")
        return ResourceExhausted(
            message, field=f"{self.limits_field}.{name}", retry_after_s=retry_after_s
        )

    def take(self, client: Client, rate: str, method: str, n: float = 1.0) -> None:
        """Take ``n`` tokens of ``client``'s ``rate`` bucket or raise RESOURCE_EXHAUSTED.

        The refusal's ``retry_after_s`` is the time until the bucket holds ``n``
        tokens again.
        """
        lim = self.limits
        rps = lim.match_rps if rate == "match" else lim.publish_rps if rate == "publish" else 0.0
        if rps <= 0:
            return
        st = self._state(client.key)
        b = st.buckets.get(rate)
        if b is None:
            burst = lim.match_burst if rate == "match" else lim.publish_burst
            b = st.buckets[rate] = _Bucket(rps, float(burst or max(1.0, rps)))
        if not b.take(n):
            raise self._refuse_limit(
                method,
                f"{rate}_rps",
                f"client {client.key!r} is over its rate of {rps:g} {rate} calls/s; retry later",
                retry_after_s=(n - b.tokens) / b.rate,
            )

    def enter(self, client: Client, method: str) -> None:
        """Count a call in flight for ``client`` or raise RESOURCE_EXHAUSTED."""
        st = self._state(client.key)
        cap = self.limits.max_in_flight
        if cap and st.in_flight >= cap:
            raise self._refuse_limit(
                method,
                "max_in_flight",
                f"client {client.key!r} has {st.in_flight} calls in flight (cap {cap}); retry",
            )
        st.in_flight += 1

    def exit(self, client: Client) -> None:
        """End a call counted by :meth:`enter`."""
        st = self._clients.get(client.key)
        if st is not None and st.in_flight > 0:
            st.in_flight -= 1

    def take_streamed(self, method: str, rate: str = "publish") -> None:
        """Count one message of an open stream against the caller's ``rate`` bucket.

        A stream is admitted once; its messages are counted one by one here.
        Raises RESOURCE_EXHAUSTED beyond the rate (counted, and reported to
        :meth:`on_refusal`); outside a call (no current client) counts nothing.
        """
        client = current_client()
        if client is not None:
            self.take(client, rate, method)

    def refused(
        self,
        method: str,
        err: PermissionDenied | Unauthenticated,
        context: grpc.aio.ServicerContext[Any, Any] | None = None,
    ) -> None:
        """Count and log a refusal the service raised past the guard (instance ownership...).

        The call scope reports those a handler raises; a stream handler that
        answers a refusal in band (in an ack) reports it here.
        """
        authz = self.authorizer
        if authz is None:
            return
        if self._caller_name is not None and context is not None:
            who = self._caller_name(context)
        else:
            c = current_client()
            who = c.principal.name if c is not None else "?"
        authz.refuse(method, err, who)

    # -- identity -------------------------------------------------------------

    def identify(
        self, method: str, rule: MethodRule, context: grpc.aio.ServicerContext[Any, Any]
    ) -> Client:
        """The caller of this call, authorized for ``rule`` (raises on refusal)."""
        authz = self.authorizer
        if authz is None or not authz.enabled or rule.open:
            return Client(OPEN, peer_host(context.peer() or ""))
        try:
            principal = authz.authenticate(
                _auth_context(context), context.invocation_metadata() or ()
            )
        except (Unauthenticated, PermissionDenied) as e:
            authz.refuse(method, e, peer_host(context.peer() or ""))
            raise
        if rule.roles != ("*",) and not principal.has_any(rule.roles):
            err = PermissionDenied(
                f"identity {principal.name!r} (roles {sorted(principal.roles)}) may not call "
                f"{method}; it needs one of {list(rule.roles)}"
            )
            authz.refuse(method, err, principal.name)
            raise err
        return Client(principal, principal.name)


_SAN = "x509_subject_alternative_name"


class _CertAuthContext(Mapping[str, Any]):
    """The auth context of a call whose peer presented a certificate with SANs, built lazily.

    ``ServicerContext.auth_context()`` converts every property of the
    connection on every call, the peer's PEM certificate included: profiled
    under mutual TLS it cost about as much as the authorization that reads two
    of them. gRPC names the SANs the peer identity only for a verified TLS
    client certificate, so the transport is TLS; the SANs come from
    ``peer_identities()`` and any other key builds the whole context.
    """

    __slots__ = ("_context", "_full", "_sans")

    def __init__(self, context: Any, sans: list[bytes]) -> None:
        self._context = context
        self._sans = sans
        self._full: Mapping[str, Any] | None = None

    def _all(self) -> Mapping[str, Any]:
        if self._full is None:
            self._full = self._context.auth_context() or {}
        return self._full

    def __getitem__(self, key: str) -> Any:
        if key == "transport_security_type":
            return [b"ssl"]
        if key == _SAN:
            return self._sans
        return self._all()[key]

    def __iter__(self) -> Iterator[str]:
        return iter(self._all())

    def __len__(self) -> int:
        return len(self._all())


def _auth_context(context: Any) -> Mapping[str, Any]:
    """``context.auth_context()``, lazily when the peer's identity is its certificate's SANs.

    ``context`` may be a stand-in without ``peer_identity_key`` (tee/httpsec.py).
    """
    key_of = getattr(context, "peer_identity_key", None)
    if key_of is not None and key_of() == _SAN:
        return _CertAuthContext(context, context.peer_identities() or [])
    ac: Mapping[str, Any] = context.auth_context()
    return ac


def error_trailers(
    err: KvmeshError, status: grpc.StatusCode
) -> tuple[tuple[str, str | bytes], ...]:
    """The trailing metadata of a call ending with ``err`` (with ``status``).

    ``kvmesh-error-field`` when the error names a field, and always a
    ``google.rpc.Status`` (the same code and message as the call's status) in
    ``grpc-status-details-bin``, the standard any gRPC library decodes
    (``grpc_status.rpc_status.from_call`` in Python). Its details: a
    ``google.rpc.BadRequest`` with one field violation (field and message)
    for INVALID_ARGUMENT, and a ``google.rpc.RetryInfo`` whenever the error
    says how long to wait before retrying (``retry_after_s``).
    """
    details: list[any_pb2.Any] = []
    if status == grpc.StatusCode.INVALID_ARGUMENT:
        violation = error_details_pb2.BadRequest.FieldViolation(
            field=err.field, description=err.message
        )
        details.append(_packed(error_details_pb2.BadRequest(field_violations=[violation])))
    if err.retry_after_s is not None:
        delay = duration_pb2.Duration()
        # Rounded up to the millisecond: a client waiting this long finds the token there.
        delay.FromMilliseconds(max(0, math.ceil(err.retry_after_s * 1000)))
        details.append(_packed(error_details_pb2.RetryInfo(retry_delay=delay)))
    rich = status_pb2.Status(code=status.value[0], message=str(err), details=details)
    trailers: tuple[tuple[str, str | bytes], ...] = tuple(
        rpc_status.to_status(rich).trailing_metadata
    )
    if err.field:
        trailers = ((ERROR_FIELD_METADATA, err.field), *trailers)
    return trailers


def _packed(message: Any) -> any_pb2.Any:
    out = any_pb2.Any()
    out.Pack(message)
    return out


def status_code(name: str) -> grpc.StatusCode:
    """The grpc.StatusCode an error's code names (INTERNAL for UNKNOWN, OK or a bad name).

    Services' errors carry the *name* of their status so that their logic needs
    no grpc import; the call scope maps it here, so no call ever ends UNKNOWN.
    """
    code = getattr(grpc.StatusCode, name, grpc.StatusCode.INTERNAL)
    if code in (grpc.StatusCode.UNKNOWN, grpc.StatusCode.OK):
        return grpc.StatusCode.INTERNAL
    return code


class CallObserver:
    """A service's hooks around the calls of its :func:`observed` methods; this base does nothing.

    The call scope calls :meth:`begin` once a call is admitted (identity,
    client limits) and its request decoded, and :meth:`end` when the call
    finishes, with what :meth:`begin` returned and the name of the status the
    call ended with (``OK``, ``CANCELLED`` or an error's code). :meth:`begin`
    may refuse the call by raising a :class:`~kvmesh.errors.KvmeshError` (a
    service-wide cap, say): the call ends with its status and :meth:`end` is
    not called. Per-method metrics, in-flight caps and server spans plug in
    here; the error mapping is the scope's alone.
    """

    def begin(self, service: str, method: str, context: grpc.aio.ServicerContext[Any, Any]) -> Any:
        """Start observing one call of ``service``/``method``; the result goes to :meth:`end`."""
        return None

    def end(self, service: str, method: str, state: Any, code: str) -> None:
        """Finish observing one call, which ended with status ``code``."""


class CallerTraceContext(CallObserver):
    """Makes the caller's trace context (from the call metadata) current for the whole call.

    Spans a handler starts, and contexts it captures for later sends, then
    continue the caller's trace. Does nothing when tracing is off in this
    process (decided at construction).
    """

    def __init__(self) -> None:
        self.enabled = tracing_enabled()

    def begin(self, service: str, method: str, context: grpc.aio.ServicerContext[Any, Any]) -> Any:
        """Attach the caller's context; the token detaches it in :meth:`end`."""
        if not self.enabled:
            return None
        return otel_context.attach(extract_context(context.invocation_metadata()))

    def end(self, service: str, method: str, state: Any, code: str) -> None:
        """Detach what :meth:`begin` attached."""
        if state is not None:
            otel_context.detach(state)


#: The attribute :func:`observed` sets on a servicer method (to the method's name).
OBSERVED_ATTR = "__kvmesh_rpc__"

_F = TypeVar("_F", bound=Callable[..., Any])


def observed(fn: _F) -> _F:
    """Mark a servicer method as one its service's :class:`CallObserver` sees.

    Every method registered through :func:`add_guarded` runs in the same call
    scope (identity, limits, decoding, error mapping); only marked ones also
    run the observer's hooks (a ``Ping`` that is the latency floor stays
    unmarked).
    """
    setattr(fn, OBSERVED_ATTR, fn.__name__)
    return fn


class _Scope:
    """One call's end: the status it ended with, for the observer."""

    __slots__ = ("code",)

    def __init__(self) -> None:
        self.code = "OK"

    async def abort(self, context: grpc.aio.ServicerContext[Any, Any], err: KvmeshError) -> Never:
        """End the call with the status ``err`` names, its details in the trailing metadata
        (:func:`error_trailers`)."""
        status = status_code(err.code)
        self.code = status.name
        await context.abort(status, str(err), error_trailers(err, status))

    async def fail(
        self,
        context: grpc.aio.ServicerContext[Any, Any],
        guard: Guard,
        method: str,
        err: Exception,
    ) -> Never:
        """End the call for an exception its handler raised: never UNKNOWN.

        A :class:`~kvmesh.errors.KvmeshError` ends with its status (a refusal
        the service raised, such as instance ownership, is counted and logged
        like the guard's own); anything else is INTERNAL naming only the
        exception's type, with a log line carrying the traceback.
        """
        if isinstance(err, KvmeshError):
            if isinstance(err, PermissionDenied | Unauthenticated):
                guard.refused(method, err, context)
            await self.abort(context, err)
        if isinstance(err, NotImplementedError):
            # A generated base method nobody overrode: a clear status, no traceback.
            self.code = "UNIMPLEMENTED"
            await self._abort_plain(
                context, grpc.StatusCode.UNIMPLEMENTED, f"{method} is not implemented"
            )
        log.error(
            "internal error in %s: %r", method, err, exc_info=(type(err), err, err.__traceback__)
        )
        self.code = "INTERNAL"
        await self._abort_plain(
            context, grpc.StatusCode.INTERNAL, f"internal error: {type(err).__name__}"
        )

    @staticmethod
    async def _abort_plain(
        context: grpc.aio.ServicerContext[Any, Any], status: grpc.StatusCode, message: str
    ) -> Never:
        """End the call with ``status`` and ``message``, and their google.rpc.Status."""
        await context.abort(status, message, error_trailers(KvmeshError(message), status))


def _decode_error(type_name: str, e: BaseException) -> KvmeshError:
    return InvalidArgument(
        f"cannot decode the request as {type_name}: {type(e).__name__}: {e}", field="request"
    )


def _type_name(deserializer: Any) -> str:
    owner = getattr(deserializer, "__self__", None)
    desc = getattr(owner, "DESCRIPTOR", None)
    return getattr(desc, "full_name", None) or "the request message"


def _wrap(
    service: str,
    method: str,
    handler: grpc.RpcMethodHandler[Any, Any],
    rule: MethodRule,
    guard: Guard,
    observer: CallObserver | None,
) -> grpc.RpcMethodHandler[Any, Any]:
    """``handler`` run in the call scope: admission, decoding, observer, error mapping."""
    deser = handler.request_deserializer
    type_name = _type_name(deser)
    counts = guard.decode_errors
    inner: Any = (
        handler.unary_unary or handler.unary_stream or handler.stream_unary or handler.stream_stream
    )
    obs = observer if observer is not None and getattr(inner, OBSERVED_ATTR, None) else None

    def decode(raw: Any) -> Any:
        if deser is None or not isinstance(raw, bytes):
            return raw
        try:
            return deser(raw)
        except Exception as e:
            counts[method] = counts.get(method, 0) + 1
            for cb in guard._callbacks:
                cb(method, "INVALID_ARGUMENT")
            raise _decode_error(type_name, e) from e

    async def admit(context: grpc.aio.ServicerContext[Any, Any], scope: _Scope) -> Client:
        try:
            client = guard.identify(method, rule, context)
            guard.take(client, rule.rate, method)
            guard.enter(client, method)
        except KvmeshError as e:
            await scope.abort(context, e)
        return client

    async def requests(it: AsyncIterator[Any], context: Any, scope: _Scope) -> AsyncIterator[Any]:
        # Each message of a stream is the caller's act under the policy as it
        # is now: a stream opened before its identity was revoked (or its
        # instances narrowed) ends, and ownership checks see the current grant.
        authz = guard.authorizer
        recheck = authz is not None and authz.enabled and not rule.open
        first = True
        async for raw in it:
            try:
                if recheck and not first:
                    set_current_client(guard.identify(method, rule, context))
                first = False
                yield decode(raw)
            except KvmeshError as e:
                await scope.abort(context, e)

    async def request_of(
        arg: Any, context: grpc.aio.ServicerContext[Any, Any], scope: _Scope
    ) -> Any:
        if handler.request_streaming:
            return requests(arg, context, scope)
        try:
            return decode(arg)
        except KvmeshError as e:
            await scope.abort(context, e)

    @contextlib.asynccontextmanager
    async def scoped(arg: Any, context: grpc.aio.ServicerContext[Any, Any]) -> AsyncIterator[Any]:
        """One call's scope: admission, the caller as current client, the observer, and the
        mapping of whatever the handler raises to a status (never UNKNOWN)."""
        scope = _Scope()
        client = await admit(context, scope)
        tok = set_current_client(client)
        try:
            req = await request_of(arg, context, scope)
            try:
                state = obs.begin(service, method, context) if obs is not None else None
            except KvmeshError as e:
                await scope.abort(context, e)
            try:
                yield req
            except asyncio.CancelledError:
                scope.code = "CANCELLED"
                raise
            except grpc.aio.AbortError:
                raise
            except Exception as e:
                await scope.fail(context, guard, method, e)
            finally:
                if obs is not None:
                    obs.end(service, method, state, scope.code)
        finally:
            reset_current_client(tok)
            guard.exit(client)

    async def call(arg: Any, context: grpc.aio.ServicerContext[Any, Any]) -> Any:
        # Unary replies, and streams a coroutine writes with context.write
        # (grpc's health Watch).
        async with scoped(arg, context) as req:
            result = inner(req, context)
            return await result if isinstance(result, Awaitable) else result

    async def stream(arg: Any, context: grpc.aio.ServicerContext[Any, Any]) -> None:
        # What a stream sends is sent under the policy as it is now: a caller
        # revoked (or narrowed out of the method) after it opened the stream is
        # ended PERMISSION_DENIED before its next message, checked at most
        # every STREAM_RECHECK_S (a follower's WatchIndex, an admin's dump).
        #
        # The handler's messages are written here (context.write), not by
        # grpc: a send that fails because the caller hung up is the end of the
        # stream (see _SEND_FAILED), not an error grpc logs.
        authz = guard.authorizer
        recheck = authz is not None and authz.enabled and not rule.open
        async with scoped(arg, context) as req:
            checked = time.monotonic()
            items = inner(req, context)
            hung_up = False
            try:
                async for item in items:
                    if recheck and time.monotonic() - checked >= STREAM_RECHECK_S:
                        checked = time.monotonic()
                        guard.identify(method, rule, context)
                    try:
                        await context.write(item)
                    except _SEND_FAILED:
                        hung_up = True
                        break
            finally:
                # Closed now, not when it is collected: what it holds (a
                # follower's slot in its replica's hub) goes with the call.
                await items.aclose()
            if hung_up:
                await _hung_up(context)

    factory = HANDLER_FACTORIES[(handler.request_streaming, handler.response_streaming)]
    return factory(
        stream if inspect.isasyncgenfunction(inner) else call,
        request_deserializer=None,
        response_serializer=handler.response_serializer,
    )


#: What :meth:`grpc.aio.ServicerContext.write` raises when grpc core could not
#: send a message: the call already ended there (the caller hung up or reset
#: the connection, its deadline passed, the server stops). grpc logs it at
#: ERROR when it reaches grpc before grpc's own notice of the hang-up does;
#: the stream wrapper of :func:`_wrap` ends the stream instead.
_SEND_FAILED: type[Exception] = importlib.import_module("grpc._cython.cygrpc").ExecuteBatchError
#: Longest a stream whose send failed waits for grpc's notice that the call
#: ended (seconds; it comes within a step or two of the event loop): the
#: notice cancels the call quietly, where returning first would have grpc
#: send a status on a dead call and log that failure.
STREAM_HANGUP_WAIT_S = 5.0


async def _hung_up(context: grpc.aio.ServicerContext[Any, Any]) -> None:
    """After a failed send: wait for grpc to cancel the call (it ends CANCELLED,
    logged at DEBUG), at most :data:`STREAM_HANGUP_WAIT_S`."""
    log.debug("a stream's send failed: the caller hung up")
    await asyncio.sleep(STREAM_HANGUP_WAIT_S)


#: grpc's handler constructor by (request streaming, response streaming).
HANDLER_FACTORIES: dict[tuple[bool, bool], Callable[..., grpc.RpcMethodHandler[Any, Any]]] = {
    (False, False): grpc.unary_unary_rpc_method_handler,
    (False, True): grpc.unary_stream_rpc_method_handler,
    (True, False): grpc.stream_unary_rpc_method_handler,
    (True, True): grpc.stream_stream_rpc_method_handler,
}


def add_guarded(
    server: grpc.aio.Server,
    service_full_name: str,
    handlers: Mapping[str, grpc.RpcMethodHandler[Any, Any]],
    rules: Mapping[str, MethodRule],
    guard: Guard,
    observer: CallObserver | None = None,
) -> None:
    """Register ``handlers`` of one service behind ``guard``, in the call scope.

    Every method must have a rule: a method missing from ``rules`` is a
    programming error (a new RPC must state who may call it). ``observer``
    sees the calls of the methods marked :func:`observed`.
    """
    missing = sorted(set(handlers) - set(rules))
    if missing:
        raise ValueError(f"{service_full_name}: no access rule for {missing}")
    wrapped = {
        name: _wrap(service_full_name, name, h, rules[name], guard, observer)
        for name, h in handlers.items()
    }
    server.add_generic_rpc_handlers(
        (grpc.method_handlers_generic_handler(service_full_name, wrapped),)
    )
    server.add_registered_method_handlers(service_full_name, wrapped)


class _Capture:
    """Stands in for a server to collect what a generated ``add_*_to_server`` registers."""

    def __init__(self) -> None:
        self.services: dict[str, dict[str, grpc.RpcMethodHandler[Any, Any]]] = {}

    def add_generic_rpc_handlers(self, handlers: Iterable[Any]) -> None:
        pass

    def add_registered_method_handlers(
        self, name: str, handlers: Mapping[str, grpc.RpcMethodHandler[Any, Any]]
    ) -> None:
        self.services[name] = dict(handlers)


def capture_handlers(
    add_fn: Callable[[Any, Any], None], servicer: Any
) -> dict[str, dict[str, grpc.RpcMethodHandler[Any, Any]]]:
    """The handlers ``add_fn(servicer, server)`` would register, by service name."""
    cap = _Capture()
    add_fn(servicer, cap)
    if not cap.services:
        raise ValueError(f"{add_fn!r} registered no service")
    return cap.services


def add_generated(
    server: grpc.aio.Server,
    add_fn: Callable[[Any, Any], None],
    servicer: Any,
    rule: MethodRule,
    guard: Guard,
) -> None:
    """Register a generated service (health, reflection) with one rule for all methods."""
    for name, handlers in capture_handlers(add_fn, servicer).items():
        add_guarded(server, name, handlers, dict.fromkeys(handlers, rule), guard)


#: Health checks: open to everyone (kubelet and load balancers present no identity).
OPEN_RULE = MethodRule(())
#: Any authenticated caller (reflection, Ping).
ANY_RULE = MethodRule(("*",))


def add_health_and_reflection(
    server: grpc.aio.Server,
    health_servicer: Any,
    service_names: Iterable[str],
    guard: Guard,
) -> None:
    """Health (open) and reflection (any authenticated caller) behind ``guard``."""
    from grpc_health.v1 import health_pb2, health_pb2_grpc
    from grpc_reflection.v1alpha import _async as reflection_aio
    from grpc_reflection.v1alpha import reflection, reflection_pb2_grpc

    async def list_statuses(request: Any, context: Any) -> Any:
        # grpc's servicer leaves List unimplemented; answer from the same table Check reads.
        table = getattr(health_servicer, "_server_status", {})
        return health_pb2.HealthListResponse(
            statuses={
                name: health_pb2.HealthCheckResponse(status=status)
                for name, status in dict(table).items()
            }
        )

    for name, handlers in capture_handlers(
        health_pb2_grpc.add_HealthServicer_to_server, health_servicer
    ).items():
        if "List" in handlers:
            handlers["List"] = grpc.unary_unary_rpc_method_handler(
                list_statuses,
                request_deserializer=health_pb2.HealthListRequest.FromString,
                response_serializer=health_pb2.HealthListResponse.SerializeToString,
            )
        add_guarded(server, name, handlers, dict.fromkeys(handlers, OPEN_RULE), guard)
    names = [*service_names, "grpc.health.v1.Health", reflection.SERVICE_NAME]
    servicer = reflection_aio.ReflectionServicer(names)
    add_generated(
        server,
        reflection_pb2_grpc.add_ServerReflectionServicer_to_server,
        servicer,
        ANY_RULE,
        guard,
    )


class HealthPort:
    """A plaintext port serving only ``grpc.health.v1`` from a server's health servicer.

    For kubelet gRPC probes, which present no certificate: with TLS on, the
    main port refuses them at the handshake. Nothing but health is served
    here, so it reveals only SERVING / NOT_SERVING.
    """

    def __init__(self, health_servicer: Any, address: str) -> None:
        from grpc_health.v1 import health_pb2_grpc

        self.address = address
        self.port = 0
        self._server: grpc.aio.Server | None = grpc.aio.server()
        health_pb2_grpc.add_HealthServicer_to_server(health_servicer, self._server)

    async def start(self) -> int:
        """Bind and serve; return the bound port."""
        assert self._server is not None
        try:
            self.port = self._server.add_insecure_port(self.address)
        except RuntimeError as e:
            raise OSError(f"cannot listen on {self.address}: {e}") from e
        await self._server.start()
        return self.port

    async def stop(self) -> None:
        """Stop at once (probes need no grace). Idempotent."""
        server, self._server = self._server, None
        if server is not None:
            await server.stop(0)
