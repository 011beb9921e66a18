"""A warm interpreter that forks the rank workers of multi-process tests, so that each rank
does not import torch again (about 2 s of CPU per rank; a 4-rank test spent most of its CPU
there, and the parallel test phase is CPU-bound on 2 cores).

Each rank is still a real, separate process (its own gloo process group, killed and stopped
with real signals): forked from this server after ``import torch, torch.distributed,
asyncckpt``, it runs the worker script as ``__main__`` (``runpy``) with its own ``argv``,
environment, ``sys.path`` (the script's directory, then ``PYTHONPATH``, as ``python SCRIPT``
would have it) and stdout/stderr in its log file. The server itself never runs a tensor
operation nor starts a thread, so nothing is half-held at the fork.

Only for workers that end with ``os._exit`` or do not test how an interpreter exits: a
forked worker that returns runs the ``atexit`` hooks and joins its threads as an exiting
interpreter does, but it is not a fresh interpreter's finalization (``tests/test_exit_paths.py``
and the like keep ``subprocess``).

:func:`spawn` is what tests use (through ``_ranks.run_ranks(..., warm=True)``): it returns a
:class:`WarmProc` with the part of ``subprocess.Popen``'s interface the tests use (``pid``,
``poll``, ``wait``, ``kill``, ``send_signal``, ``returncode``). One server per test process,
started on first use; :func:`close` (``tests/conftest.py`` at the session's end, ``atexit``
too) stops it and kills any worker still running.

Protocol (JSON lines): the client writes ``{"argv": [...], "env": {...}, "log": PATH}``; the
server answers ``{"pid": N}`` (or ``{"error": TEXT}``) and later ``{"exited": N, "code": C}``
(``C`` as ``Popen.returncode``: ``-9`` for SIGKILL). End of input: it SIGKILLs what is left
and exits.
"""

from __future__ import annotations

import atexit
import contextlib
import gc
import json
import os
import queue
import select
import signal
import subprocess
import sys
import tempfile
import threading
from typing import Any

#: What the server imports once, before any fork (what the rank workers import first).
PRELOAD = ("torch", "torch.distributed", "torch.distributed.tensor", "asyncckpt")


# ------------------------------------------------------------------------------- the server
#: Environment variables a library reads once, when it loads (OpenMP/BLAS thread counts, torch's
#: and gloo's settings, the interpreter's own): a forked worker would silently keep the
#: server's values, so :func:`spawn` refuses a worker whose environment changes one of them.
IMPORT_TIME_ENV = ("OMP_", "KMP_", "MKL_", "OPENBLAS_", "GOMP_", "TORCH_", "GLOO_", "PYTHON", "LD_", "MALLOC_")
#: What a worker may change among them: the child rebuilds ``sys.path`` from it.
PER_WORKER_ENV = ("PYTHONPATH",)


def import_time_env(env: dict[str, str]) -> dict[str, str]:
    """The part of ``env`` that must be the server's own for a forked worker to honour it."""
    return {k: v for k, v in env.items() if k.startswith(IMPORT_TIME_ENV) and k not in PER_WORKER_ENV}


def _reseed() -> None:
    """What a fresh interpreter draws anew: torch's and numpy's default seeds come from the OS
    at start-up, so forked ranks would otherwise all share the server's (``random`` reseeds
    itself at a fork, ``tempfile`` checks the pid)."""
    torch = sys.modules.get("torch")
    if torch is not None:
        torch.seed()
    np = sys.modules.get("numpy")
    if np is not None:
        np.random.seed()


def _child(req: dict[str, Any], base_path: list[str], inherited: list[int]) -> None:
    """In the forked child: become ``python argv[0] argv[1:]`` with ``env``; never returns."""
    code = 1
    try:
        for fd in inherited:  # the server's protocol pipe and exit watches: not this worker's
            os.close(fd)
        log = os.open(req["log"], os.O_WRONLY | os.O_CREAT | os.O_TRUNC, 0o644)
        os.dup2(log, 1)
        os.dup2(log, 2)
        os.close(log)
        null = os.open(os.devnull, os.O_RDONLY)
        os.dup2(null, 0)
        os.close(null)
        gc.enable()  # off in the server (see serve)
        _reseed()
        env = req["env"]
        os.environ.clear()
        os.environ.update(env)
        script = os.path.abspath(req["argv"][0])
        sys.argv = [script, *req["argv"][1:]]
        extra = [p for p in env.get("PYTHONPATH", "").split(os.pathsep) if p]
        path = [os.path.dirname(script), *extra, *base_path]
        sys.path[:] = list(dict.fromkeys(path))
        import runpy
        import traceback

        try:
            runpy.run_path(script, run_name="__main__")
            code = 0
        except SystemExit as e:
            if e.code is None or isinstance(e.code, int):
                code = e.code or 0
            else:
                print(e.code, file=sys.stderr)
                code = 1
        except BaseException:  # noqa: BLE001 - what an interpreter prints for an uncaught exception
            traceback.print_exc()
            code = 1
        # what an exiting interpreter does next: join the non-daemon threads, run atexit hooks
        with contextlib.suppress(BaseException):
            threading._shutdown()  # type: ignore[attr-defined]
        with contextlib.suppress(BaseException):
            atexit._run_exitfuncs()
        with contextlib.suppress(BaseException):
            sys.stdout.flush()
            sys.stderr.flush()
    finally:
        os._exit(code)


