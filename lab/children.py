"""Child processes of the lab: start one, wait until it is ready, talk in lines, stop it.

Every process the lab starts (a benchmark's server or client, a test sink, a
transfer sidecar, a redis-server, each service of ``kvmesh up``) is a
:class:`ChildProcess`, and they all follow one protocol:

- **start**: the command (:func:`python_module` for ``python -m module args``)
  runs in a session and process group of its own, so a Ctrl-C in the terminal
  reaches only the parent, which stops its children in order, and a signal to
  the group also reaches anything the child spawned. With ``die_with_parent``
  the kernel SIGTERMs the child when the parent dies, even by SIGKILL
  (Linux ``PR_SET_PDEATHSIG``), so a killed parent leaves no orphans.
- **ready**: the child prints a ``READY [payload]`` line on stdout
  (:meth:`ChildProcess.wait_line`), or a probe of the parent's says so
  (:meth:`ChildProcess.wait_ready`, :meth:`ChildProcess.wait_ready_async`),
  within a timeout. A child that exits first fails at once
  (:class:`ChildExited`, with the last lines of its log); one that is too slow
  fails with :class:`ChildNotReady`.
- **talk**: :meth:`ChildProcess.send_line` and :meth:`ChildProcess.read_line`
  (with a timeout) for children that take commands or report results.
- **stop**: :func:`stop_all` closes the children's stdin and sends SIGTERM to
  their process groups at once, waits up to a grace period, then SIGKILLs
  what is left, and anything a child that exited left in its group.

A child written in Python announces itself with :func:`announce_ready` and
waits with :func:`until_stopped` (asyncio) or :func:`until_stopped_sync`,
both of which return when the parent closes stdin or sends SIGTERM.
"""

from __future__ import annotations

import asyncio
import contextlib
import os
import select
import shutil
import signal
import subprocess
import sys
import threading
import time
from collections.abc import Awaitable, Callable, Iterable, Mapping, Sequence
from dataclasses import dataclass
from pathlib import Path
from types import TracebackType
from typing import IO, Any, Protocol, TypeVar

from kvmesh.runtime import new_event_loop

#: The line (first word) a ready child prints on stdout; a payload may follow.
READY = "READY"

#: Seconds a child gets to become ready unless its caller says otherwise: a
#: Python child imports grpc, the services and their dependencies first, which
#: takes several seconds on a loaded 2-core machine.
START_TIMEOUT_S = 60.0

#: Seconds a child gets to exit after SIGTERM before SIGKILL: long enough for a
#: server to drain its calls and close its listeners, short enough not to hold
#: up a test run when a child hangs.
STOP_GRACE_S = 10.0

#: Seconds between two readiness probes: fast enough that waiting adds little
#: to a start, slow enough that probing takes no noticeable CPU.
PROBE_INTERVAL_S = 0.02

#: Bytes read from the end of a log for an error message or a tail.
_LOG_READ_BYTES = 64 * 1024

#: Runs in a tiny interpreter before a ``die_with_parent`` child: ask the
#: kernel to SIGTERM the child when the parent dies (even by SIGKILL), give up
#: if the parent already died, then exec the real command. Done here rather
#: than in ``preexec_fn``, which is unsafe once the parent runs grpc threads.
_LAUNCHER = (
    "import ctypes, os, sys\n"
    "ctypes.CDLL(None, use_errno=True).prctl(1, 15)\n"  # PR_SET_PDEATHSIG, SIGTERM
    "if os.getppid() != int(sys.argv[1]):\n"
    "    os._exit(1)\n"
    "os.execv(sys.argv[2], sys.argv[2:])\n"
)


class ChildExited(RuntimeError):
    """The child ended before it was ready, or before it answered."""


class ChildNotReady(TimeoutError):
    """The child did not become ready, or did not answer, in time."""


def child_env(env: Mapping[str, str] | None) -> dict[str, str]:
    """The whole environment to start a child with: ``env``, or a copy of this
    process's taken now.

    Never start a child on the live environment (Popen's ``env=None``): CPython
    starts children with vfork, and the child then execs with the C ``environ``
    array, which a ``putenv`` on another thread (``os.environ[...] = ...``,
    pytest's ``setenv``) may reallocate and free meanwhile; the exec fails with
    EFAULT ("Bad address"). Popen builds a given environment in the parent
    before it forks, so a copy is safe whatever other threads do.
    """
    return dict(os.environ if env is None else env)


