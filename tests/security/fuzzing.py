"""Fuzzing of a gRPC server's every method with raw request bytes.

Generic over servers: a :class:`Target` is a channel to a running server, the
service descriptors it registers, valid seed requests per method, the unary
calls that must keep answering OK (Ping, health) and the server's message
size limit. For every method (from the descriptors, called with
``request_serializer=None`` so that the bytes reach the server as they are)
the harness sends

- undecodable bytes (:func:`undecodable_payloads`, plus an unterminated group
  on every field number of the request type);
- the seeds with one field set to an adversarial value (:func:`mutations`):
  unknown enum numbers, extreme integers and floats, empty, 100 KB and
  multi-byte strings, huge repeated fields, and raw encodings the message
  API cannot write (invalid UTF-8, overlong varints, wrong wire types);
- a message beyond the size limit;
- for client-streaming methods, good and bad frames on one stream;

and :func:`judge` checks the answer: never UNKNOWN or INTERNAL; INVALID_ARGUMENT
for bytes the protobuf runtime cannot decode (RESOURCE_EXHAUSTED beyond the
size limit); INVALID_ARGUMENT always names a field (``kvmesh-error-field``
trailing metadata, repeated at the start of the details); an unknown enum
number is INVALID_ARGUMENT naming that field's path. After every case the
liveness calls must answer OK and the server must have logged no error.
Hypothesis strategies (:func:`wire_messages`) feed the same checks with random
bytes.
"""

from __future__ import annotations

import asyncio
import contextlib
import logging
import math
import re
import threading
from collections.abc import Callable, Coroutine, Iterator, Mapping, Sequence
from dataclasses import dataclass
from typing import Any, Generic, TypeVar

import grpc
from google.protobuf import message_factory
from google.protobuf.descriptor import Descriptor, FieldDescriptor, ServiceDescriptor
from google.protobuf.message import DecodeError, Message
from hypothesis import strategies as st

from kvmesh.errors import ERROR_FIELD_METADATA
from kvmesh.runtime import new_event_loop

#: Deadline of one fuzz call: generous, only a hung server reaches it.
CALL_TIMEOUT_S = 30.0

# -- wire encoding -------------------------------------------------------------

VARINT, I64, LEN, SGROUP, EGROUP, I32 = 0, 1, 2, 3, 4, 5


def varint(value: int) -> bytes:
    """Base-128 varint; a negative value is written as its 64-bit two's complement."""
    value &= (1 << 64) - 1
    out = bytearray()
    while value > 0x7F:
        out.append((value & 0x7F) | 0x80)
        value >>= 7
    out.append(value)
    return bytes(out)


def tag(number: int, wire_type: int) -> bytes:
    """The key of a field."""
    return varint((number << 3) | wire_type)


def len_field(number: int, payload: bytes) -> bytes:
    """A length-delimited field."""
    return tag(number, LEN) + varint(len(payload)) + payload


def nest(path: Sequence[FieldDescriptor], leaf: bytes) -> bytes:
    """``leaf`` (a whole encoded field of ``path[-1]``) wrapped in its parents' fields.

    Appended to an encoded message it merges into the existing sub-messages
    (a repeated parent gets a new element).
    """
    out = leaf
    for f in reversed(path[:-1]):
        out = len_field(f.number, out)
    return out


_WIRE_TYPE = {
    FieldDescriptor.TYPE_DOUBLE: I64,
    FieldDescriptor.TYPE_FIXED64: I64,
    FieldDescriptor.TYPE_SFIXED64: I64,
    FieldDescriptor.TYPE_FLOAT: I32,
    FieldDescriptor.TYPE_FIXED32: I32,
    FieldDescriptor.TYPE_SFIXED32: I32,
    FieldDescriptor.TYPE_STRING: LEN,
    FieldDescriptor.TYPE_BYTES: LEN,
    FieldDescriptor.TYPE_MESSAGE: LEN,
    FieldDescriptor.TYPE_GROUP: SGROUP,
}


