"""The checkpointing methods under test, behind one small interface.

Each method saves a whole state dict for a step and can restore it in place into a
preallocated state of the same structure. ``save()`` returns after the method's
blocking part (what the training loop waits for); ``finish()`` makes the checkpoint
durable: it waits for background work and adds the fsyncs a method does not do itself
(DCP fsyncs its files but no directory; ``torch.save`` fsyncs nothing), so "durable" means
for every method what it means for asyncckpt: file data and directory entries on disk.
"""

from __future__ import annotations

import errno
import os
import resource
import shutil
from dataclasses import dataclass, field
from typing import Any

import torch
from measure import fsync_dir, fsync_tree
from states import copy_into


class Unsupported(Exception):
    """The method cannot run on this machine; the message says why."""


@dataclass
class Method:
    """Base class. ``restores`` names the restore variants :meth:`restore` accepts."""

    name: str
    label: str
    family: str
    is_async: bool = True
    restores: tuple[str, ...] = ()
    notes: list[str] = field(default_factory=list)

    def open(self, root: str, state: Any) -> None:
        self.root = root
        os.makedirs(root, exist_ok=True)

    def path(self, step: int) -> str:
        raise NotImplementedError

    def save(self, step: int, state: Any) -> Any:
        raise NotImplementedError

    def done(self, pending: Any) -> bool:
        return True

    def finish(self, pending: Any) -> dict[str, Any] | None:
        """Wait until the save of ``pending`` is durable; may return library statistics."""
        return None

    def restore(self, variant: str, step: int, state: Any) -> None:
        raise Unsupported(f"{self.name} has no restore variant {variant!r}")

    def remove(self, step: int) -> None:
        p = self.path(step)
        if os.path.isdir(p):
            shutil.rmtree(p, ignore_errors=True)
        elif os.path.exists(p):
            os.unlink(p)

    def close(self) -> None:
        pass


# ---------------------------------------------------------------------- torch.save
class TorchSave(Method):
    def __init__(self) -> None:
        super().__init__(
            "torch.save",
            "torch.save + fsync",
            "torch",
            is_async=False,
            restores=("torch.load", "torch.load(mmap)"),
        )

    def path(self, step: int) -> str:
        return os.path.join(self.root, f"step_{step:08d}.pt")

    def save(self, step: int, state: Any) -> Any:
        with open(self.path(step), "wb") as f:
            torch.save(state, f)
            f.flush()
            os.fsync(f.fileno())
        fsync_dir(self.root)
        return None

    def restore(self, variant: str, step: int, state: Any) -> None:
        if variant == "torch.load":
            loaded = torch.load(self.path(step), map_location="cpu", weights_only=True)
        elif variant == "torch.load(mmap)":
            loaded = torch.load(self.path(step), map_location="cpu", weights_only=True, mmap=True)
        else:
            super().restore(variant, step, state)
        copy_into(state, loaded)
        del loaded


# ---------------------------------------------------------------------- DCP
def _dcp() -> Any:
    try:
        import torch.distributed.checkpoint as dcp
    except ImportError as e:  # pragma: no cover - torch built without distributed
        raise Unsupported(f"torch.distributed.checkpoint is not importable: {e}") from e
    return dcp


class DcpSave(Method):
    """``dcp.save`` with a ``FileSystemWriter`` (``sync_files=True``) of ``thread_count`` threads."""

    def __init__(self, thread_count: int) -> None:
        super().__init__(
            f"dcp.save[t{thread_count}]",
            f"dcp.save (FileSystemWriter, {thread_count} thread{'s' if thread_count > 1 else ''})",
            "dcp",
            is_async=False,
            restores=("dcp.load",) if thread_count == 1 else (),
        )
        self.thread_count = thread_count

    def path(self, step: int) -> str:
        return os.path.join(self.root, f"step_{step:08d}")

    def save(self, step: int, state: Any) -> Any:
        dcp = _dcp()
        writer = dcp.FileSystemWriter(self.path(step), thread_count=self.thread_count, sync_files=True)
        dcp.save(state, storage_writer=writer, no_dist=True)
        fsync_tree(self.path(step))
        return None

    def restore(self, variant: str, step: int, state: Any) -> None:
        if variant != "dcp.load":
            super().restore(variant, step, state)
        _dcp().load(state, checkpoint_id=self.path(step), no_dist=True)


@dataclass
class _DcpPending:
    future: Any
    path: str


