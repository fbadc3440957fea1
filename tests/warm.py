"""Test scripts started from a warm interpreter: a process forked from one that has imported torch.

Most processes the tests start import torch (about 1.7 s here), and train with a torch optimizer,
whose first step imports torch._dynamo (1.5 s more); in .venv-xla, torch_xla takes 4-6 s. Measured
over ``make test``, these imports were most of the CPU time of the scripts the tests start. A
warm server imports them once; each script then runs in a child it forks (``os.fork``), the
script's own arguments, environment, working directory and standard streams put in place, and
its code run as ``__main__`` (``runpy``). The child is a real process: signals, ``kill -9``,
``os._exit``, atexit handlers, its own children and its exit status are a fresh process's. What
differs is only what the server did before the fork: the imports (and the one variable they set
in the environment, ``TORCHINDUCTOR_CACHE_DIR``, to the default path), nothing else (no tensor op
runs in the server, so no thread pool or device is up; Python's ``random`` reseeds itself in a
forked child and numpy's global generator is reseeded here).

:func:`popen` decides per command. A command runs warm only when it is ``python SCRIPT.py ...``,
``python -m MODULE ...`` or ``python -c CODE ...`` (any Python interpreter: a server runs under
the command's own), and its environment matches the server's in everything a module might read
when it is imported (only ``XLATRAIN_*`` and the keys in ``RUN_TIME_KEYS`` may differ; anything
else, and the command starts a fresh process). A server starts at the second command with the
same environment (one used once is not worth an import), one per pytest worker and environment.

torchrun's launcher is a fresh process; the workers it starts run warm: torchrun starts each with
``PYTHON_EXEC`` (its documented override of the workers' interpreter), here a stand-in that
starts in about 30 ms (``python -S -E``, the standard library only), asks the server to fork
the worker with its arguments, environment, working directory and standard streams, in a session
of its own (as torchrun starts a worker), and stands where torchrun sees it: every signal it gets
goes on to the worker's process group, it exits as the worker did (with the same signal, for a
worker a signal ended), and if it is killed (``kill -9``), the server kills the worker. Where the
worker's environment differs from the server's in more than torchrun's variables, the stand-in
runs the real interpreter in its place (``exec``). The tests of start-up itself (what
``import xlatrain`` loads, the start-up hook, the doctor's view of the environment) and of the
harness's stack dumps run fresh (``warm=False``). ``XLATRAIN_TEST_WARM=0`` turns it all off.
"""

from __future__ import annotations

import atexit
import io
import json
import os
import runpy
import select
import shutil
import signal
import socket
import subprocess
import sys
import tempfile
import threading
import time
import types
from pathlib import Path

# Read by the scripts or xlatrain when they run, never when a preloaded module is imported.
RUN_TIME_KEYS = {"PYTEST_CURRENT_TEST", "STORAGE_EMULATOR_HOST", "MASTER_ADDR", "MASTER_PORT", "RANK",
                 "LOCAL_RANK", "WORLD_SIZE", "LOCAL_WORLD_SIZE", "GCSFS_EXPERIMENTAL_ZB_HNS_SUPPORT"}
# What torchrun adds to a worker's environment (read when the process group starts), and the
# variable that points it at the stand-in.
TORCHRUN_KEYS = {"GROUP_RANK", "GROUP_WORLD_SIZE", "ROLE_NAME", "ROLE_RANK", "ROLE_WORLD_SIZE",
                 "TORCH_NCCL_ASYNC_ERROR_HANDLING", "PYTHON_EXEC"}
MAX_MESSAGE = 1 << 20
# The signals a worker's stand-in passes on (SIGABRT: the harness's stack dumps).
FORWARDED = (signal.SIGTERM, signal.SIGINT, signal.SIGHUP, signal.SIGQUIT, signal.SIGUSR1, signal.SIGUSR2,
             signal.SIGABRT, signal.SIGCONT)


def _import_time_env(env: dict[str, str], worker: bool = False) -> tuple[tuple[str, str], ...]:
    def run_time(key: str) -> bool:
        return (key in RUN_TIME_KEYS or key.startswith("XLATRAIN_")
                or (worker and (key in TORCHRUN_KEYS or key.startswith("TORCHELASTIC_"))))
    return tuple(sorted((k, v) for k, v in env.items() if not run_time(k)))


# What the server imports. Not torch_xla (4-6 s more): xlatrain writes XLA:CPU settings into the
# environment before it imports torch_xla (backend/xla.py), and a preloaded one would have read
# its own defaults already.
PRELOAD = ["torch", "torch._dynamo"]


# --- the server ----------------------------------------------------------------------------------