def wire_type_of(f: FieldDescriptor) -> int:
    """The wire type of one (unpacked) value of ``f``."""
    return _WIRE_TYPE.get(f.type, VARINT)


# -- methods -------------------------------------------------------------------


@dataclass(frozen=True)
class Method:
    """One RPC of a service, as the descriptors give it."""

    service: str
    name: str
    input: Descriptor
    client_streaming: bool
    server_streaming: bool

    @property
    def path(self) -> str:
        """The HTTP/2 path of the method."""
        return f"/{self.service}/{self.name}"

    def __str__(self) -> str:
        return f"{self.service.rsplit('.', 1)[-1]}/{self.name}"

    def __repr__(self) -> str:
        return f"Method({self.path!r})"

    def decodes(self, data: bytes) -> bool:
        """Whether the protobuf runtime parses ``data`` as the request type."""
        try:
            message_factory.GetMessageClass(self.input).FromString(data)
        except DecodeError:
            return False
        return True

    def new(self) -> Message:
        """An empty request message."""
        msg: Message = message_factory.GetMessageClass(self.input)()
        return msg


def methods_of(services: Sequence[ServiceDescriptor]) -> list[Method]:
    """Every method of ``services``, in declaration order."""
    return [
        Method(s.full_name, m.name, m.input_type, m.client_streaming, m.server_streaming)
        for s in services
        for m in s.methods
    ]


# -- calls ---------------------------------------------------------------------


@dataclass(frozen=True)
class Outcome:
    """How a call ended. A server stream still open after its first response is OK."""

    code: grpc.StatusCode
    details: str = ""
    field: str = ""
    #: The serialized responses received.
    responses: tuple[bytes, ...] = ()


def _outcome(call: Any, responses: Sequence[bytes]) -> Outcome:
    meta = dict(call.trailing_metadata() or ())
    return Outcome(
        call.code(),
        call.details() or "",
        str(meta.get(ERROR_FIELD_METADATA, "")),
        tuple(responses),
    )


def call_raw(
    channel: grpc.Channel, method: Method, frames: Sequence[bytes], timeout: float = CALL_TIMEOUT_S
) -> Outcome:
    """Send ``frames`` (one for a unary request) as they are and report how the call ended."""
    path = method.path
    got: list[bytes] = []
    try:
        if not method.client_streaming and not method.server_streaming:
            uu: grpc.UnaryUnaryMultiCallable[bytes, bytes] = channel.unary_unary(path, None, None)
            resp, call = uu.with_call(frames[0], timeout=timeout)
            return _outcome(call, [resp])
        if method.client_streaming and not method.server_streaming:
            su: grpc.StreamUnaryMultiCallable[bytes, bytes] = channel.stream_unary(path, None, None)
            resp, call = su.with_call(iter(frames), timeout=timeout)
            return _outcome(call, [resp])
        stream: Any
        if not method.client_streaming:
            # A server stream may never end (health Watch): its first answer will do.
            us: grpc.UnaryStreamMultiCallable[bytes, bytes] = channel.unary_stream(path, None, None)
            stream = us(frames[0], timeout=timeout)
            try:
                first = next(stream)
            except StopIteration:
                return _outcome(stream, got)
            stream.cancel()
            return Outcome(grpc.StatusCode.OK, responses=(first,))
        ss: grpc.StreamStreamMultiCallable[bytes, bytes] = channel.stream_stream(path, None, None)
        stream = ss(iter(frames), timeout=timeout)
        for resp in stream:
            got.append(resp)
        return _outcome(stream, got)
    except grpc.RpcError as e:
        return _outcome(e, got)


# -- what the server logs ------------------------------------------------------