class DcpAsync(Method):
    """``dcp.async_save`` in one of its configurations.

    ``config``:
      * ``default``: ``async_save(checkpoint_id=...)`` - a fresh ``DefaultStager`` (plain
        CPU copy) and a default writer (1 thread) per save;
      * ``writer-t2``: a ``FileSystemWriter(thread_count=2)`` that stages (copies) itself;
      * ``writer-cached``: one ``FileSystemWriter(cache_staged_state_dict=True)`` reused for
        every save, so the staging copy goes into the same buffers each time;
      * ``stager-cached``: one ``DefaultStager`` reused for every save (it caches its staging
        storages per source storage), pinned + non-blocking copies when CUDA is present;
      * ``stager-bg``: the same with ``use_async_staging=True``: the copy runs on a stager
        thread and the caller may mutate only after ``staging_completion`` - that wait is
        counted as blocking;
      * ``process``: ``AsyncCheckpointerType.PROCESS`` without a process group;
      * ``process-gloo``: ``AsyncCheckpointerType.PROCESS`` with a 1-rank gloo process group
        this benchmark creates (the checkpoint daemon process needs one).
    """

    def __init__(self, config: str) -> None:
        super().__init__(f"dcp.async_save[{config}]", f"dcp.async_save ({config})", "dcp", is_async=True)
        self.config = config
        self._writer: Any = None
        self._stager: Any = None
        self._own_pg = False

    def path(self, step: int) -> str:
        return os.path.join(self.root, f"step_{step:08d}")

    def open(self, root: str, state: Any) -> None:
        super().open(root, state)
        dcp = _dcp()
        cuda = torch.cuda.is_available() and any(isinstance(t, torch.Tensor) and t.is_cuda for t in _leaves(state))
        if self.config == "writer-cached":
            self._writer = dcp.FileSystemWriter(
                self.path(0), thread_count=1, sync_files=True, cache_staged_state_dict=True
            )
        elif self.config in ("stager-cached", "stager-bg"):
            from torch.distributed.checkpoint.staging import DefaultStager, StagingOptions

            opts = StagingOptions(
                use_pinned_memory=cuda,
                use_shared_memory=False,
                use_async_staging=self.config == "stager-bg",
                use_non_blocking_copy=cuda,
            )
            self._stager = DefaultStager(opts)
            if not cuda:
                self.notes.append("no CUDA: pinned memory and non-blocking copies are off (plain CPU copy)")
        elif self.config == "process-gloo":
            import torch.distributed as dist

            if not dist.is_available():
                raise Unsupported("torch.distributed is not available")
            if not dist.is_initialized():
                store_file = os.path.join(root, f".dcp-store-{os.getpid()}")
                dist.init_process_group("gloo", store=dist.FileStore(store_file, 1), rank=0, world_size=1)
                self._own_pg = True
            self.notes.append("1-rank gloo process group created by the benchmark (the daemon needs one)")
        elif self.config not in ("default", "writer-t2", "process"):
            raise ValueError(f"unknown DCP async config {self.config!r}")

    def save(self, step: int, state: Any) -> Any:
        dcp = _dcp()
        from torch.distributed.checkpoint.state_dict_saver import AsyncCheckpointerType

        path = self.path(step)
        kw: dict[str, Any] = {"checkpoint_id": path}
        if self.config == "default":
            kw["no_dist"] = True
        elif self.config == "writer-t2":
            kw["storage_writer"] = dcp.FileSystemWriter(path, thread_count=2, sync_files=True)
            kw["no_dist"] = True
        elif self.config == "writer-cached":
            kw["storage_writer"] = self._writer
            kw["no_dist"] = True
        elif self.config in ("stager-cached", "stager-bg"):
            kw["async_stager"] = self._stager
            kw["no_dist"] = True
        elif self.config == "process":
            kw["no_dist"] = True
            kw["async_checkpointer_type"] = AsyncCheckpointerType.PROCESS
        elif self.config == "process-gloo":
            kw["async_checkpointer_type"] = AsyncCheckpointerType.PROCESS
        try:
            res = dcp.async_save(state, **kw)
        except (ValueError, RuntimeError, AssertionError, OSError) as e:
            if self.config.startswith("process") or "accelerator" in str(e):
                raise Unsupported(_why(e)) from e
            raise
        if hasattr(res, "staging_completion"):  # AsyncSaveResponse: wait until mutation is safe
            res.staging_completion.result()
            return _DcpPending(res.upload_completion, path)
        return _DcpPending(res, path)

    def save_unsafe(self, step: int, state: Any) -> Any:
        """For ``stager-bg`` only: return right after ``async_save()`` (staging may still run)."""
        res = _dcp().async_save(state, checkpoint_id=self.path(step), async_stager=self._stager, no_dist=True)
        return _DcpPending(getattr(res, "upload_completion", res), self.path(step))

    def done(self, pending: Any) -> bool:
        return bool(pending.future.done())

    def finish(self, pending: Any) -> dict[str, Any] | None:
        try:
            pending.future.result()
        except (ValueError, RuntimeError, AssertionError, OSError) as e:
            if self.config.startswith("process"):
                raise Unsupported(_why(e)) from e
            raise
        fsync_tree(pending.path)
        return None

    def restore(self, variant: str, step: int, state: Any) -> None:
        if variant != "dcp.load":
            super().restore(variant, step, state)
        _dcp().load(state, checkpoint_id=self.path(step), no_dist=True)

    def close(self) -> None:
        if self._stager is not None:
            self._stager.close()
            self._stager = None
        if self.config.startswith("process"):
            _stop_dcp_daemon()
        if self._own_pg:
            import torch.distributed as dist

            if dist.is_initialized():
                dist.destroy_process_group()
            self._own_pg = False


