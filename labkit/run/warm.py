"""labkit's warm process, from the launching side: start it, ask it whether it may stand in for this process, and
have it fork ranks (run/zygote.py is the other side).

    warm.start()                   # `import labkit` in a notebook does it (prewarm.py); returns at once
    prepared = warm.prepare(fn, config, check=True)   # None: fork from this process instead (prepared.why says)
    procs, beats, port = prepared.start(specs)         # the ranks, as run/launch.py watches them

Forked from this process at `import labkit`, once torch is imported, it imports torch._dynamo, transformers' GPT-2
and labkit's training loop while the notebook goes on; it never touches CUDA. launch() forks ranks from it when:
  * CUDA is initialised here (a forked child cannot use CUDA): instead of spawning, which re-imports torch in every
    rank at every launch. Where none is running, one is started afresh then (the first launch waits for it once).
  * this process has not imported what ranks need (a notebook's first launches), and nothing a rank would run was
    patched here since the fork (run/patches.py): then it is a pure gain, seconds off the launch.
Otherwise ranks fork from this process, exactly as before (and the first such launch imports what they need).

A rank forked from the warm process gets the launched function by value (cloudpickle: what it refers to in a cell,
a closure's variables, a class defined in a cell), and what a rank forked from here would have inherited
(run/inherit.py: environment variables, working directory, sys.path, random generators, torch's switches).

It is this process's child, ranks are its children (it reports their exits and reaps them when asked), and it ends
when this process does: killed, this process's end of the socket closes and it takes its ranks down with it.
"""
from __future__ import annotations

import atexit
import itertools
import os
import pickle
import socket
import subprocess
import sys
import threading
import time
from dataclasses import dataclass
from typing import Any, Callable

from . import patches, prewarm
from .inherit import Inherited
from .zygote import receive_message, send_message

ANSWER_TIMEOUT_S = 120.0  # the first answer waits for the warm process's imports (seconds; more on a busy machine)
POLL_S = 0.05


class WarmUnavailable(RuntimeError):
    """The warm process cannot serve this launch (gone, too slow, or it could not fork); the text says why."""


class WarmProcess:
    """A running warm process: requests to it, and what it reported about its ranks."""

    def __init__(self, pid: int, sock: socket.socket, baseline: patches.Baseline | None,
                 environ: dict[str, str] | None, popen: subprocess.Popen | None = None):
        self.pid, self.sock, self.popen = pid, sock, popen
        self.baseline, self.environ = baseline, environ  # None when started afresh (not forked from here)
        self.exits: dict[int, int] = {}
        self.replies: dict[int, tuple] = {}
        self.gone: str | None = None
        self._ids = itertools.count()
        self._receiving, self._sending = threading.Lock(), threading.Lock()

    @property
    def forked(self) -> bool:
        return self.baseline is not None

    def request(self, kind: str, *args: Any, fds: tuple[int, ...] = (), timeout: float = ANSWER_TIMEOUT_S,
                stop: Callable[[], bool] | None = None) -> tuple:
        """Send (kind, id, *args) with `fds` beside it; wait for the answer with that id."""
        number = next(self._ids)
        self.send((kind, number, *args), fds)
        deadline = time.monotonic() + timeout
        while number not in self.replies:
            if self.gone:
                raise WarmUnavailable(self.gone)
            if time.monotonic() > deadline:
                raise WarmUnavailable(f"the warm process did not answer within {timeout:.0f} s")
            if stop is not None and stop():
                raise WarmUnavailable("stopped while waiting for the warm process")
            self.pump(POLL_S)
        return self.replies.pop(number)

    def send(self, message: tuple, fds: tuple[int, ...] = ()) -> None:
        try:
            with self._sending:
                send_message(self.sock, message)
                if fds:
                    socket.send_fds(self.sock, [b"F"], list(fds))
        except OSError as exc:
            self.gone = self.gone or f"the warm process is gone ({exc})"
            raise WarmUnavailable(self.gone) from exc

    def pump(self, wait: float = 0.0) -> None:
        """Read what the warm process said (waiting up to `wait` s for the first message): exits and answers."""
        if self.gone or not self._receiving.acquire(timeout=max(wait, 0.001)):
            return
        try:
            while (message := receive_message(self.sock, wait)) is not None:
                wait = 0.0
                if message[0] == "exited":
                    self.exits[message[1]] = message[2]
                else:
                    self.replies[message[1]] = message
        except (EOFError, OSError) as exc:
            self.gone = f"the warm process (pid {self.pid}) is gone ({type(exc).__name__})"
        finally:
            self._receiving.release()

    def close(self, wait_s: float = 2.0) -> None:
        """Ask it to end (it takes any rank still running with it) and reap it."""
        try:
            self.send(("quit",))
        except WarmUnavailable:
            pass
        self.gone = self.gone or "closed"
        self.sock.close()
        deadline = time.monotonic() + wait_s
        while time.monotonic() < deadline and not self._reaped():
            time.sleep(0.01)
        if not self._reaped():
            os.kill(self.pid, 9)
            while not self._reaped():
                time.sleep(0.01)

    def _reaped(self) -> bool:
        if self.popen is not None:
            return self.popen.poll() is not None
        try:
            return os.waitpid(self.pid, os.WNOHANG)[0] != 0
        except ChildProcessError:
            return True