def python_module(module: str, *args: str) -> list[str]:
    """The command line of ``python -m module args`` with this interpreter."""
    return [sys.executable, "-m", module, *args]


class Spawn(Protocol):
    """Starts a child instead of ``subprocess.Popen`` (:class:`ChildProcess` ``spawn``).

    Called with the command, ``stdin``, ``stdout`` and ``stderr`` as Popen takes
    them and the child's whole environment (None: this process's); returns a
    Popen of the running child, in a session and process group of its own
    (its pid is the group's id). A fork server
    (``lab/engines/zygote.py``'s ``Zygote.spawn``) is one.
    """

    def __call__(
        self,
        argv: Sequence[str],
        *,
        stdin: int | IO[Any] | None,
        stdout: int | IO[Any] | None,
        stderr: int | IO[Any] | None,
        env: Mapping[str, str] | None,
    ) -> subprocess.Popen[bytes]: ...


class ChildProcess:
    """One child process (see the module docstring); a context manager that stops it.

    ``pipes``: the child's stdin and stdout are pipes to this process (for
    READY lines, commands and replies); otherwise stdin is ``/dev/null`` and
    stdout goes where stderr goes. ``log_path``: stderr (and stdout without
    ``pipes``) is appended to this file, across restarts; otherwise both are
    inherited. ``env``: the child's whole environment (default: this
    process's). ``die_with_parent`` (Linux): the child is SIGTERMed when the
    thread that started it ends, so start such children on the main thread.
    ``spawn``: what starts the child instead of ``subprocess.Popen`` (see
    :class:`Spawn`); the command is given as it is, and dying with the parent
    is then the spawner's to arrange.

    :meth:`start` may be called again after the child ended (a restart).
    """

    def __init__(
        self,
        argv: Sequence[str],
        *,
        name: str = "",
        env: Mapping[str, str] | None = None,
        log_path: str | Path | None = None,
        pipes: bool = False,
        die_with_parent: bool = False,
        spawn: Spawn | None = None,
    ) -> None:
        self.argv = list(argv)
        self.name = name or Path(self.argv[0]).name
        self.env = dict(env) if env is not None else None
        self.log_path = Path(log_path) if log_path is not None else None
        self.pipes = pipes
        self.die_with_parent = die_with_parent
        self.spawn = spawn
        #: Set once this process stopped or killed the child: an exit before
        #: that is a failure.
        self.stopping = False
        self._proc: subprocess.Popen[bytes] | None = None
        self._buf = b""
        self._eof = False

    # -- state -----------------------------------------------------------------

    @property
    def proc(self) -> subprocess.Popen[bytes]:
        """The running (or last) process; :meth:`start` must have been called."""
        if self._proc is None:
            raise RuntimeError(f"{self.name} was never started")
        return self._proc

    @property
    def started(self) -> bool:
        """Whether :meth:`start` was called."""
        return self._proc is not None

    @property
    def pid(self) -> int | None:
        """The child's pid (also its process group id); None before :meth:`start`."""
        return self._proc.pid if self._proc is not None else None

    def alive(self) -> bool:
        """Whether the child runs."""
        return self._proc is not None and self._proc.poll() is None

    def exit_code(self) -> int | None:
        """The exit code once the child ended (negative: killed by that signal)."""
        return None if self._proc is None else self._proc.poll()

    # -- start -----------------------------------------------------------------

    def start(self) -> ChildProcess:
        """Start the child (it is not ready yet: wait for that); return self."""
        if self.alive():
            raise RuntimeError(f"{self.name} is already running")
        self._close_pipes()
        cmd = list(self.argv)
        if self.die_with_parent and sys.platform == "linux" and self.spawn is None:
            exe = cmd[0] if os.path.isabs(cmd[0]) else shutil.which(cmd[0]) or cmd[0]
            cmd = [sys.executable, "-I", "-S", "-c", _LAUNCHER, str(os.getpid()), exe, *cmd[1:]]
        log: IO[bytes] | None = None
        if self.log_path is not None:
            log = open(self.log_path, "ab")  # noqa: SIM115 - the child holds its own copy
        # Pipes: commands in, lines out, stderr to the log. Otherwise stdout and
        # stderr both go to the log (or are inherited without one).
        stdin = subprocess.PIPE if self.pipes else subprocess.DEVNULL
        stdout: int | IO[bytes] | None = subprocess.PIPE if self.pipes else log
        stderr: int | IO[bytes] | None = log
        if not self.pipes and log is not None:
            stderr = subprocess.STDOUT
        try:
            if self.spawn is not None:
                self._proc = self.spawn(
                    cmd, stdin=stdin, stdout=stdout, stderr=stderr, env=self.env
                )
            else:
                self._proc = subprocess.Popen(
                    cmd,
                    stdin=stdin,
                    stdout=stdout,
                    stderr=stderr,
                    env=child_env(self.env),
                    start_new_session=True,
                    bufsize=0,
                )
        finally:
            if log is not None:
                log.close()
        self.stopping = False
        self._buf = b""
        self._eof = False
        return self

    # -- readiness ----------------------------------------------------------------

    def wait_line(self, timeout_s: float = START_TIMEOUT_S, word: str = READY) -> str:
        """Wait for a ``READY [payload]`` line (first word ``word``); return the payload.

        Other lines before it are skipped (and shown if the wait fails).
        """
        deadline = time.monotonic() + timeout_s
        skipped: list[str] = []
        while True:
            try:
                line = self.read_line(max(0.0, deadline - time.monotonic()))
            except (ChildExited, ChildNotReady) as e:
                if skipped:
                    raise type(e)(f"{e}\nit printed:\n" + "\n".join(skipped[-15:])) from None
                raise
            first, _, payload = line.strip().partition(" ")
            if first == word:
                return payload.strip()
            skipped.append(line)

    def wait_ready(
        self,
        probe: Callable[[], bool],
        timeout_s: float = START_TIMEOUT_S,
        interval_s: float = PROBE_INTERVAL_S,
    ) -> None:
        """Call ``probe()`` until it is true (an exception counts as not yet).

        Raises :class:`ChildExited` when the child ends first and
        :class:`ChildNotReady` after ``timeout_s``.
        """
        deadline = time.monotonic() + timeout_s
        while True:
            if not self.alive():
                raise self.exited("while starting")
            with contextlib.suppress(Exception):
                if probe():
                    return
            if time.monotonic() > deadline:
                raise self.not_ready(f"not ready after {timeout_s:.0f} s")
            time.sleep(interval_s)

    async def wait_ready_async(
        self,
        probe: Callable[[], Awaitable[bool]],
        timeout_s: float = START_TIMEOUT_S,
        *,
        interval_s: float = PROBE_INTERVAL_S,
        stop: asyncio.Event | None = None,
    ) -> None:
        """:meth:`wait_ready` for an async ``probe``; ``stop`` set cancels the wait."""
        deadline = time.monotonic() + timeout_s
        while True:
            if not self.alive():
                raise self.exited("while starting")
            if stop is not None and stop.is_set():
                raise asyncio.CancelledError
            with contextlib.suppress(Exception):
                if await probe():
                    return
            if time.monotonic() > deadline:
                raise self.not_ready(f"not ready after {timeout_s:.0f} s")
            await asyncio.sleep(interval_s)

    def exited(self, when: str) -> ChildExited:
        """The error of a child that ended ``when`` (exit code and log tail in the message)."""
        return ChildExited(
            f"{self.name} exited with code {self.exit_code()} {when}{self._log_note()}"
        )

    def not_ready(self, what: str) -> ChildNotReady:
        """The error of a child that is too slow (log tail in the message)."""
        return ChildNotReady(f"{self.name} {what}{self._log_note()}")

    def _log_note(self) -> str:
        if self.log_path is None:
            return ""
        return f"; last lines of {self.log_path}:\n{self.log_tail()}"

    # -- talking ------------------------------------------------------------------

    def read_line(self, timeout_s: float = START_TIMEOUT_S) -> str:
        """The next line the child prints on stdout, without its newline (``pipes`` only)."""
        stdout = self.proc.stdout
        if stdout is None:
            raise RuntimeError(f"{self.name} has no stdout pipe")
        deadline = time.monotonic() + timeout_s
        while b"\n" not in self._buf:
            if self._eof:
                if self._buf:  # a last line without a newline
                    line, self._buf = self._buf, b""
                    return line.decode(errors="replace")
                with contextlib.suppress(subprocess.TimeoutExpired):
                    self.proc.wait(1.0)  # for the exit code in the message
                raise self.exited("before printing a line")
            remaining = deadline - time.monotonic()
            if remaining <= 0:
                raise self.not_ready(f"printed no line within {timeout_s:.0f} s")
            readable, _, _ = select.select([stdout], [], [], remaining)
            if readable:
                chunk = os.read(stdout.fileno(), 65536)
                self._eof = not chunk
                self._buf += chunk
        line, _, self._buf = self._buf.partition(b"\n")
        return line.decode(errors="replace").rstrip("\r")

    def send_line(self, text: str) -> None:
        """Write one line to the child's stdin (``pipes`` only)."""
        stdin = self.proc.stdin
        if stdin is None or stdin.closed:
            raise RuntimeError(f"{self.name} has no open stdin")
        try:
            stdin.write(text.encode() + b"\n")
        except BrokenPipeError:
            raise self.exited("before reading its input") from None

    def close_stdin(self) -> None:
        """Close the child's stdin (a Python child's cue to finish)."""
        stdin = self._proc.stdin if self._proc is not None else None
        if stdin is not None and not stdin.closed:
            with contextlib.suppress(OSError):
                stdin.close()

    # -- stopping -----------------------------------------------------------------

    def signal_group(self, sig: int) -> None:
        """Send ``sig`` to the child's process group (gone already: nothing to do)."""
        if self._proc is not None:
            with contextlib.suppress(ProcessLookupError, PermissionError):
                os.killpg(self._proc.pid, sig)

    def stop(self, grace_s: float = STOP_GRACE_S) -> None:
        """Stop the child (see :func:`stop_all`)."""
        stop_all([self], grace_s)

    def kill(self) -> None:
        """SIGKILL the child's process group, as a crash would, and reap it."""
        if self._proc is None:
            return
        self.stopping = True
        if self._proc.poll() is None:
            self.signal_group(signal.SIGKILL)
            self._proc.wait()
        self._close_pipes()

    def _close_pipes(self) -> None:
        if self._proc is None:
            return
        for f in (self._proc.stdin, self._proc.stdout):
            if f is not None:
                with contextlib.suppress(OSError):
                    f.close()

    def __enter__(self) -> ChildProcess:
        return self.start()

    def __exit__(
        self, t: type[BaseException] | None, v: BaseException | None, tb: TracebackType | None
    ) -> None:
        self.stop()

    # -- what the child uses ------------------------------------------------------

    def log_text(self, max_bytes: int = 4096) -> str:
        """The last ``max_bytes`` of the child's log ("" without a log)."""
        if self.log_path is None:
            return ""
        try:
            with open(self.log_path, "rb") as f:
                f.seek(max(0, f.seek(0, os.SEEK_END) - max_bytes))
                return f.read().decode(errors="replace")
        except OSError:
            return ""

    def log_tail(self, lines: int = 15) -> str:
        """The last ``lines`` lines of the child's log."""
        return "\n".join(self.log_text(_LOG_READ_BYTES).splitlines()[-lines:])

    def cpu_seconds(self) -> float | None:
        """CPU time (user + system, every thread) the child used so far; None off Linux."""
        t = self.proc_times()
        return None if t is None else t.user_s + t.system_s

    def proc_times(self) -> ProcTimes | None:
        """The child's CPU time, split, and its page faults so far; None off Linux."""
        return proc_times(self.pid) if self.pid is not None else None

    def rss_mb(self) -> float | None:
        """Resident set size of the running child in MB (None when not running or off Linux)."""
        if not self.alive():
            return None
        try:
            for line in Path(f"/proc/{self.pid}/status").read_text().splitlines():
                if line.startswith("VmRSS:"):
                    return int(line.split()[1]) / 1024
        except OSError:
            return None
        return None