def _serve(path: str, modules: list[str]) -> int | None:
    """Import ``modules``, then fork a child per request until stdin closes. Returns None in the
    server (which then exits), the child's code in a child (which runs it and exits with it)."""
    import importlib

    worker_key = _import_time_env(dict(os.environ), True)  # a worker's must match (before the imports)
    for name in modules:
        importlib.import_module(name)
    base_env = dict(os.environ)
    listener = socket.socket(socket.AF_UNIX, socket.SOCK_SEQPACKET)
    listener.bind(path)
    listener.listen(64)
    sys.stdout.write("ready\n")
    sys.stdout.flush()
    children: dict[int, socket.socket] = {}
    stand_ins: dict[socket.socket, int] = {}  # a torchrun worker's stand-in's connection: the worker
    while True:
        ready, _, _ = select.select([listener, sys.stdin, *stand_ins], [], [], 0.01 if children else 0.5)
        if sys.stdin in ready and not os.read(sys.stdin.fileno(), 1):
            return None  # the tests are done (or gone)
        for conn in set(ready) & set(stand_ins):  # its stand-in is gone (killed): so is the worker
            pid = stand_ins.pop(conn)
            try:
                gone = not conn.recv(64)
            except OSError:
                gone = True
            if gone and pid in children:
                _signal_group(pid, signal.SIGKILL)
        if listener in ready:
            conn, _ = listener.accept()
            message, fds, _, _ = socket.recv_fds(conn, MAX_MESSAGE, 3)
            request = json.loads(message) if message else None  # none: whoever asked is gone (killed)
            if request is None or (request.get("worker") and
                                   _import_time_env(request["env"], True) != worker_key):
                for fd in fds:
                    os.close(fd)
                try:
                    conn.send(b"fresh")
                except OSError:
                    pass
                conn.close()
                continue
            sys.stdout.flush()
            sys.stderr.flush()
            pid = os.fork()
            if pid == 0:
                for other in (listener, conn, *children.values()):
                    other.close()
                return _child(request, fds, base_env)
            for fd in fds:
                os.close(fd)
            children[pid] = conn
            try:
                conn.send(f"{pid}".encode())
            except OSError:  # whoever asked is gone already (killed): so is its command
                _signal_group(pid, signal.SIGKILL)
                continue
            if request.get("worker"):
                stand_ins[conn] = pid
        while children:
            pid, status = os.waitpid(-1, os.WNOHANG)
            if pid == 0:
                break
            conn = children.pop(pid, None)
            if conn is not None:
                stand_ins.pop(conn, None)
                try:
                    conn.send(f"{os.waitstatus_to_exitcode(status)}".encode())
                except OSError:
                    pass
                conn.close()


def _child(request: dict, fds: list[int], base_env: dict[str, str]):
    """In the forked child: become the requested command. Returns what the command's code returns
    (None for a script that ends normally); its exceptions propagate as an uncaught one would."""
    for target, fd in zip((0, 1, 2), fds):
        os.dup2(fd, target)
    for fd in set(fds):
        os.close(fd)
    if request["new_session"]:
        os.setsid()
    os.chdir(request["cwd"])
    env = dict(os.environ)  # the server's, with what its imports set
    for key in set(base_env) | set(request["env"]):
        if key in request["env"]:
            env[key] = request["env"][key]
        elif key in base_env:
            env.pop(key, None)
    os.environ.clear()
    os.environ.update(env)
    if request.get("unbuffered"):  # python -u, as torchrun starts its workers
        for name, fd in (("stdout", 1), ("stderr", 2)):
            old = getattr(sys, name)
            setattr(sys, name, io.TextIOWrapper(io.FileIO(fd, "w", closefd=False), encoding=old.encoding,
                                                errors=old.errors, write_through=True))
    if "numpy" in sys.modules:
        sys.modules["numpy"].random.seed()
    argv = request["argv"][1:]
    if argv[0] == "-c":
        sys.argv = ["-c", *argv[2:]]
        sys.path[0] = ""
        main = sys.modules["__main__"] = types.ModuleType("__main__")
        main.__builtins__ = __builtins__
        exec(compile(argv[1], "<string>", "exec"), main.__dict__)
    elif argv[0] == "-m":
        sys.argv = [argv[1], *argv[2:]]
        sys.path[0] = request["cwd"]
        runpy.run_module(argv[1], run_name="__main__", alter_sys=True)
    else:
        sys.argv = list(argv)
        sys.path[0] = str(Path(argv[0]).resolve().parent)
        runpy.run_path(argv[0], run_name="__main__")
    return None


def _signal_group(pid: int, sig: int) -> None:
    """Signal the process group of worker ``pid`` (the worker itself, before its ``setsid``)."""
    try:
        os.killpg(pid, sig)
    except ProcessLookupError:
        try:
            os.kill(pid, sig)
        except ProcessLookupError:
            pass