class LogWatch(logging.Handler):
    """Collects log records at ERROR and above, and any record with a traceback."""

    def __init__(self) -> None:
        super().__init__(logging.DEBUG)
        self._records: list[logging.LogRecord] = []
        self._mutex = threading.Lock()

    def emit(self, record: logging.LogRecord) -> None:
        if record.levelno >= logging.ERROR or record.exc_info:
            with self._mutex:
                self._records.append(record)

    def take(self) -> list[str]:
        """The records collected since the last call, formatted, and forget them."""
        with self._mutex:
            records, self._records = self._records, []
        out = []
        for r in records:
            text = f"{r.name} {r.levelname}: {r.getMessage()}"
            if r.exc_info and r.exc_info[1] is not None:
                text += f" [{type(r.exc_info[1]).__name__}: {r.exc_info[1]}]"
            out.append(text)
        return out

    @contextlib.contextmanager
    def installed(self) -> Iterator[LogWatch]:
        """Attach to the root logger for the duration of the block."""
        root = logging.getLogger()
        root.addHandler(self)
        try:
            yield self
        finally:
            root.removeHandler(self)


# -- a server on its own event loop --------------------------------------------

S = TypeVar("S")


class ServerThread(Generic[S]):
    """Runs an asyncio server on its own event loop in a thread, so that a
    blocking client (and Hypothesis) can call it."""

    def __init__(
        self,
        start: Callable[[], Coroutine[Any, Any, S]],
        stop: Callable[[S], Coroutine[Any, Any, None]],
    ) -> None:
        self._start = start
        self._stop = stop
        self._loop = new_event_loop()
        self._thread = threading.Thread(target=self._loop.run_forever, daemon=True)
        self.server: S | None = None

    def __enter__(self) -> S:
        self._thread.start()
        try:
            self.server = asyncio.run_coroutine_threadsafe(self._start(), self._loop).result(60)
        except BaseException:
            self._halt()
            raise
        return self.server

    def __exit__(self, *exc: object) -> None:
        try:
            if self.server is not None:
                asyncio.run_coroutine_threadsafe(self._stop(self.server), self._loop).result(60)
        finally:
            self._halt()

    def _halt(self) -> None:
        self._loop.call_soon_threadsafe(self._loop.stop)
        self._thread.join(60)
        self._loop.close()


# -- targets and judgement -----------------------------------------------------


class Target:
    """A running server to fuzz (a plain class: Hypothesis prints it by its name)."""

    def __init__(
        self,
        *,
        name: str,
        channel: grpc.Channel,
        services: Sequence[ServiceDescriptor],
        seeds: Mapping[str, Sequence[Message]],
        liveness: Sequence[tuple[str, bytes]],
        max_message_bytes: int,
        in_band: Mapping[str, Callable[[bytes], list[tuple[int, str]]]] | None = None,
        logs: LogWatch | None = None,
    ) -> None:
        self.name = name
        self.channel = channel
        self.services = services
        #: Valid requests by method path (``/pkg.Service/Method``); the first is mutated.
        self.seeds = seeds
        #: Unary calls (path, request bytes) that must answer OK after every case.
        self.liveness = liveness
        #: The server's grpc.max_receive_message_length.
        self.max_message_bytes = max_message_bytes
        #: By method path: the errors a response reports in-band, as (google.rpc
        #: code number, field), for methods that answer a rejection in a response.
        self.in_band = in_band or {}
        #: Errors the server logs (install it before starting the server).
        self.logs = logs or LogWatch()

    def __repr__(self) -> str:
        return f"Target({self.name!r})"

    def methods(self) -> list[Method]:
        """Every method of every service of the target."""
        return methods_of(self.services)

    def seeds_of(self, method: Method) -> Sequence[Message]:
        """The seeds of ``method`` (the empty request when it has none)."""
        return self.seeds.get(method.path) or [method.new()]

    def good_frames(self, method: Method) -> list[bytes]:
        """The seeds of ``method``, serialized."""
        return [s.SerializeToString() for s in self.seeds_of(method)]


