"""Finding the ranks: the process group, its c10d store, and agreements made at the call.

Everything here runs on the caller's thread and uses only the c10d store (``set`` /
``wait`` with a deadline / ``get``), never a collective, so it cannot interleave with the
training loop's collectives on the same group.
"""

from __future__ import annotations

import errno
import json
import os
import socket
import threading
import time
import uuid
from collections.abc import Callable
from dataclasses import dataclass
from datetime import timedelta
from typing import Any

from .. import _errors
from .._errors import CoordinationLost
from ..format._checksum import crc32c
from ._coordination import CALL_S, CLIENT_S, is_store_timeout, lost_message

_count_lock = threading.Lock()
_instances: dict[str, int] = {}


@dataclass
class DistContext:
    """This process's place among the ranks that save together.

    ``store`` is the job's store (used on the caller's thread for short exchanges);
    ``connect()`` opens a new client of the same store for the writer's blocking waits.
    """

    store: Any
    rank: int
    world_size: int
    prefix: str
    connect: Callable[..., Any]

    def wait_get(self, key: str, timeout: float) -> Any:
        """Rank 0's value of ``key``. Raises ``TimeoutError`` when rank 0 is alive but did not
        answer in ``timeout`` s, :class:`CoordinationLost` at once when the store is gone."""
        t0 = time.monotonic()
        deadline = t0 + timeout
        while True:
            # slices of at most CALL_S: a store that goes away is noticed between them
            remaining = deadline - time.monotonic()
            try:
                self.store.wait([key], timedelta(seconds=min(max(remaining, 0.01), CALL_S)))
                return json.loads(self.store.get(key))
            except Exception as e:
                if not is_store_timeout(e):
                    raise CoordinationLost(lost_message(e)) from e
                if time.monotonic() >= deadline:
                    waited = time.monotonic() - t0
                    raise TimeoutError(
                        f"asyncckpt: rank 0 did not answer {key!r} within {timeout:.0f}s "
                        f"(waited {waited:.1f}s: {str(e).splitlines()[0] if str(e) else type(e).__name__})"
                    ) from e

    def share(self, key: str, compute: Callable[[], Any] | None, timeout: float) -> Any:
        """Rank 0 passes ``compute`` and publishes its JSON result; every rank returns it."""
        full = f"{self.prefix}/{key}"
        if self.rank == 0:
            assert compute is not None
            value = compute()
            try:
                self.store.set(full, json.dumps(value))
            except Exception as e:
                raise CoordinationLost(lost_message(e)) from e
            return value
        return self.wait_get(full, timeout)

    def start_key(self, root: str) -> str:
        """The store key of this process's next Checkpointer of ``root`` (its construction's
        exchanges live under it): every rank must build the same Checkpointers in the same
        order, so the n-th one of a root has the same key on every rank."""
        tag = f"{crc32c(os.path.abspath(root).encode()):08x}"
        with _count_lock:
            n = _instances[tag] = _instances.get(tag, 0) + 1
        return f"asyncckpt/ctor/{tag}/{n}"

    def agree_at_start(
        self, key: str, committed: list[int], timeout: float, failure: BaseException | None = None
    ) -> tuple[str, list[int]]:
        """Agree on this Checkpointer's key namespace and on the committed steps (rank 0's view).

        ``failure`` is rank 0's start-up failure (the root owned by another writer, not
        writable, ...): it is shared too, and every rank raises the same error type with the
        same message here, so no rank waits for a Checkpointer that will never exist.
        ``key``: :meth:`start_key`'s (Checkpointers are matched across ranks by root and by
        creation order, so every rank must build the same Checkpointers in the same order, as
        with any collective).
        """
        if self.rank == 0:
            ns = uuid.uuid4().hex[:16]
            doc: dict[str, Any] = {"ns": ns, "committed": committed, "world": self.world_size}
            if failure is not None:
                doc["failure"] = _enc_start_failure(failure)
            self.store.set(key, json.dumps(doc))
            if failure is not None:
                raise failure
            self.prefix = f"asyncckpt/{ns}"
            return ns, committed
        got = self.wait_get(key, timeout)
        if got.get("failure") is not None:
            raise _dec_start_failure(got["failure"])
        if got["world"] != self.world_size:
            raise ValueError(f"rank 0 has a world of {got['world']} ranks, this rank {self.world_size}")
        self.prefix = f"asyncckpt/{got['ns']}"
        return got["ns"], list(got["committed"])


