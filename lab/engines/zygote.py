"""A fork server for engine programs: import an engine once, fork an engine per request.

Importing vLLM or SGLang (torch, transformers, the engine's own modules) takes
most of an engine process's start. A zygote is one process, run with the
engine's interpreter, that imports the engine program once and then, per
request, forks a child that runs the program's ``main(argv)`` as ``python -m
module argv`` would, from a process whose imports are already done. Standard
library only, like every program here: the harness side (:class:`Zygote`)
runs in kvmesh's interpreter, the server side (:func:`main`) in the engine's.

The harness keeps ordinary pipes to each child: it makes the child's stdin,
stdout and stderr itself and passes them with the request (``SCM_RIGHTS``
over a ``SOCK_SEQPACKET`` socket pair, one message per request), with one more
socket on which the zygote answers the child's pid and, once the zygote has
reaped it, its exit code. :class:`ForkedProcess` is a ``subprocess.Popen``
over those: ``poll``, ``wait`` and ``send_signal`` behave as for a child the
harness had started itself.

A forked child is what ``subprocess.Popen(..., start_new_session=True)``
would start: a session and process group of its own (a signal to the group
reaches it and whatever it spawns), the harness's environment and working
directory of the request, stdio on the passed descriptors, and none of the
zygote's own descriptors; what the imports made is frozen out of the
garbage collector's generations (``gc.freeze``). It dies with the zygote (Linux
``PR_SET_PDEATHSIG``: SIGTERM), and the zygote dies with the harness: when the
harness closes the control socket, or its process ends however it ends, the
zygote SIGTERMs every child's group, SIGKILLs what is left after a grace
period, and exits.

Forking after the imports is safe only without other threads, whose locks a
child would inherit held: the zygote reports the threads it has (Python's and
the kernel's count) when it is ready. Importing vLLM or SGLang starts none of
Python's; the one native thread is OpenBLAS's worker (numpy), which OpenBLAS
itself shuts down around ``fork`` (its ``pthread_atfork`` handlers). Python
reseeds ``random`` in a forked child; the engines seed what they draw from
``--seed`` anyway. What differs from a fresh interpreter: environment
variables a module reads at import come from the zygote's start (the first
request's environment); the child's ``os.environ`` is the request's, with
what the imports themselves set kept where the request does not differ from
the zygote's start.

Server: ``python -m lab.engines.zygote MODULE --control-fd FD`` (FD: this
process's end of the control socket pair); :class:`Zygote` starts it.
"""

from __future__ import annotations

import argparse
import contextlib
import ctypes
import gc
import importlib
import json
import os
import select
import signal
import socket
import subprocess
import sys
import threading
import time
from collections import deque
from collections.abc import Mapping, Sequence
from dataclasses import dataclass
from pathlib import Path
from typing import IO, Any

#: Bytes of one control message: a request's argv and environment as JSON (a
#: few KB; an environment of hundreds of variables still fits).
MESSAGE_BYTES = 1 << 20
#: Descriptors passed with a request: the reply socket, stdin, stdout, stderr.
REQUEST_FDS = 4
#: Seconds the zygote gives its children after SIGTERM, when it ends, before
#: SIGKILL: an engine stops at once on SIGTERM; the margin is for a loaded
#: machine.
CHILD_GRACE_S = 5.0
#: Seconds the harness waits for the zygote to answer a request with the
#: child's pid: a fork of a process of 1-2 GB takes tens of milliseconds.
SPAWN_TIMEOUT_S = 60.0
#: The exit code :class:`ForkedProcess` reports for a child whose zygote ended
#: before reporting it (the child is then SIGTERMed by the kernel, see above).
LOST = 255
#: Linux ``prctl`` option: the signal the kernel sends when the parent dies.
_PR_SET_PDEATHSIG = 1


class ZygoteError(RuntimeError):
    """The zygote did not start, ended, or refused a request."""


# -- the server (the engine's interpreter) -----------------------------------------


@dataclass(frozen=True, slots=True)
class Request:
    """What a forked child runs: the program's arguments (after ``-m module``)."""

    args: list[str]