def serve() -> None:
    """The server's loop (one Python thread: a fork never copies a lock another thread holds).

    The protocol goes out on a copy of fd 1, and fd 1 becomes stderr (the server's log), so
    that nothing an import prints can garble it. The collector is off while the preloaded
    modules are built and they are frozen before the first fork (``gc.freeze``'s documented
    use): a worker's collections then never write to the pages it shares with the server.
    Each worker's exit is seen on its pidfd, at once, without polling."""
    import importlib

    out = os.dup(1)
    os.dup2(2, 1)
    own = [p for p in os.environ.get("PYTHONPATH", "").split(os.pathsep) if p]
    base_path = [p for p in sys.path[1:] if p not in own]
    gc.disable()
    for name in PRELOAD:
        importlib.import_module(name)
    gc.freeze()
    children: dict[int, int] = {}  # pidfd -> pid
    buf = b""

    def say(msg: dict[str, Any]) -> None:
        os.write(out, (json.dumps(msg) + "\n").encode())

    while True:
        ready, _, _ = select.select([0, *children], [], [])
        for fd in ready:
            if fd == 0:
                continue
            pid = children.pop(fd)
            os.close(fd)
            _, status = os.waitpid(pid, 0)  # its pidfd is readable: it has exited
            say({"exited": pid, "code": os.waitstatus_to_exitcode(status)})
        if 0 not in ready:
            continue
        chunk = os.read(0, 65536)
        if not chunk:  # the test process is gone or done: leave nothing behind
            for fd in children:
                with contextlib.suppress(ProcessLookupError):
                    signal.pidfd_send_signal(fd, signal.SIGKILL)
            for pid in children.values():
                with contextlib.suppress(ChildProcessError):
                    os.waitpid(pid, 0)
            return
        buf += chunk
        while b"\n" in buf:
            line, buf = buf.split(b"\n", 1)
            req = json.loads(line)
            if "signal" in req:  # a worker not reaped yet: its pidfd cannot reach another process
                for fd, pid in children.items():
                    if pid == req["signal"]:
                        with contextlib.suppress(ProcessLookupError):
                            signal.pidfd_send_signal(fd, req["sig"])
                continue
            try:
                pid = os.fork()
            except Exception as e:  # noqa: BLE001 - answered to the client
                say({"error": repr(e)})
                continue
            if pid == 0:
                _child(req, base_path, [out, *children])
            children[os.pidfd_open(pid)] = pid
            say({"pid": pid})


# ------------------------------------------------------------------------------- the client
class WarmProc:
    """A forked worker, seen through the part of ``subprocess.Popen`` the tests use."""

    def __init__(self, pid: int, args: list[str], server: _Server) -> None:
        self.pid, self.args, self._server = pid, args, server
        self.returncode: int | None = None
        self._done = threading.Event()

    def _exited(self, code: int) -> None:
        self.returncode = code
        self._done.set()

    def poll(self) -> int | None:
        return self.returncode

    def wait(self, timeout: float | None = None) -> int:
        if not self._done.wait(timeout):
            raise subprocess.TimeoutExpired(self.args, timeout or 0.0)
        assert self.returncode is not None
        return self.returncode

    def send_signal(self, sig: int) -> None:
        """Signal the worker through the server, its parent: only it knows whether the pid is
        still this worker's (not reaped yet), so a recycled pid is never hit."""
        if self.returncode is None:
            self._server.signal(self.pid, sig)

    def kill(self) -> None:
        self.send_signal(signal.SIGKILL)

    def terminate(self) -> None:
        self.send_signal(signal.SIGTERM)