def _enc_start_failure(e: BaseException) -> dict[str, Any]:
    err = e.errno if isinstance(e, OSError) else None
    return {"type": type(e).__name__, "message": str(e) if not isinstance(e, OSError) else e.strerror or str(e),
            "errno": err, "path": getattr(e, "filename", None) if isinstance(e, OSError) else None}


def _dec_start_failure(d: dict[str, Any]) -> BaseException:
    """Rank 0's start-up failure as the same exception type here where it is ours."""
    cls = getattr(_errors, str(d.get("type")), None)
    msg = f"{d.get('message')} (reported by rank 0)"
    if cls is _errors.RootNotWritableError:
        return _errors.RootNotWritableError(d.get("errno") or errno.EACCES, msg, d.get("path"))
    if cls is _errors.CheckpointReadError and d.get("errno") is not None:
        return _errors.CheckpointReadError(d["errno"], msg, d.get("path"))
    if isinstance(cls, type) and issubclass(cls, _errors.CheckpointError) and cls.__init__ is Exception.__init__:
        return cls(msg)
    if d.get("errno") is not None:
        return OSError(d["errno"], f"{d.get('type')}: {msg}", d.get("path"))
    if d.get("type") == "ValueError":
        return ValueError(msg)
    return _errors.CheckpointError(f"{d.get('type')}: {msg}")


def _client_factory(store: Any, prefix: str, timeout_s: float) -> Callable[..., Any]:
    """New, independent clients of the TCPStore behind ``store`` (keys under ``prefix``).

    A TCP probe comes first: TCPStore's own connect retries a refused connection for its
    whole timeout, but after the store host died a connect must fail at once. Each client's
    own timeout (handshake and every non-wait call) is at most :data:`CLIENT_S`; waits are
    sliced by the caller. Falls back to the shared ``store`` itself when it is not backed
    by a TCPStore.
    """
    import torch.distributed as dist

    base = store
    while isinstance(base, dist.distributed_c10d.PrefixStore):
        base = base.underlying_store
    tcp = getattr(dist, "TCPStore", None)
    if tcp is None or not isinstance(base, tcp):
        return lambda probe=True: dist.distributed_c10d.PrefixStore(prefix, store)
    host, port = base.host, base.port

    def connect(probe: bool = True) -> Any:
        # TCPStore's connect retries a refused connection until its timeout (it waits for a
        # server still starting); ours is long up, so a refusal means the host is gone.
        # ``probe=False`` where the store is known up: a probe (connected, closed without a
        # handshake) while other clients connect held their connects 5 s on torch 2.13's server
        if probe:
            socket.create_connection((host, port), timeout=min(timeout_s, CALL_S)).close()
        per_call = timedelta(seconds=min(timeout_s, CLIENT_S))
        client = tcp(host, port, is_master=False, timeout=per_call, wait_for_workers=False)
        return dist.distributed_c10d.PrefixStore(prefix, client)

    return connect


def resolve(process_group: Any, timeout_s: float = 600.0) -> DistContext | None:
    """The ranks to coordinate with: ``process_group``, else the default world if
    ``torch.distributed`` is initialized, else ``None`` (single process)."""
    import torch.distributed as dist

    if process_group is None and not (dist.is_available() and dist.is_initialized()):
        return None
    if not dist.is_initialized():
        raise ValueError("process_group was given but torch.distributed is not initialized")
    store = dist.distributed_c10d._get_default_store()
    if process_group is None or process_group is dist.group.WORLD:
        connect = _client_factory(store, "asyncckpt-world/", timeout_s)
        return DistContext(store, dist.get_rank(), dist.get_world_size(), "", connect)
    name = getattr(process_group, "group_name", None) or "-".join(map(str, dist.get_process_group_ranks(process_group)))
    rank = dist.get_rank(process_group)
    if rank < 0:
        raise ValueError("this process is not a member of process_group")
    prefix = f"asyncckpt/group/{name}/"
    prefixed = dist.distributed_c10d.PrefixStore(prefix, store)
    return DistContext(
        prefixed, rank, dist.get_world_size(process_group), "", _client_factory(store, prefix, timeout_s)
    )