@dataclass(frozen=True)
class Case:
    """One fuzz input: the frames of one call."""

    label: str
    frames: tuple[bytes, ...]
    #: Path of a field set to an unknown enum number (the answer must name it).
    enum_path: str = ""


def expected_code(
    method: Method, frames: Sequence[bytes], max_bytes: int
) -> grpc.StatusCode | None:
    """The status bytes alone decide: oversized or undecodable frames (None: any)."""
    for f in frames:
        if len(f) > max_bytes:
            return grpc.StatusCode.RESOURCE_EXHAUSTED
        if not method.decodes(f):
            return grpc.StatusCode.INVALID_ARGUMENT
    return None


_UNKNOWN = grpc.StatusCode.UNKNOWN.value[0]
_INTERNAL = grpc.StatusCode.INTERNAL.value[0]
_INVALID_ARGUMENT = grpc.StatusCode.INVALID_ARGUMENT.value[0]


def _is_path_suffix(full: str, reported: str) -> bool:
    return full == reported or full.endswith("." + reported)


#: The field the guard names for a request it cannot decode.
WHOLE_REQUEST = "request"


def _reachable(desc: Descriptor) -> list[Descriptor]:
    out: dict[str, Descriptor] = {}
    todo = [desc]
    while todo:
        d = todo.pop()
        if d.full_name in out:
            continue
        out[d.full_name] = d
        todo += [f.message_type for f in d.fields if f.message_type is not None]
    return list(out.values())


def names_a_field(desc: Descriptor, name: str) -> bool:
    """Whether ``name`` (``a.b[2].c``) is a chain of fields of ``desc`` or of a message
    inside it (paths may be relative to a part, e.g. a batch), or the whole request."""
    if name == WHOLE_REQUEST:
        return True
    parts = [re.sub(r"\[\d+\]$", "", p) for p in name.split(".")]
    if not all(parts):
        return False
    for d in _reachable(desc):
        cur: Descriptor | None = d
        for part in parts:
            f = cur.fields_by_name.get(part) if cur is not None else None
            if f is None:
                break
            cur = f.message_type
        else:
            return True
    return False


def judge(target: Target, method: Method, case: Case, out: Outcome) -> list[str]:
    """Problems with how ``case`` was answered (empty: fine)."""
    problems: list[str] = []
    code = out.code
    if code in (grpc.StatusCode.UNKNOWN, grpc.StatusCode.INTERNAL):
        problems.append(f"status {code.name}")
    want = expected_code(method, case.frames, target.max_message_bytes)
    if want is not None and code != want:
        problems.append(f"status {code.name}, expected {want.name}")
    if code == grpc.StatusCode.INVALID_ARGUMENT:
        if not (out.field and out.details.startswith(out.field)):
            problems.append(f"INVALID_ARGUMENT names no field (field {out.field!r})")
        elif not names_a_field(method.input, out.field):
            problems.append(f"INVALID_ARGUMENT names {out.field!r}, not a field of the request")
    errors = [(code.value[0], out.field)] if code != grpc.StatusCode.OK else []
    parse = target.in_band.get(method.path)
    if parse is not None:
        for resp in out.responses:
            for number, name in parse(resp):
                errors.append((number, name))
                if number in (_UNKNOWN, _INTERNAL):
                    problems.append(f"in-band error code {number} ({name!r})")
                if number == _INVALID_ARGUMENT and not names_a_field(method.input, name):
                    problems.append(f"in-band INVALID_ARGUMENT names {name!r}, not a field")
    if case.enum_path and want is None:
        named = [name for number, name in errors if number == _INVALID_ARGUMENT]
        if not named:
            problems.append(f"unknown enum number at {case.enum_path} answered {code.name}")
        elif not any(_is_path_suffix(case.enum_path, name) for name in named):
            problems.append(f"unknown enum number at {case.enum_path} named {named}")
    return problems