@dataclass(frozen=True, slots=True)
class ProcTimes:
    """What a process has used so far, every thread (``/proc/<pid>/stat``)."""

    #: CPU seconds in the process's own code, and in the kernel on its behalf
    #: (system calls, and page faults: the kernel zeroes every page a process
    #: touches for the first time).
    user_s: float
    system_s: float
    #: Page faults served without I/O: mostly first touches of memory.
    minor_faults: int

    def __sub__(self, before: ProcTimes) -> ProcTimes:
        return ProcTimes(
            self.user_s - before.user_s,
            self.system_s - before.system_s,
            self.minor_faults - before.minor_faults,
        )


def proc_times(pid: int) -> ProcTimes | None:
    """:class:`ProcTimes` of process ``pid``; None when it is gone or off Linux."""
    try:
        stat = Path(f"/proc/{pid}/stat").read_text()
    except OSError:
        return None
    fields = stat.rsplit(")", 1)[1].split()  # after the command name, which may hold spaces
    tick = os.sysconf("SC_CLK_TCK")
    return ProcTimes(int(fields[11]) / tick, int(fields[12]) / tick, int(fields[7]))


def group_members(pgid: int) -> list[int]:
    """Pids of live processes in process group ``pgid`` (Linux /proc; empty elsewhere)."""
    out: list[int] = []
    proc = Path("/proc")
    if not proc.is_dir():
        return out
    for entry in proc.iterdir():
        if not entry.name.isdigit():
            continue
        try:
            stat = (entry / "stat").read_text()
        except OSError:
            continue
        # Fields after the parenthesised command: state ppid pgrp ...
        fields = stat[stat.rfind(")") + 2 :].split()
        if len(fields) > 2 and int(fields[2]) == pgid and fields[0] != "Z":
            out.append(int(entry.name))
    return out