class _Server:
    def __init__(self) -> None:
        self.log = os.path.join(tempfile.mkdtemp(prefix="warm-"), "server.log")
        with open(self.log, "wb") as log:
            self.proc = subprocess.Popen(
                [sys.executable, os.path.abspath(__file__)],
                stdin=subprocess.PIPE, stdout=subprocess.PIPE, stderr=log,
                env=dict(os.environ, PYTHONPATH=os.pathsep.join(sys.path)),
            )  # fmt: skip
        self.procs: dict[int, WarmProc] = {}
        self.early: dict[int, int] = {}  # exits heard before the spawn's answer was handled
        self.answers: queue.Queue[dict[str, Any]] = queue.Queue()
        self.lock = threading.Lock()  # the server's input and the tables above
        self.spawning = threading.Lock()  # one spawn (request, answer) at a time
        self.env = import_time_env(dict(os.environ))
        self.reader = threading.Thread(target=self._read, name="warm-server-reader", daemon=True)
        self.reader.start()

    def _read(self) -> None:
        assert self.proc.stdout is not None
        with self.proc.stdout as answers:
            for line in answers:
                msg = json.loads(line)
                if "exited" in msg:
                    with self.lock:
                        p = self.procs.pop(msg["exited"], None)
                        if p is None:
                            self.early[msg["exited"]] = msg["code"]
                    if p is not None:
                        p._exited(msg["code"])
                else:
                    self.answers.put(msg)
        # the server is gone (it kills its workers when its input ends; if it died, do it here)
        with self.lock:
            left, self.procs = list(self.procs.values()), {}
        for p in left:
            with contextlib.suppress(ProcessLookupError):
                os.kill(p.pid, signal.SIGKILL)  # orphaned: no server left to ask
            p._exited(-signal.SIGKILL)
        self.answers.put({"error": "the warm server exited"})

    def _send(self, msg: dict[str, Any]) -> None:
        assert self.proc.stdin is not None
        with self.lock:
            self.proc.stdin.write((json.dumps(msg) + "\n").encode())
            self.proc.stdin.flush()

    def signal(self, pid: int, sig: int) -> None:
        try:
            self._send({"signal": pid, "sig": int(sig)})
        except (OSError, ValueError):  # the server is gone: its workers are orphans, signal directly
            with contextlib.suppress(ProcessLookupError):
                os.kill(pid, sig)

    def spawn(self, argv: list[str], env: dict[str, str], log: str, timeout: float = 120.0) -> WarmProc:
        changed = sorted(k for k in self.env.keys() | import_time_env(env).keys() if self.env.get(k) != env.get(k))
        if changed:
            raise ValueError(
                f"{changed} differ from the warm server's environment and are read when a library "
                "loads: a forked worker would not see them; run these ranks with warm=False"
            )
        with self.spawning:  # the first answer waits for the server's imports: long on a loaded box
            self._send({"argv": argv, "env": env, "log": log})
            try:
                msg = self.answers.get(timeout=timeout)
            except queue.Empty:
                self.close()  # its late answer would be taken for the next spawn's
                raise RuntimeError(f"the warm server did not answer within {timeout:.0f}s") from None
        if "pid" not in msg:
            raise RuntimeError(f"the warm server could not start {argv}: {msg.get('error')}; {self.log_tail()}")
        p = WarmProc(msg["pid"], argv, self)
        with self.lock:
            self.procs[p.pid] = p
            code = self.early.pop(p.pid, None)
        if code is not None:
            p._exited(code)
        return p

    def log_tail(self) -> str:
        try:
            with open(self.log, errors="replace") as f:
                return f.read()[-2000:]
        except OSError:
            return ""

    def close(self) -> None:
        if self.proc.stdin is not None:
            with contextlib.suppress(OSError):
                self.proc.stdin.close()
        try:
            self.proc.wait(timeout=30)
        except subprocess.TimeoutExpired:
            self.proc.kill()  # our own child, by its pid
            self.proc.wait()
        self.reader.join(timeout=10)  # it closes the answer pipe at its end


_server: _Server | None = None
_server_lock = threading.Lock()


def spawn(argv: list[str], env: dict[str, str], log: str) -> WarmProc:
    """Fork ``python argv[0] argv[1:]`` (a worker script) from this process's warm server with
    environment ``env`` (complete, as ``Popen(env=)``) and stdout/stderr into ``log``."""
    global _server
    with _server_lock:
        if _server is None or _server.proc.poll() is not None:
            _server = _Server()
            atexit.register(close)
        server = _server
    return server.spawn(argv, env, log)


def close() -> None:
    """Stop this process's warm server (idempotent): its workers still running are killed."""
    global _server
    with _server_lock:
        server, _server = _server, None
    if server is not None:
        server.close()


if __name__ == "__main__":
    serve()