def _hex(data: bytes, limit: int = 96) -> str:
    if len(data) <= limit:
        return data.hex()
    return f"{data[:limit].hex()}... ({len(data)} bytes)"


#: What cygrpc logs when a servicer finishes a call that grpc core has already ended.
_CORE_ENDED_CALL = "ExecuteBatchError raised in core by servicer method"


def check_case(target: Target, method: Method, case: Case) -> list[str]:
    """Run one case, then the liveness calls; a line per problem found."""
    out = call_raw(target.channel, method, case.frames)
    problems = judge(target, method, case, out)
    for path, payload in target.liveness:
        ping: grpc.UnaryUnaryMultiCallable[bytes, bytes] = target.channel.unary_unary(
            path, None, None
        )
        try:
            ping(payload, timeout=CALL_TIMEOUT_S)
        except grpc.RpcError as e:
            problems.append(f"liveness {path} answered {e.code().name} afterwards")
    logged = target.logs.take()
    if (
        out.code == grpc.StatusCode.RESOURCE_EXHAUSTED
        and expected_code(method, case.frames, target.max_message_bytes)
        == grpc.StatusCode.RESOURCE_EXHAUSTED
    ):
        # grpc core itself refused an oversized frame and ended the call; a
        # streaming handler still finishing its previous reply then makes
        # cygrpc log this line. The client already has the right status.
        logged = [line for line in logged if _CORE_ENDED_CALL not in line]
    problems += [f"server logged {line}" for line in logged]
    if not problems:
        return []
    frames = " | ".join(_hex(f) for f in case.frames)
    return [
        f"{target.name} {method.path} [{case.label}] frames={frames}: {'; '.join(problems)} "
        f"(seen {out.code.name}: {out.details[:200]!r}, field {out.field!r})"
    ]


def run_cases(target: Target, method: Method, cases: Sequence[Case]) -> list[str]:
    """:func:`check_case` over ``cases``; every problem found."""
    problems: list[str] = []
    for case in cases:
        problems += check_case(target, method, case)
    return problems


# -- fixed cases ---------------------------------------------------------------


def undecodable_payloads() -> list[tuple[str, bytes]]:
    """Bytes no request type can decode, whatever its fields."""
    deep = tag(1000, SGROUP) * 200 + tag(1000, EGROUP) * 200
    return [
        ("ff ff ff", b"\xff\xff\xff"),
        ("truncated varint", tag(1, VARINT) + b"\xff\xff\xff"),
        ("varint of 11 bytes", tag(1, VARINT) + b"\xff" * 10 + b"\x01"),
        ("length past the end", tag(1, LEN) + varint(16) + b"abc"),
        ("huge length", tag(2, LEN) + varint(1 << 62)),
        ("truncated key", b"\x80"),
        ("field number 0", b"\x00\x01"),
        ("wire type 6", tag(1, 6) + b"\x00"),
        ("wire type 7", tag(1, 7) + b"\x00"),
        ("unterminated group", tag(1, SGROUP)),
        ("end group without start", tag(1, EGROUP)),
        ("truncated fixed64", tag(1, I64) + b"\x01\x02"),
        ("truncated fixed32", tag(1, I32) + b"\x01"),
        ("groups nested 200 deep", deep),
    ]


def undecodable_cases(method: Method) -> list[Case]:
    """:func:`undecodable_payloads`, plus a broken encoding of every field of the request,
    keeping only the bytes the protobuf runtime indeed refuses for this request type."""
    cases = [Case(label, (data,)) for label, data in undecodable_payloads()]
    for f in method.input.fields:
        n = f.number
        cases.append(Case(f"{f.name}: unterminated group", (tag(n, SGROUP) + b"\x08\x01",)))
        cases.append(Case(f"{f.name}: length past the end", (tag(n, LEN) + b"\x7f",)))
        if f.type == FieldDescriptor.TYPE_STRING:
            cases.append(Case(f"{f.name}: invalid UTF-8", (len_field(n, b"\xc3\x28"),)))
    return [c for c in cases if not method.decodes(c.frames[0])]