def stop_all(children: Iterable[ChildProcess], grace_s: float = STOP_GRACE_S) -> None:
    """Stop children together: stdin closed and SIGTERM to every group at once, then
    up to ``grace_s`` for all of them, then SIGKILL to what is left (and to anything
    a child that exited left in its group)."""
    started = [c for c in children if c.started]
    for c in started:
        c.stopping = True
        c.close_stdin()
        if c.alive():
            c.signal_group(signal.SIGTERM)
    deadline = time.monotonic() + grace_s
    for c in started:
        with contextlib.suppress(subprocess.TimeoutExpired):
            c.proc.wait(max(0.0, deadline - time.monotonic()))
    for c in started:
        if c.alive():
            c.signal_group(signal.SIGKILL)
            c.proc.wait()
        elif group_members(c.proc.pid):
            c.signal_group(signal.SIGKILL)
        c._close_pipes()


# -- the child's side ---------------------------------------------------------------


def announce_ready(payload: object = "") -> None:
    """In a child: tell the parent it is ready (``READY payload`` on stdout)."""
    print(f"{READY} {payload}".rstrip(), flush=True)


def _watch_stdin(on_eof: Callable[[], None]) -> None:
    """Call ``on_eof()`` from a daemon thread once stdin ends (the parent closed it)."""

    def read() -> None:
        with contextlib.suppress(OSError, ValueError):
            while sys.stdin.buffer.read(65536):
                pass
        on_eof()

    threading.Thread(target=read, name="stdin-watch", daemon=True).start()


