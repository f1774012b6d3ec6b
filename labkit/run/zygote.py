"""labkit's warm process, from the inside: it imports once what every rank needs, never touches CUDA, and forks
ranks when the launching process asks (run/warm.py is the launching side, and says when it asks).

    serve(sock, kernel_pid)        # in a child forked from the launching process (warm.py does it)
    python -c "import sys; sys.path[:0] = [...]; from labkit.run.zygote import main; main()" FD KERNEL_PID
                                   # or started afresh, where the launching process has initialised CUDA

What it answers, over its end of a socket pair (pickled messages; a shared table's fd beside a fork request):
    ("check", id, digests)                     -> ("checked", id, differences)     run/patches.py
    ("fork", id, config, specs, payload) + fd  -> ("forked", id, pids) | ("failed", id, traceback)
    ("reap", pids)                             reaps those ranks once they have exited
and, unasked, ("exited", pid, code) when a rank exits. A rank it forked stays a zombie, holding its pid and so
its process group's id, until the launching process asks for it to be reaped, as with ranks the launching process
forks itself (run/reaping.py): a signal sent to a rank's group can never reach a stranger.

It leads a session of its own (an interrupt sent to the notebook's process group is not for it), its output goes
nowhere, and it ends, taking its ranks down, when the launching process goes: its end of the socket closes, or
this process is handed to another parent.
"""
from __future__ import annotations

import dataclasses
import gc
import os
import pickle
import select
import signal
import socket
import struct
import sys
import traceback
import types
from typing import Any, Callable, NoReturn

POLL_S = 0.01  # how often it looks for exited ranks and a message
_HEADER = struct.Struct("!Q")


def send_message(sock: socket.socket, message: Any) -> None:
    """One pickled message, its length first (both sides use these two)."""
    data = pickle.dumps(message)
    sock.sendall(_HEADER.pack(len(data)) + data)


def receive_message(sock: socket.socket, wait: float) -> Any:
    """The next message, or None if none began within `wait` seconds; EOFError when the other side is gone."""
    if not select.select([sock], [], [], wait)[0]:
        return None
    size = _HEADER.unpack(_exactly(sock, _HEADER.size))[0]
    return pickle.loads(_exactly(sock, size))


def _exactly(sock: socket.socket, size: int) -> bytes:
    chunks, left = [], size
    while left:
        chunk = sock.recv(min(left, 1 << 20))
        if not chunk:
            raise EOFError("the other end of the socket closed")
        chunks.append(chunk)
        left -= len(chunk)
    return b"".join(chunks)


def main() -> NoReturn:
    """Entry point when started afresh: argv is the socket's fd and the launching process's pid."""
    serve(socket.socket(fileno=int(sys.argv[1])), int(sys.argv[2]))


def serve(sock: socket.socket, kernel_pid: int) -> NoReturn:
    """Become the warm process: let go of the launching process's files, import, answer until it is gone."""
    gc.freeze()  # the notebook's objects stay as they are here: none is finalised (closing a file it held), and
    # the pages they sit on stay shared with the notebook and the ranks
    _detach(sock.fileno())
    _forget_unfinished_imports()
    from . import prewarm
    prewarm.warm(prewarm.WARM_PROCESS_MODULES)
    server = _Server(sock, kernel_pid)
    try:
        server.loop()
    finally:
        server.shutdown()
    os._exit(0)


def _detach(keep: int) -> None:
    os.setsid()
    signal.signal(signal.SIGINT, signal.SIG_IGN)
    _name("labkit-warm")
    null = os.open(os.devnull, os.O_RDWR)
    for fd in (0, 1, 2):
        os.dup2(null, fd)
    os.closerange(3, keep)
    os.closerange(keep + 1, 65536)  # the notebook's sockets and files are not ours to hold open
    sys.stdin = open(0, closefd=False)
    sys.stdout = open(1, "w", closefd=False)
    sys.stderr = open(2, "w", closefd=False)


def _forget_unfinished_imports() -> None:
    """Forked in the middle of `import labkit` (its last line), the modules still being imported then will never
    finish here: labkit is whole, and is marked so; others (a module of yours that imports labkit) are dropped, to be
    imported afresh by whoever needs them."""
    for name, module in list(sys.modules.items()):
        spec = getattr(module, "__spec__", None)
        if getattr(spec, "_initializing", False):
            if name == "labkit":
                spec._initializing = False
            else:
                del sys.modules[name]


def _name(name: str) -> None:
    """What `ps` and psutil's name() show for this process (its command line stays the launching process's)."""
    try:
        with open("/proc/self/comm", "w") as comm:
            comm.write(name[:15])
    except OSError:
        pass