def oversized_case(method: Method, max_bytes: int) -> Case:
    """A decodable request (one unknown bytes field) just beyond the size limit."""
    pad = max_bytes + 1 - len(tag(2047, LEN)) - len(varint(max_bytes))
    data = tag(2047, LEN) + varint(pad) + b"\0" * pad
    while len(data) <= max_bytes:
        pad += 1
        data = tag(2047, LEN) + varint(pad) + b"\0" * pad
    return Case(f"{len(data)} bytes", (data,))


# -- adversarial values --------------------------------------------------------

#: Integers tried in every integer field (those out of the field's range are skipped).
_INTS = (0, -1, 1 << 31, (1 << 31) - 1, -(1 << 31), (1 << 32) - 1, (1 << 63) - 1, -(1 << 63),
         (1 << 64) - 1)  # fmt: skip
_FLOATS = (math.nan, math.inf, -math.inf, -0.0, -1.0, 1e308, 5e-324)
_STRINGS = (
    ("empty", ""),
    ("100 KB", "x" * 100_000),
    ("NUL", "\x00"),
    ("600 bytes of é", "é" * 300),
    ("emoji", "\U0001f600"),
    ("path", "../../../etc/passwd"),
    ("spaces", "  "),
)
_BYTES = (("empty", b""), ("100 KB", b"\xff" * 100_000))
#: Enum numbers no kvmesh enum declares.
UNKNOWN_ENUMS = (999, -1, (1 << 31) - 1, -(1 << 31))
#: Most elements of a huge repeated scalar field (building them is the cost).
_HUGE_REPEATED = 100_000
#: Wire bytes of one element of a huge repeated scalar field (packed varint 1,
#: fixed64, "a" with its key and length, fixed32).
_ELEMENT_BYTES = {VARINT: 1, I64: 8, LEN: 3, I32: 4}
#: Elements of a huge repeated message field.
_HUGE_MESSAGES = 5_000


def field_paths(desc: Descriptor, depth: int = 4) -> Iterator[tuple[FieldDescriptor, ...]]:
    """Every field reachable from ``desc`` (through singular and repeated messages, not maps)."""

    def walk(
        d: Descriptor, seen: tuple[str, ...], left: int
    ) -> Iterator[tuple[FieldDescriptor, ...]]:
        for f in d.fields:
            sub = f.message_type
            if sub is not None and sub.GetOptions().map_entry:
                continue
            yield (f,)
            if sub is not None and left > 1 and sub.full_name not in seen:
                for rest in walk(sub, (*seen, sub.full_name), left - 1):
                    yield (f, *rest)

    yield from walk(desc, (desc.full_name,), depth)


def path_text(path: Sequence[FieldDescriptor]) -> str:
    """``a.b[0].c``: the first element of every repeated parent."""
    parts = [
        f.name + ("[0]" if f.is_repeated and i < len(path) - 1 else "") for i, f in enumerate(path)
    ]
    return ".".join(parts)


def _parent(msg: Message, path: Sequence[FieldDescriptor]) -> Message:
    for f in path[:-1]:
        value = getattr(msg, f.name)
        if f.is_repeated and not len(value):
            value.add()
        msg = value[0] if f.is_repeated else value
    return msg


def _scalar_values(f: FieldDescriptor) -> list[tuple[str, Any, bool]]:
    """(label, value, is an unknown enum number) for one value of ``f``."""
    t = f.type
    if t == FieldDescriptor.TYPE_ENUM:
        assert f.enum_type is not None
        known = [(v.name, v.number, False) for v in f.enum_type.values]
        return known + [(f"enum {n}", n, True) for n in UNKNOWN_ENUMS]
    if t == FieldDescriptor.TYPE_BOOL:
        return [("true", True, False), ("false", False, False)]
    if t in (FieldDescriptor.TYPE_DOUBLE, FieldDescriptor.TYPE_FLOAT):
        return [(repr(v), v, False) for v in _FLOATS]
    if t == FieldDescriptor.TYPE_STRING:
        return [(label, v, False) for label, v in _STRINGS]
    if t == FieldDescriptor.TYPE_BYTES:
        return [(label, v, False) for label, v in _BYTES]
    return [(str(v), v, False) for v in _INTS]