# --- a torchrun worker's stand-in ------------------------------------------------------------------

def _stand_in(path: str, python: str, args: list[str]) -> None:
    """Run as a torchrun worker's interpreter (``PYTHON_EXEC``): have the server fork the worker,
    pass it every signal, exit as it did. Runs the real interpreter where the server declines."""
    rest = list(args)
    unbuffered = bool(rest) and rest[0] == "-u"
    if unbuffered:
        rest.pop(0)
    reply = b""
    if rest and (rest[0].endswith(".py") or (rest[0] == "-m" and len(rest) >= 2)):
        request = {"argv": [python, *rest], "env": dict(os.environ), "cwd": os.getcwd(), "new_session": True,
                   "unbuffered": unbuffered, "worker": True}
        conn = socket.socket(socket.AF_UNIX, socket.SOCK_SEQPACKET)
        try:
            conn.connect(path)
            socket.send_fds(conn, [json.dumps(request).encode()], [0, 1, 2])
            reply = conn.recv(64)
        except OSError:  # no server (the tests ended meanwhile)
            reply = b""
    if not reply.isdigit():
        os.execv(python, [python, *args])
    pid = int(reply)

    for sig in FORWARDED:
        signal.signal(sig, lambda sig, frame: _signal_group(pid, sig))
    status = conn.recv(64)  # the worker's exit code (-N: signal N), once it ends
    code = int(status) if status else -signal.SIGKILL
    if code < 0:
        for sig in FORWARDED:
            signal.signal(sig, signal.SIG_DFL)
        os.kill(os.getpid(), -code)
    os._exit(code & 0xFF)


# --- the client ----------------------------------------------------------------------------------

class WarmProcess:
    """The part of ``subprocess.Popen`` the tests use, for a child of a warm server."""

    def __init__(self, server: _Server, args: list[str], env: dict[str, str], cwd, stdout, stderr, text: bool,
                 start_new_session: bool):
        self.args = args
        self.returncode: int | None = None
        self.stdout = self.stderr = None
        self._readers: list[tuple[object, list, threading.Thread | None]] = []
        send, close = [], []
        devnull = os.open(os.devnull, os.O_RDONLY)
        send.append(devnull)
        close.append(devnull)
        pipes = {}
        for name, wanted in (("stdout", stdout), ("stderr", stderr)):
            if wanted == subprocess.PIPE:
                r, w = os.pipe()
                pipes[name] = open(r, "r" if text else "rb", **({"encoding": "utf-8", "errors": "replace"} if text else {}))
                send.append(w)
                close.append(w)
            elif wanted == subprocess.STDOUT:
                send.append(send[1])
            else:
                send.append(1 if name == "stdout" else 2)
        self.stdout, self.stderr = pipes.get("stdout"), pipes.get("stderr")
        self._control = socket.socket(socket.AF_UNIX, socket.SOCK_SEQPACKET)
        self._control.connect(server.path)
        request = {"argv": args, "env": env, "cwd": str(cwd or os.getcwd()), "new_session": start_new_session}
        socket.send_fds(self._control, [json.dumps(request).encode()], send)
        for fd in close:
            os.close(fd)
        reply = self._control.recv(64)
        if not reply:
            raise RuntimeError(f"the warm server for {args[0]} is gone")
        self.pid = int(reply)

    # exit status
    def poll(self) -> int | None:
        if self.returncode is None:
            ready, _, _ = select.select([self._control], [], [], 0)
            if ready:
                self._read_status()
        return self.returncode

    def wait(self, timeout: float | None = None) -> int:
        if self.returncode is None:
            ready, _, _ = select.select([self._control], [], [], timeout)
            if not ready:
                raise subprocess.TimeoutExpired(self.args, timeout)
            self._read_status()
        return self.returncode

    def _read_status(self) -> None:
        reply = self._control.recv(64)
        self._control.close()
        if not reply:
            raise RuntimeError(f"the warm server for {self.args[0]} went away before process {self.pid} ended")
        self.returncode = int(reply)

    # signals
    def send_signal(self, sig: int) -> None:
        if self.poll() is None:
            try:
                os.kill(self.pid, sig)
            except ProcessLookupError:
                pass

    def kill(self) -> None:
        self.send_signal(signal.SIGKILL)

    # output
    def communicate(self, input=None, timeout: float | None = None):
        assert input is None, "warm processes read /dev/null"
        deadline = None if timeout is None else time.monotonic() + timeout

        def left() -> float | None:
            return None if deadline is None else max(0.0, deadline - time.monotonic())

        def timed_out() -> subprocess.TimeoutExpired:  # with what was read so far, as Popen's has it
            return subprocess.TimeoutExpired(self.args, timeout, *(self._so_far(i, bytes_=True) for i in (0, 1)))
        if not self._readers:
            for stream in (self.stdout, self.stderr):
                chunks: list = []
                thread = None
                if stream is not None:
                    thread = threading.Thread(target=_drain, args=(stream, chunks), daemon=True)
                    thread.start()
                self._readers.append((stream, chunks, thread))
        for _, _, thread in self._readers:
            if thread is not None:
                thread.join(left())
                if thread.is_alive():
                    raise timed_out()
        try:
            self.wait(left())
        except subprocess.TimeoutExpired:
            raise timed_out() from None
        return tuple(self._so_far(i) for i in (0, 1))

    def _so_far(self, i: int, bytes_: bool = False):
        stream, chunks, _ = self._readers[i]
        if stream is None:
            return None
        joined = ("" if isinstance(stream, io.TextIOBase) else b"").join(chunks)
        return joined.encode() if bytes_ and isinstance(joined, str) else joined