class WarmRank:
    """A rank the warm process forked, with what run/reaping.py asks of a multiprocessing Process."""

    def __init__(self, warm: WarmProcess, pid: int):
        self.warm, self.pid, self.reaped = warm, pid, False

    def exit_code(self) -> int | None:
        """Its exit code (negative: the signal that killed it), or None while it runs. It stays a zombie, its pid
        ours, until join() asks for it to be reaped. Gone with the warm process: counted as killed."""
        self.warm.pump()
        code = self.warm.exits.get(self.pid)
        if code is None and self.warm.gone:
            return -9
        return code

    @property
    def exitcode(self) -> int | None:
        return self.exit_code()

    def is_reaped(self) -> bool:
        return self.reaped or bool(self.warm.gone)  # a gone warm process's children are reaped by init

    def join(self, timeout: float | None = None) -> None:
        deadline = time.monotonic() + (timeout if timeout is not None else 1e9)
        while self.exit_code() is None and time.monotonic() < deadline:
            self.warm.pump(0.01)
        if self.exit_code() is not None and not self.reaped:
            self.reaped = True
            try:
                self.warm.send(("reap", [self.pid]))
            except WarmUnavailable:
                pass


@dataclass(frozen=True)
class Prepared:
    """A launch the warm process will serve: the function and this process's state, pickled once for every
    attempt (restarts reuse them)."""

    warm: WarmProcess
    config: Any
    payload: tuple[bytes, bytes]

    def start(self, specs: list[Any], stop: Callable[[], bool] | None = None) -> tuple[list[WarmRank], Any, Any]:
        """Have the warm process fork one rank per spec: (ranks, heartbeats, port), as launch.py watches them."""
        from .rank import Heartbeats  # here: the rank's modules bring pandas, which `import labkit` does not need
        beats, port, fd = Heartbeats.shared(len(specs))
        try:
            answer = self.warm.request("fork", self.config, specs, self.payload, fds=(fd,), stop=stop)
        finally:
            os.close(fd)
        if answer[0] != "forked":
            raise WarmUnavailable(f"the warm process could not fork the ranks:\n{answer[2]}")
        for rank in range(len(specs)):
            beats.beat(rank)  # the start-up clock starts now, not before the warm process had finished importing
        return [WarmRank(self.warm, pid) for pid in answer[2]], beats, port


# --- the one warm process of this process ------------------------------------------------------------------------

_current: WarmProcess | None = None
_lock = threading.Lock()


def current() -> WarmProcess | None:
    """The warm process serving this process, if one is running."""
    return _current if _current is not None and not _current.gone else None