def _set(msg: Message, path: Sequence[FieldDescriptor], value: Any) -> bool:
    """Set ``path`` in ``msg``; False when the message API refuses the value."""
    parent = _parent(msg, path)
    leaf = path[-1]
    try:
        if leaf.is_repeated:
            container = getattr(parent, leaf.name)
            del container[:]
            if leaf.message_type is not None:
                for item in value:
                    container.add().CopyFrom(item)
            else:
                container.extend(value)
        elif leaf.message_type is not None:
            sub = getattr(parent, leaf.name)
            sub.Clear()
            sub.SetInParent()
        else:
            setattr(parent, leaf.name, value)
    except (ValueError, TypeError, OverflowError):
        return False
    return True


def _api_mutations(
    seed: Message, path: tuple[FieldDescriptor, ...], max_bytes: int
) -> Iterator[tuple[str, Message, bool]]:
    leaf = path[-1]
    values: list[tuple[str, Any, bool]] = []
    if leaf.is_repeated and leaf.message_type is not None:
        probe = seed.__deepcopy__()
        existing = list(getattr(_parent(probe, path), leaf.name))
        element = existing[0] if existing else message_factory.GetMessageClass(leaf.message_type)()
        size = max(1, element.ByteSize() + 4)
        n = max(1, min(_HUGE_MESSAGES, (max_bytes // 2) // size))
        empty = message_factory.GetMessageClass(leaf.message_type)()
        values = [
            ("[]", [], False),
            ("[empty]", [empty], False),
            (f"{n} copies", [element] * n, False),
        ]
    elif leaf.is_repeated:
        singles = _scalar_values(leaf)
        # Most of the size limit: an answer that grows with the request must be capped.
        n = min(_HUGE_REPEATED, int(max_bytes * 0.8) // _ELEMENT_BYTES.get(wire_type_of(leaf), 1))
        typical: object = {
            FieldDescriptor.TYPE_STRING: "a",
            FieldDescriptor.TYPE_BYTES: b"a",
            FieldDescriptor.TYPE_BOOL: True,
        }.get(leaf.type, 1)
        values = [("[]", [], False), (f"{n} elements", [typical] * n, False)]
        values += [(f"[{label}]", [v], unknown) for label, v, unknown in singles]
    elif leaf.message_type is not None:
        values = [("empty message", None, False)]
    else:
        values = _scalar_values(leaf)
    for label, value, unknown_enum in values:
        msg = seed.__deepcopy__()
        if _set(msg, path, value):
            yield label, msg, unknown_enum


def _raw_leaves(f: FieldDescriptor) -> list[tuple[str, bytes]]:
    """Encodings of ``f`` the message API cannot write."""
    n = f.number
    out = [
        ("unterminated group", tag(n, SGROUP)),
        ("as fixed32", tag(n, I32) + b"\xff\xff\xff\xff"),
        ("as fixed64", tag(n, I64) + b"\xff" * 8),
    ]
    wt = wire_type_of(f)
    if wt != VARINT:
        out.append(("as varint", tag(n, VARINT) + varint(-1)))
    if wt != LEN:
        out.append(("as bytes", len_field(n, b"\xff\xfe\x00")))
    if wt == VARINT:
        out.append(("overlong varint", tag(n, VARINT) + b"\xff" * 9 + b"\x01"))
        out.append(("padded varint", tag(n, VARINT) + b"\x81\x80\x80\x80\x00"))
    if f.type == FieldDescriptor.TYPE_STRING:
        out.append(("invalid UTF-8", len_field(n, b"\xff\xfe\xfd")))
        out.append(("UTF-16 surrogate", len_field(n, b"\xed\xa0\x80")))
        out.append(("truncated UTF-8", len_field(n, "é".encode()[:1])))
    if f.message_type is not None:
        out.append(("garbage message", len_field(n, b"\xff\xff\xff")))
    if f.is_repeated and wt != LEN:
        out.append(("packed garbage", len_field(n, b"\xff")))
    return out


def mutations(method: Method, seed: Message, max_bytes: int) -> list[Case]:
    """``seed`` with one field at a time set to an adversarial value."""
    base = seed.SerializeToString()
    cases: list[Case] = []
    for path in field_paths(method.input):
        text = path_text(path)
        for label, msg, unknown_enum in _api_mutations(seed, path, max_bytes):
            cases.append(
                Case(f"{text}={label}", (msg.SerializeToString(),), text if unknown_enum else "")
            )
        for label, leaf in _raw_leaves(path[-1]):
            cases.append(Case(f"{text}: {label}", (base + nest(path, leaf),)))
    return cases


def stream_cases(method: Method, good: Sequence[bytes], singles: Sequence[Case]) -> list[Case]:
    """For a client-streaming method: every single-frame case between good frames."""
    g = good[0]
    cases = [Case(f"good, {c.label}, good", (g, *c.frames, g), c.enum_path) for c in singles]
    cases.append(Case("50 good frames", tuple(good[i % len(good)] for i in range(50))))
    return cases


# -- Hypothesis strategies -----------------------------------------------------


def _value_strategy(f: FieldDescriptor, depth: int) -> st.SearchStrategy[bytes]:
    """One encoded occurrence of ``f``, mostly well-formed."""
    n = f.number
    wt = wire_type_of(f)
    sub = f.message_type
    if sub is not None:
        inner = st.deferred(lambda: wire_messages(sub, depth - 1)) if depth > 0 else st.just(b"")
        return inner.map(lambda b: len_field(n, b))
    if wt == LEN:
        text = st.text(max_size=40).map(lambda s: s.encode("utf-8"))
        return st.one_of(text, st.binary(max_size=40)).map(lambda b: len_field(n, b))
    if wt == I64:
        return st.binary(min_size=8, max_size=8).map(lambda b: tag(n, I64) + b)
    if wt == I32:
        return st.binary(min_size=4, max_size=4).map(lambda b: tag(n, I32) + b)
    ints = st.one_of(st.sampled_from(_INTS + UNKNOWN_ENUMS), st.integers(-(1 << 63), (1 << 64) - 1))
    single = ints.map(lambda v: tag(n, VARINT) + varint(v))
    if f.is_repeated:
        packed = st.lists(ints, max_size=20).map(lambda vs: len_field(n, b"".join(map(varint, vs))))
        return st.one_of(single, packed)
    return single


def wire_messages(desc: Descriptor, depth: int = 3) -> st.SearchStrategy[bytes]:
    """Random encodings of ``desc``: its fields with random values, sometimes with the
    wrong wire type, plus unknown fields."""
    known = [_value_strategy(f, depth) for f in desc.fields]
    numbers = [f.number for f in desc.fields] or [1]
    wrong = st.tuples(st.sampled_from(numbers), st.sampled_from((VARINT, I64, LEN, I32))).map(
        lambda nt: (
            tag(nt[0], nt[1])
            + {VARINT: b"\x01", I64: b"\0" * 8, LEN: b"\x01x", I32: b"\0" * 4}[nt[1]]
        )
    )
    unknown = (
        st.integers(1, (1 << 29) - 1)
        .filter(lambda n: not 19000 <= n <= 19999)
        .map(lambda n: len_field(n, b"?"))
    )
    part = st.one_of(*known, wrong, unknown) if known else st.one_of(wrong, unknown)
    return st.lists(part, max_size=8).map(b"".join)