class _Server:
    def __init__(self, sock: socket.socket, kernel_pid: int):
        self.sock, self.kernel_pid = sock, kernel_pid
        self.children: dict[int, int | None] = {}  # pid -> exit code once exited (then a zombie until reaped)
        self.reap_on_exit: set[int] = set()

    def loop(self) -> None:
        while os.getppid() == self.kernel_pid:
            try:
                message = receive_message(self.sock, POLL_S)
                if message is not None:
                    if message[0] == "quit":
                        return
                    self.handle(message)
                self.look_for_exits()
            except (EOFError, OSError):
                return  # the launching process is gone

    def handle(self, message: tuple) -> None:
        kind = message[0]
        if kind == "check":
            send_message(self.sock, ("checked", message[1], _differences(message[2])))
        elif kind == "fork":
            self.fork(*message[1:])
        elif kind == "reap":
            for pid in message[1]:
                if self.children.get(pid) is not None:
                    self.reap(pid)
                elif pid in self.children:
                    self.reap_on_exit.add(pid)

    def fork(self, request: int, config: Any, specs: list, payload: tuple[bytes, bytes]) -> None:
        _, fds, _, _ = socket.recv_fds(self.sock, 1, 1)
        pids: list[int] = []
        try:
            _preload(config)
            for spec in specs:
                pid = os.fork()
                if pid == 0:
                    _rank(spec, payload, fds[0], self.sock)
                pids.append(pid)
                self.children[pid] = None
            send_message(self.sock, ("forked", request, pids))
        except Exception:  # noqa: BLE001 - the launching process reports it, and starts the ranks another way
            for pid in pids:
                _kill(pid)
                self.reap_on_exit.add(pid)
            send_message(self.sock, ("failed", request, traceback.format_exc()))
        finally:
            for fd in fds:
                os.close(fd)

    def look_for_exits(self) -> None:
        for pid, code in list(self.children.items()):
            if code is not None:
                continue
            info = os.waitid(os.P_PID, pid, os.WEXITED | os.WNOHANG | os.WNOWAIT)
            if info is None:
                continue
            code = info.si_status if info.si_code == os.CLD_EXITED else -info.si_status
            self.children[pid] = code
            if pid in self.reap_on_exit:
                self.reap(pid)
            send_message(self.sock, ("exited", pid, code))

    def reap(self, pid: int) -> None:
        os.waitpid(pid, 0)
        self.children.pop(pid, None)
        self.reap_on_exit.discard(pid)

    def shutdown(self) -> None:
        """The launching process is gone (or asked): every rank still running goes with it."""
        for pid, code in self.children.items():
            if code is None:
                _kill(pid)
        for pid in list(self.children):
            try:
                os.waitpid(pid, 0)
            except ChildProcessError:
                pass


def _kill(pid: int) -> None:
    """SIGKILL a rank we have not reaped, and its group (a rank leads its own once it has started)."""
    for send in (os.killpg, os.kill):
        try:
            send(pid, signal.SIGKILL)
        except (ProcessLookupError, PermissionError):
            pass


def _differences(digests: dict) -> list[str]:
    from .patches import differences
    try:
        return differences(digests)
    except Exception as exc:  # noqa: BLE001 - not comparable is as good as different: the rank forks elsewhere
        return [f"(could not compare: {type(exc).__name__}: {exc})"]


def _preload(config: Any) -> None:
    if config is None:
        return
    from ..training.tasks import preload
    try:
        preload(config)
    except Exception:  # noqa: BLE001 - the rank imports it itself, and reports what goes wrong
        pass


def _rank(spec: Any, payload: tuple[bytes, bytes], fd: int, ours: socket.socket) -> NoReturn:
    """In the forked child: become what a rank forked from the launching process would be, then run the rank."""
    try:
        ours.close()
        signal.signal(signal.SIGINT, signal.default_int_handler)
        _name(f"labkit-rank{spec.rank}")
        from .rank import Heartbeats, rank_main
        beats, port, _ = Heartbeats.shared(spec.world_size, fd)
        os.close(fd)
        fn = _unpack(payload)
        rank_main(fn, dataclasses.replace(spec, launcher_pid=os.getppid()), beats, port)
    finally:
        os._exit(1)  # rank_main ends in os._exit; only a failure before it gets here


def _adopt_into_main(fn: Any) -> None:
    """Put the cell-defined classes and functions that `fn` refers to into this rank's __main__, under their names:
    cloudpickle rebuilt them by value, but a rank that pickles an instance (a result, a torch.save) names its class
    by reference, "__main__.Result", as a rank forked from the notebook's kernel would find it."""
    main = sys.modules["__main__"].__dict__
    functions = [fn] if isinstance(fn, types.FunctionType) else \
        [f for f in vars(type(fn)).values() if isinstance(f, types.FunctionType)]  # a callable object's methods
    seen = [fn, type(fn)]
    for function in functions:
        seen += list(function.__globals__.values())
        seen += [cell.cell_contents for cell in function.__closure__ or () if _filled(cell)]
    for obj in seen:
        if isinstance(obj, type) or callable(obj):
            name = getattr(obj, "__qualname__", "")
            if getattr(obj, "__module__", None) == "__main__" and name.isidentifier() and name not in main:
                main[name] = obj


def _filled(cell: Any) -> bool:
    try:
        cell.cell_contents
        return True
    except ValueError:  # an empty cell (a variable not yet assigned)
        return False


def _unpack(payload: tuple[bytes, bytes]) -> Callable[..., Any]:
    """The launching process's state applied here, then its function; a failure becomes the rank's failure (the
    launcher reports it with its traceback, as any other)."""
    try:
        pickle.loads(payload[0]).apply()
        import cloudpickle
        fn = cloudpickle.loads(payload[1])
        _adopt_into_main(fn)
        return fn
    except BaseException as exc:  # noqa: BLE001 - reported by rank_main as this rank's error
        failure = exc

        def could_not_start(ctx: Any) -> None:
            raise RuntimeError("this rank could not take over the launching process's state or function "
                               f"(see the cause above): {type(failure).__name__}: {failure}") from failure
        return could_not_start