def start(afresh: bool | None = None) -> WarmProcess:
    """Start the warm process unless one runs: forked from here (torch imported already: fast), or afresh when CUDA
    is initialised here (a fork would carry it) or `afresh` says so. Returns at once; it imports meanwhile."""
    global _current
    with _lock:
        if current() is None:
            from .cuda_guard import cuda_is_initialised
            _current = _start_afresh() if (afresh if afresh is not None else cuda_is_initialised()) else _fork()
        return _current


def start_on_import() -> None:
    """What `import labkit` does last: start the warm process in a notebook kernel, or when LABKIT_PREWARM=1."""
    choice = prewarm.wanted()
    if choice is True or (choice is None and prewarm.in_notebook()):
        start()


def stop() -> None:
    """End the warm process (if any); the next launch that wants one starts another."""
    global _current
    with _lock:
        if _current is not None:
            _current.close()
        _current = None


def prepare(fn: Callable[..., Any], config: Any, *, check: bool, stop: Callable[[], bool] | None = None
            ) -> Prepared | str:
    """A Prepared launch, or why the warm process cannot serve it: the function will not pickle, or (with `check`)
    something a rank runs was patched here since the fork (and which)."""
    try:
        warm = current() if check else start()
    except Exception as exc:  # noqa: BLE001 - no warm process to be had: the ranks start another way
        return f"the warm process could not be started ({type(exc).__name__}: {exc})"
    if warm is None:
        return "no warm process is running"
    if check and not warm.forked:
        return "the warm process was started afresh, not forked from here: what was patched here cannot be told"
    try:
        import cloudpickle
        function = cloudpickle.dumps(fn)
    except Exception as exc:  # noqa: BLE001 - an unpicklable closure: only a fork from here can start it
        return f"the function does not pickle ({type(exc).__name__}: {exc})"
    if check:
        digests = warm.baseline.changed()
        try:
            found = warm.request("check", digests, stop=stop)[2]
        except WarmUnavailable as exc:
            return str(exc)
        if found:
            return "changed here since the warm process started: " + ", ".join(found[:5]) + \
                (f" and {len(found) - 5} more" if len(found) > 5 else "")
        warm.baseline.accept(digests)
    state = Inherited.capture(warm.environ)
    return Prepared(warm, config, (pickle.dumps(state), function))


def _fork() -> WarmProcess:
    baseline, environ = patches.Baseline.now(), dict(os.environ)
    ours, theirs = socket.socketpair()
    kernel = os.getpid()
    pid = os.fork()
    if pid == 0:  # the warm process
        try:
            ours.close()
            from .zygote import serve
            serve(theirs, kernel)
        finally:
            os._exit(1)
    theirs.close()
    return WarmProcess(pid, ours, baseline, environ)


def _start_afresh() -> WarmProcess:
    ours, theirs = socket.socketpair()
    code = f"import sys; sys.path[:0] = {sys.path!r}; from labkit.run.zygote import main; main()"
    popen = subprocess.Popen([sys.executable, "-c", code, str(theirs.fileno()), str(os.getpid())],
                             pass_fds=[theirs.fileno()], stdin=subprocess.DEVNULL, stdout=subprocess.DEVNULL,
                             stderr=subprocess.DEVNULL)
    theirs.close()
    return WarmProcess(popen.pid, ours, None, None, popen)


def _forget_in_child() -> None:
    """In any process forked from this one (a rank, the warm process itself): the warm process is not its own, and
    its end of the socket must close there, so that this process's death is seen (the socket closes)."""
    global _current, _lock
    if _current is not None:
        _current.gone = "not this process's warm process"
        try:
            os.close(_current.sock.detach())  # detached first: the object, collected later, closes nothing
        except OSError:
            pass
    _current, _lock = None, threading.Lock()


os.register_at_fork(after_in_child=_forget_in_child)
atexit.register(stop)