def _drain(stream, chunks: list) -> None:
    for line in iter(stream.readline, stream.read(0)):
        chunks.append(line)


class _Server:
    def __init__(self, python: str, env: dict[str, str]):
        self.dir = tempfile.mkdtemp(prefix="xlatrain-warm-")
        self.path = os.path.join(self.dir, "socket")
        # torchrun's workers' interpreter (PYTHON_EXEC): a stand-in that has this server fork them.
        self.stand_in = os.path.join(self.dir, "python")
        Path(self.stand_in).write_text(f'#!/bin/sh\nexec "{python}" -S -E "{__file__}" --stand-in "{self.path}" '
                                       f'"{python}" "$@"\n')
        os.chmod(self.stand_in, 0o755)
        self.proc = subprocess.Popen([python, __file__, self.path, *PRELOAD], env=env, stdin=subprocess.PIPE,
                                     stdout=subprocess.PIPE, text=True, cwd=self.dir)
        line = self.proc.stdout.readline()
        if line.strip() != "ready":
            raise RuntimeError(f"the warm server did not start ({self.proc.wait()}): {line}")

    def close(self) -> None:
        # Closing stdin ends it, unless a process forked from the tests' own (a data worker left
        # over) holds the pipe's other end too: then SIGTERM, after a moment, not a wait per server.
        self.proc.stdin.close()
        try:
            self.proc.wait(timeout=1)
        except subprocess.TimeoutExpired:
            self.proc.terminate()
            self.proc.wait()
        shutil.rmtree(self.dir, ignore_errors=True)


_servers: dict[tuple, _Server] = {}
_seen: set[tuple] = set()
_lock = threading.Lock()


def enabled() -> bool:
    return os.environ.get("XLATRAIN_TEST_WARM", "1") != "0"


def popen(args: list[str], env: dict[str, str], cwd=None, stdout=subprocess.PIPE, stderr=subprocess.PIPE,
          text: bool = True, start_new_session: bool = False):
    """``subprocess.Popen(args, ...)`` (stdin from /dev/null), or the same command forked from a warm
    server where it can be (see the module's docstring)."""
    args = [str(a) for a in args]
    torchrun = enabled() and Path(args[0]).name == "torchrun"
    warm = (enabled() and len(args) >= 2 and Path(args[0]).name.startswith("python")
            and (args[1].endswith(".py") or (args[1] in ("-m", "-c") and len(args) >= 3)))
    server = None
    if warm or torchrun:
        python = str(Path(args[0]).parent / "python") if torchrun else args[0]
        key = (python, _import_time_env(env))
        with _lock:
            if key in _servers:
                server = _servers[key]
            elif key in _seen or torchrun:  # a torchrun job starts several workers: worth a server
                server = _servers[key] = _Server(python, env)
            else:
                _seen.add(key)
    if torchrun and server is not None:
        env = {**env, "PYTHON_EXEC": server.stand_in}
        server = None  # the launcher itself is a fresh process
    if server is None:
        return subprocess.Popen(args, env=env, cwd=cwd, stdout=stdout, stderr=stderr, text=text,
                                stdin=subprocess.DEVNULL, start_new_session=start_new_session)
    return WarmProcess(server, args, env, cwd, stdout, stderr, text, start_new_session)


@atexit.register
def _close_servers() -> None:
    for server in _servers.values():
        server.close()


if __name__ == "__main__":
    if sys.argv[1] == "--stand-in":
        _stand_in(sys.argv[2], sys.argv[3], sys.argv[4:])
    outcome = _serve(sys.argv[1], sys.argv[2:])
    if outcome is not None:
        sys.exit(outcome)