def _set_env(env: Mapping[str, str], start: Mapping[str, str]) -> None:
    """Make ``os.environ`` the request's ``env``, keeping what the imports set where
    the request does not differ from the zygote's ``start``."""
    for name in set(start) - set(env):
        os.environ.pop(name, None)
    for name, value in env.items():
        if start.get(name) != value:
            os.environ[name] = value


def _tasks() -> int:
    """Threads of this process as the kernel counts them (Linux; 0 elsewhere)."""
    try:
        return len(os.listdir("/proc/self/task"))
    except OSError:
        return 0


class _Server:
    """The zygote's loop: fork a child per request, report pids and exit codes."""

    def __init__(self, control: socket.socket, start_env: Mapping[str, str]) -> None:
        self.control = control
        self.start_env = dict(start_env)
        self.pid = os.getpid()
        #: pidfd -> (pid, reply socket) of every child not reaped yet.
        self.children: dict[int, tuple[int, socket.socket]] = {}
        self.libc = ctypes.CDLL(None, use_errno=True)

    def serve(self) -> Request | None:
        """Serve until the control socket closes (None), or return a forked child's request."""
        while True:
            readable, _, _ = select.select([self.control.fileno(), *self.children], [], [])
            for fd in readable:
                if fd in self.children:
                    self._reap(fd)
            if self.control.fileno() in readable:
                try:
                    msg, fds, _, _ = socket.recv_fds(self.control, MESSAGE_BYTES, REQUEST_FDS)
                except OSError:
                    msg, fds = b"", []
                if not msg:
                    for fd in fds:
                        os.close(fd)
                    self._stop_children()
                    return None
                request = self._fork(json.loads(msg), fds)
                if request is not None:
                    return request

    def _fork(self, req: dict[str, Any], fds: list[int]) -> Request | None:
        if len(fds) != REQUEST_FDS:
            for fd in fds:
                os.close(fd)
            return None
        reply = socket.socket(fileno=fds[0])
        stdio = fds[1:]
        if threading.active_count() > 1:  # nothing of the zygote's starts one: an import did
            names = [t.name for t in threading.enumerate()]
            print(f"zygote: forking with threads {names}", file=sys.stderr)
        # Nothing buffered in this process may reach a child's descriptors.
        sys.stdout.flush()
        sys.stderr.flush()
        pid = os.fork()
        if pid == 0:
            return self._become_child(req, reply, stdio)
        for fd in set(stdio):
            os.close(fd)
        pidfd = os.pidfd_open(pid)  # a zombie still has one: nobody else reaps it
        self.children[pidfd] = (pid, reply)
        with contextlib.suppress(OSError):
            reply.send(json.dumps({"pid": pid}).encode())
        return None

    def _become_child(self, req: dict[str, Any], reply: socket.socket, stdio: list[int]) -> Request:
        """In the forked child: a fresh session, the request's stdio, environment and
        directory, none of the zygote's descriptors, death with the zygote."""
        try:
            reply.close()
            self.control.close()
            for pidfd, (_, other) in self.children.items():
                os.close(pidfd)
                other.close()
            self.children = {}
            os.setsid()
            self.libc.prctl(_PR_SET_PDEATHSIG, signal.SIGTERM)
            if os.getppid() != self.pid:  # the zygote died before the prctl
                os._exit(1)
            for target, fd in enumerate(stdio):
                os.dup2(fd, target)
            for fd in set(stdio):
                if fd > 2:
                    os.close(fd)
            _set_env(req["env"], self.start_env)
            os.chdir(req["cwd"])
        except BaseException:  # never let a child return into the zygote's loop
            with contextlib.suppress(BaseException):
                import traceback

                traceback.print_exc()
            os._exit(1)
        return Request([str(a) for a in req["args"]])

    def _reap(self, pidfd: int) -> None:
        pid, reply = self.children.pop(pidfd)
        os.close(pidfd)
        _, status = os.waitpid(pid, 0)
        with contextlib.suppress(OSError):
            reply.send(json.dumps({"exit": os.waitstatus_to_exitcode(status)}).encode())
        reply.close()

    def _stop_children(self) -> None:
        """The harness is gone: SIGTERM every child's group, SIGKILL what is left, reap."""
        for pid, _ in self.children.values():
            with contextlib.suppress(OSError):
                os.killpg(pid, signal.SIGTERM)
        deadline = time.monotonic() + CHILD_GRACE_S
        killed = False
        while self.children:
            remaining = deadline - time.monotonic()
            if remaining <= 0 and not killed:
                for pid, _ in self.children.values():
                    with contextlib.suppress(OSError):
                        os.killpg(pid, signal.SIGKILL)
                killed = True
            timeout = None if killed else max(0.0, remaining)
            readable, _, _ = select.select(list(self.children), [], [], timeout)
            for fd in readable:
                self._reap(fd)