async def until_stopped() -> None:
    """In a child's event loop: return when the parent closes stdin or sends SIGTERM."""
    loop = asyncio.get_running_loop()
    stop = asyncio.Event()
    loop.add_signal_handler(signal.SIGTERM, stop.set)

    def on_eof() -> None:
        with contextlib.suppress(RuntimeError):  # the loop closed already
            loop.call_soon_threadsafe(stop.set)

    _watch_stdin(on_eof)
    await stop.wait()


def until_stopped_sync() -> None:
    """:func:`until_stopped` for a child without an event loop (main thread only)."""
    eof = threading.Event()
    terminated = False

    def on_term(signum: int, frame: object) -> None:
        # Only a flag: a handler must not take the locks the main thread may hold.
        nonlocal terminated
        terminated = True

    signal.signal(signal.SIGTERM, on_term)
    _watch_stdin(eof.set)
    while not terminated and not eof.wait(0.1):
        pass


class Serving(Protocol):
    """A server a child runs: the port it listens on."""

    @property
    def port(self) -> int:
        """The bound port, announced to the parent."""


_S = TypeVar("_S", bound=Serving)


def serve_until_told(
    start: Callable[[], Awaitable[_S]], stop: Callable[[_S], Awaitable[object]]
) -> int:
    """In a child: start a server, announce its port, serve until stopped, stop it; exit 0."""

    async def run() -> None:
        server = await start()
        announce_ready(server.port)
        await until_stopped()
        await stop(server)

    with asyncio.Runner(loop_factory=new_event_loop) as runner:
        runner.run(run())
    return 0