def _why(e: BaseException) -> str:
    msg = f"{type(e).__name__}: {e}"
    if (isinstance(e, OSError) and e.errno == errno.EMFILE) or "Too many open files" in str(e):
        soft, hard = resource.getrlimit(resource.RLIMIT_NOFILE)
        msg += (
            f" - the process-based save passes every tensor storage to its daemon as file descriptors; "
            f"the open-files limit here is {soft} (hard {hard})"
        )
    return msg


def _stop_dcp_daemon() -> None:
    """Stop DCP's checkpoint daemon process (private API; best effort) so it cannot outlive the case."""
    try:
        from torch.distributed.checkpoint import _async_process_executor as ape
    except ImportError:
        return
    proc = getattr(ape, "_CHECKPOINT_PROCESS", None)
    if proc is None:
        return
    ape._CHECKPOINT_PROCESS = None
    child = getattr(proc, "_save_process", None)
    try:
        proc._send(ape._CheckpointSaveProcessControlOpts.TERMINATE)
    except (OSError, AttributeError, ValueError):
        pass
    if child is not None:
        child.join(timeout=10)
        if child.is_alive():
            child.terminate()
            child.join(timeout=5)


def _leaves(state: Any) -> list[Any]:
    if isinstance(state, dict):
        return [x for v in state.values() for x in _leaves(v)]
    if isinstance(state, (list, tuple)):
        return [x for v in state for x in _leaves(v)]
    return [state]


# ---------------------------------------------------------------------- asyncckpt
class Asyncckpt(Method):
    """``asyncckpt.Checkpointer`` with its defaults, or with ``huge_pages=True``."""

    def __init__(self, huge_pages: bool = False) -> None:
        super().__init__(
            "asyncckpt[huge]" if huge_pages else "asyncckpt",
            "asyncckpt (huge_pages=True)" if huge_pages else "asyncckpt (defaults)",
            "asyncckpt",
            is_async=True,
            restores=() if huge_pages else ("asyncckpt.load", "asyncckpt.load(verify=False)"),
        )
        self.huge_pages = huge_pages
        self._ck: Any = None

    def path(self, step: int) -> str:
        return os.path.join(self.root, f"step_{step:08d}")

    def open(self, root: str, state: Any) -> None:
        super().open(root, state)
        from asyncckpt import Checkpointer

        self._ck = Checkpointer(root, huge_pages=self.huge_pages)

    def save(self, step: int, state: Any) -> Any:
        return self._ck.save(step, state)

    def done(self, pending: Any) -> bool:
        return bool(pending.done())

    def finish(self, pending: Any) -> dict[str, Any] | None:
        info = pending.result()
        s = info.statistics
        if s is None:
            return None
        return {
            "wait_s": s.wait_s,
            "staging_s": s.staging_s,
            "write_s": s.write_s,
            "fsync_s": s.fsync_s,
            "commit_s": s.commit_s,
            "total_s": s.total_s,
            "writer_cpu_s": s.writer_cpu_s,
            "writer_cpu_s_per_gib": s.cpu_s_per_gib,
            "direct_io": s.direct_io,
        }

    def restore(self, variant: str, step: int, state: Any) -> None:
        import asyncckpt

        if variant == "asyncckpt.load":
            asyncckpt.load(self.root, step, into=state)
        elif variant == "asyncckpt.load(verify=False)":
            asyncckpt.load(self.root, step, into=state, verify=False)
        else:
            super().restore(variant, step, state)

    def close(self) -> None:
        if self._ck is not None:
            self._ck.close()
            self._ck = None


# ---------------------------------------------------------------------- registry
def all_methods(cuda_state: bool = False) -> list[Method]:
    """Every method, in report order (``process-gloo`` last: it leaves a daemon process)."""
    methods: list[Method] = [
        TorchSave(),
        DcpSave(1),
        DcpSave(2),
        DcpAsync("default"),
        DcpAsync("writer-t2"),
        DcpAsync("writer-cached"),
        DcpAsync("stager-cached"),
        DcpAsync("stager-bg"),
        Asyncckpt(),
        Asyncckpt(huge_pages=True),
        DcpAsync("process"),
        DcpAsync("process-gloo"),
    ]
    if cuda_state:
        # the writer-staged DCP variants copy with .cpu() one tensor at a time; keep the GPU run short
        methods = [m for m in methods if m.name not in ("dcp.save[t2]", "dcp.async_save[writer-t2]")]
    return methods


def method_names() -> list[str]:
    return ["limits", *(m.name for m in all_methods())]


def make_method(name: str) -> Method:
    for m in all_methods():
        if m.name == name:
            return m
    raise KeyError(f"unknown method {name!r}; known: {', '.join(method_names())}")