def main(argv: Sequence[str] | None = None) -> int:
    """Import the engine program, serve requests; in a forked child, run the program."""
    p = argparse.ArgumentParser(prog="python -m lab.engines.zygote", description=__doc__)
    p.add_argument("module", help="the engine program, as for python -m")
    p.add_argument("--control-fd", type=int, required=True, help="this end of the control pair")
    args = p.parse_args(argv)
    control = socket.socket(fileno=args.control_fd)
    start_env = dict(os.environ)
    module = importlib.import_module(args.module)
    if not callable(getattr(module, "main", None)):
        raise SystemExit(f"{args.module} has no main(argv)")
    # What the imports made stays as it is in every child: out of the
    # collector's reach, a child's collections neither scan it nor copy its
    # pages (the gc module's advice for a process that forks workers).
    gc.collect()
    gc.freeze()
    threads = [t.name for t in threading.enumerate()]
    control.send(json.dumps({"ready": os.getpid(), "threads": threads, "tasks": _tasks()}).encode())
    request = _Server(control, start_env).serve()
    if request is None:
        return 0
    # The forked child: the program's main as ``python -m module args`` runs it.
    sys.argv = [str(getattr(module, "__file__", args.module)), *request.args]
    code: int = module.main(request.args)
    return code


# -- the harness's side (kvmesh's interpreter) --------------------------------------

#: What ``subprocess.Popen`` takes for a child's stdin, stdout or stderr.
Stdio = int | IO[Any] | None


class ForkedProcess(subprocess.Popen[bytes]):
    """A child a zygote forked, as a ``subprocess.Popen``: ``pid``, ``stdin`` and
    ``stdout`` (pipes when asked), ``poll``, ``wait`` and ``send_signal``.

    The exit code is the one the zygote reports once it reaped the child
    (negative: killed by that signal), or :data:`LOST` if the zygote ended
    first. ``communicate`` is not supported.
    """

    def __init__(
        self,
        args: list[str],
        pid: int,
        reply: socket.socket,
        stdin: IO[bytes] | None,
        stdout: IO[bytes] | None,
    ) -> None:
        # Not Popen.__init__, which would start a process: only what its other
        # methods (``__repr__``, ``__exit__``, ``__del__``, ``kill``) read.
        self.args = args
        self.pid = pid
        self.stdin = stdin
        self.stdout = stdout
        self.stderr = None
        self.returncode: int | None = None
        self.text_mode = False
        self.universal_newlines = False
        self._child_created = False  # Popen.__del__: nothing of this process's to reap
        self._reply = reply
        self._reply_open = True
        self._lock = threading.Lock()
        try:
            self._pidfd: int | None = os.pidfd_open(pid)
        except OSError:  # it exited and was reaped already: the reply says so
            self._pidfd = None

    def _read_reply(self, timeout_s: float | None) -> None:
        """Read the zygote's report if one comes within ``timeout_s`` (None: forever)."""
        waits: list[socket.socket | int] = [self._reply] if self._reply_open else []
        if not waits and self._pidfd is not None:
            waits = [self._pidfd]
        if not waits:
            self.returncode = LOST
            return
        readable, _, _ = select.select(waits, [], [], timeout_s)
        if not readable:
            return
        if not self._reply_open:  # the zygote ended and now so did the child
            self.returncode = LOST
            return
        try:
            msg = self._reply.recv(4096)
        except OSError:
            msg = b""
        if msg:
            self.returncode = int(json.loads(msg)["exit"])
        else:
            self._reply_open = False
            return
        self._release()

    def _release(self) -> None:
        self._reply.close()
        self._reply_open = False
        if self._pidfd is not None:
            os.close(self._pidfd)
            self._pidfd = None

    def poll(self) -> int | None:
        """The exit code, or None while the child runs."""
        with self._lock:
            if self.returncode is None:
                self._read_reply(0)
            return self.returncode

    def wait(self, timeout: float | None = None) -> int:
        """Wait for the child to end; raise ``subprocess.TimeoutExpired`` after ``timeout``."""
        deadline = None if timeout is None else time.monotonic() + timeout
        with self._lock:
            while self.returncode is None:
                remaining = None if deadline is None else deadline - time.monotonic()
                if remaining is not None and remaining <= 0:
                    raise subprocess.TimeoutExpired(self.args, timeout or 0.0)
                self._read_reply(remaining)
            return self.returncode

    def send_signal(self, sig: int) -> None:
        """Signal the child (not its group) unless it ended."""
        if self.poll() is None:
            with contextlib.suppress(ProcessLookupError):
                os.kill(self.pid, sig)

    def communicate(self, input: Any = None, timeout: float | None = None) -> Any:
        raise NotImplementedError("a forked child has no communicate(); read its pipes")


def _child_fd(
    spec: Stdio, default: int, opened: list[int], ours: list[int]
) -> tuple[int, int | None]:
    """(the child's descriptor, this side's end of a pipe or None) for a Popen-style
    spec; what was opened for the child goes in ``opened``, this side's ends in ``ours``."""
    if spec == subprocess.PIPE:
        r, w = os.pipe()
        child, mine = (r, w) if default == 0 else (w, r)
        opened.append(child)
        ours.append(mine)
        return child, mine
    if spec == subprocess.DEVNULL:
        fd = os.open(os.devnull, os.O_RDWR)
        opened.append(fd)
        return fd, None
    if spec is None:
        return default, None
    if isinstance(spec, int):
        return spec, None
    return spec.fileno(), None


class Zygote:
    """The harness's handle on one zygote: start it, fork children from it, close it.

    ``python``: the engine's interpreter; ``module``: the engine program
    (``python -m module``); ``env``: the zygote's environment (default this
    process's; a module's import-time settings come from it); ``log_path``:
    the zygote's own stdout and stderr (what the imports print). Thread-safe:
    the first :meth:`spawn` starts the zygote (others wait for it), and
    requests from several threads are forked one after another.
    """

    def __init__(
        self,
        python: str | Path,
        module: str,
        *,
        env: Mapping[str, str] | None = None,
        log_path: str | Path | None = None,
        start_timeout_s: float = 300.0,
    ) -> None:
        self.python = str(python)
        self.module = module
        self.env = dict(env) if env is not None else None
        self.log_path = Path(log_path) if log_path is not None else None
        self.start_timeout_s = start_timeout_s
        #: What the zygote reported when ready: its pid, Python's threads, the
        #: kernel's thread count.
        self.ready: dict[str, Any] = {}
        self._proc: subprocess.Popen[bytes] | None = None
        self._control: socket.socket | None = None
        self._lock = threading.Lock()
        self._children: deque[ForkedProcess] = deque()
        self._closed = False

    @property
    def pid(self) -> int | None:
        """The zygote's pid (None before it started)."""
        return self._proc.pid if self._proc is not None else None

    def alive(self) -> bool:
        """Whether the zygote runs (False before it started)."""
        return self._proc is not None and self._proc.poll() is None

    def ended(self) -> bool:
        """Whether the zygote was closed or ended; a new one is needed."""
        return self._closed or (self._proc is not None and self._proc.poll() is not None)

    def idle(self) -> bool:
        """Whether none of the children it forked runs."""
        with self._lock:
            live = [c for c in self._children if c.poll() is None]
            self._children = deque(live)
            return not live

    def _start(self) -> None:
        ours, theirs = socket.socketpair(socket.AF_UNIX, socket.SOCK_SEQPACKET)
        log = open(self.log_path, "ab") if self.log_path is not None else None  # noqa: SIM115
        try:
            self._proc = subprocess.Popen(
                [self.python, "-m", __name__, self.module, "--control-fd", str(theirs.fileno())],
                stdin=subprocess.DEVNULL,
                stdout=log,
                stderr=subprocess.STDOUT if log is not None else None,
                # A copy, never the live environ: see lab.children.child_env
                # (this file does not import the harness's modules).
                env=dict(os.environ if self.env is None else self.env),
                pass_fds=(theirs.fileno(),),
                start_new_session=True,
            )
        finally:
            theirs.close()
            if log is not None:
                log.close()
        self._control = ours
        readable, _, _ = select.select([ours], [], [], self.start_timeout_s)
        msg = ours.recv(MESSAGE_BYTES) if readable else b""
        if not msg:
            self._kill()
            what = "was not ready in time" if not readable else "exited while importing"
            raise ZygoteError(f"zygote of {self.module} {what}{self._log_note()}")
        self.ready = json.loads(msg)

    def _log_note(self) -> str:
        if self.log_path is None:
            return ""
        try:
            tail = self.log_path.read_bytes()[-4096:].decode(errors="replace")
        except OSError:
            return ""
        return f"; last lines of {self.log_path}:\n" + "\n".join(tail.splitlines()[-15:])

    def spawn(
        self,
        argv: Sequence[str],
        *,
        stdin: Stdio = None,
        stdout: Stdio = None,
        stderr: Stdio = None,
        env: Mapping[str, str] | None = None,
    ) -> ForkedProcess:
        """Fork a child running ``argv`` (``[python, "-m", module, *args]`` of this
        zygote's interpreter and module), stdio as ``subprocess.Popen`` takes them
        (``PIPE``, ``DEVNULL``, ``STDOUT`` for stderr, a file, a descriptor, None:
        this process's), ``env`` its environment (default this process's)."""
        argv = [str(a) for a in argv]
        if argv[:3] != [self.python, "-m", self.module]:
            raise ValueError(f"this zygote runs {self.python} -m {self.module}, not {argv[:3]}")
        opened: list[int] = []  # descriptors this side closes once the zygote has its copies
        ours: list[int] = []  # this side's ends of pipes, closed if the spawn fails
        spawned = False
        try:
            child_in, our_in = _child_fd(stdin, 0, opened, ours)
            child_out, our_out = _child_fd(stdout, 1, opened, ours)
            if stderr == subprocess.STDOUT:
                child_err = child_out
            else:
                child_err, _ = _child_fd(stderr, 2, opened, ours)
            reply, theirs = socket.socketpair(socket.AF_UNIX, socket.SOCK_SEQPACKET)
            request = {
                "args": argv[3:],
                "env": dict(env if env is not None else os.environ),
                "cwd": os.getcwd(),
            }
            with self._lock:
                if self._closed:
                    raise ZygoteError(f"zygote of {self.module} was closed")
                if self._control is None:
                    self._start()
                assert self._control is not None
                try:
                    socket.send_fds(
                        self._control,
                        [json.dumps(request).encode()],
                        [theirs.fileno(), child_in, child_out, child_err],
                    )
                except OSError as e:
                    raise ZygoteError(f"zygote of {self.module} ended{self._log_note()}") from e
                finally:
                    theirs.close()
                readable, _, _ = select.select([reply], [], [], SPAWN_TIMEOUT_S)
                msg = reply.recv(4096) if readable else b""
                if not msg:
                    reply.close()
                    raise ZygoteError(f"zygote of {self.module} forked nothing{self._log_note()}")
                child = ForkedProcess(
                    argv,
                    int(json.loads(msg)["pid"]),
                    reply,
                    os.fdopen(our_in, "wb", buffering=0) if our_in is not None else None,
                    os.fdopen(our_out, "rb", buffering=0) if our_out is not None else None,
                )
                self._children.append(child)
                spawned = True
                return child
        finally:
            for fd in opened if spawned else opened + ours:
                with contextlib.suppress(OSError):
                    os.close(fd)

    def close(self, timeout_s: float = 30.0) -> None:
        """Close the control socket (the zygote stops its children and exits); wait for it."""
        with self._lock:
            self._closed = True
            if self._control is not None:
                self._control.close()
                self._control = None
            if self._proc is not None:
                try:
                    self._proc.wait(timeout_s)
                except subprocess.TimeoutExpired:
                    self._kill()

    def _kill(self) -> None:
        if self._proc is not None and self._proc.poll() is None:
            with contextlib.suppress(OSError):
                os.killpg(self._proc.pid, signal.SIGKILL)
            self._proc.wait()
        if self._control is not None:
            self._control.close()
            self._control = None


if __name__ == "__main__":
    raise SystemExit(main())
