"""The growth run's case (``growth.py``): one state, in its own process, asyncckpt and the
machine's limits for the same bytes measured round-robin, so that a noisy neighbour slows
every figure and its limit alike.

Saves (``Checkpointer(root)`` with its defaults, the public API only): a warm-up save and one
more under :class:`measure.PeakMemory` (the peak extra RSS of save, the staging buffer
included), then ``repeats`` rounds of: the memcpy of every tensor into preallocated tensors
(at the default torch thread count and at 1 thread; the limit is the faster median), one
save (blocking: until ``save()`` returns; durable: until ``handle.result()`` does), the
raw O_DIRECT write + fsync of the same number of bytes (:class:`limits.Limits`, its file
image and copy targets bounded so that an 8 GiB state's limits fit beside the state and the
staging buffer). Every step but the last is removed, untimed, after its save.

Loads, after ``close()`` and after every tensor of the live state was changed: one cold
``load(root, step, into=state)`` under ``PeakMemory``, checked bit-exact against checksums
taken before the saves, then ``repeats`` rounds of: the raw cold read of the raw file, the raw
warm read, a cold load, a warm load (cold: the files' pages evicted first; each warm read
right after its cold one, so that a state too large for two copies in the page cache still
reads warm).

The cyclic garbage collector's passes are recorded through ``gc.callbacks`` for the whole
case and counted per window: during ``save()`` (the caller's critical path), from its return
until durable, and during each ``load()``.
"""

from __future__ import annotations

import os
import shutil
import time
from typing import Any

import torch
from limits import Limits
from measure import GcPasses, PeakMemory, drop_cache, fsync_dir, summary
from states import StateSpec, build_state, checksums, describe, mutate

PAGE = 4096


def log(msg: str) -> None:
    print(f"[{time.strftime('%H:%M:%S')}] {msg}", flush=True)


def _gc_summary(windows: list[dict[str, Any]]) -> dict[str, Any]:
    """Per-sample GC windows as summaries (passes and seconds), every sample kept."""
    return {
        "passes": summary(w["passes"] for w in windows),
        "total_s": summary(w["total_s"] for w in windows),
        "max_s": summary(w["max_s"] for w in windows),
        "full_passes": summary(w["by_generation"]["2"] for w in windows),
    }


# ---------------------------------------------------------------------- the case
def _shard_bytes(step_dir: str) -> int:
    """Bytes of the step's tensor files (``*.safetensors``: the on-disk format, README)."""
    return sum(e.stat().st_size for e in os.scandir(step_dir) if e.name.endswith(".safetensors"))


def _remove(step_dir: str) -> None:
    shutil.rmtree(step_dir, ignore_errors=True)
    fsync_dir(os.path.dirname(step_dir))


def _timed_memcpy(lim: Limits, threads: int) -> float:
    default = torch.get_num_threads()
    torch.set_num_threads(threads)
    try:
        return lim.memcpy()
    finally:
        torch.set_num_threads(default)


def run_state(
    spec: StateSpec, scratch: str, repeats: int, image_bytes: int, copy_bytes: int, timeout: float = 3600.0
) -> dict[str, Any]:
    """Every figure of ``spec``'s state and its limits (see the module docstring)."""
    import asyncckpt

    out: dict[str, Any] = {"state": spec.name, "spec": spec.to_json(), "status": "ok", "repeats": repeats}
    root = os.path.join(scratch, "root")
    state = build_state(spec)
    out["state_info"] = describe(state)
    out["asyncckpt_file"] = asyncckpt.__file__  # (growth.py --asyncckpt: which checkout ran)
    log(f"{spec.name}: checksums, limit buffers")
    ref = checksums(state)
    info = out["state_info"]
    copy = max(min(copy_bytes, info["nbytes"] + 64 * info["n_tensors"]), info["largest_tensor_bytes"])
    lim = Limits(state, os.path.join(scratch, "raw"), image_bytes=image_bytes, copy_bytes=copy)
    out["limits_buffers"] = {"file_image_bytes": lim.image, "copy_target_bytes": copy}
    threads = list(dict.fromkeys((torch.get_num_threads(), 1)))
    for n in threads:  # warm-ups: the copy targets' pages, the first file
        _timed_memcpy(lim, n)
    lim.write(direct=True)
    ck = asyncckpt.Checkpointer(root)
    step = 0

    def step_dir(s: int) -> str:
        return os.path.join(os.fspath(ck.root), f"step_{s:08d}")

    with GcPasses() as gcp:

        def one_save() -> dict[str, Any]:
            nonlocal step
            step += 1
            c0, t0 = time.thread_time(), time.perf_counter()
            handle = ck.save(step, state)
            t1, c1 = time.perf_counter(), time.thread_time()
            info = handle.result(timeout=timeout)
            t2 = time.perf_counter()
            st = info.statistics
            stats = None
            if st is not None:
                keys = ("staging_s", "wait_s", "write_s", "fsync_s", "commit_s", "total_s", "writer_cpu_s", "direct_io",
                        "prepare_s", "prepare_cpu_s")  # fmt: skip
                stats = {k: getattr(st, k, None) for k in keys}  # (prepare_*: None from an asyncckpt without them)
            return {
                "step": step,
                "blocking_s": t1 - t0,
                "blocking_cpu_s": c1 - c0,
                "durable_s": t2 - t0,
                "stats": stats,
                "gc_save": gcp.window(t0, t1),
                "gc_to_durable": gcp.window(t1, t2),
            }

        try:
            log(f"{spec.name}: warm-up save + one more (peak memory)")
            with PeakMemory() as pm:
                first = one_save()
                _remove(step_dir(first["step"]))
                second = one_save()
            out["save_memory"] = pm.to_json()
            shard = _shard_bytes(step_dir(second["step"]))
            out["shard_bytes"] = shard
            out["staging_buffer_bytes"] = -(-shard // PAGE) * PAGE  # laid out like the shard (README)
            _remove(step_dir(second["step"]))
            out["first_save"] = first
            log(f"{spec.name}: {repeats} rounds of memcpy, save, raw O_DIRECT write")
            saves, copies, writes = [], {str(n): [] for n in threads}, []
            for i in range(repeats):
                for n in threads:
                    copies[str(n)].append(_timed_memcpy(lim, n))
                saves.append(one_save())
                if i < repeats - 1:
                    _remove(step_dir(saves[-1]["step"]))
                writes.append(lim.write(direct=True))
            last = saves[-1]["step"]
        finally:
            ck.close()
        by_threads = {n: summary(v) for n, v in copies.items()}
        best = min(by_threads, key=lambda k: by_threads[k]["median"])
        out["memcpy"] = {**by_threads[best], "threads": int(best)}
        out["memcpy_by_threads"] = by_threads
        out["write_direct"] = summary(writes)
        out["saves"] = saves
        out["blocking"] = summary(s["blocking_s"] for s in saves)
        out["durable"] = summary(s["durable_s"] for s in saves)
        out["staging"] = summary(s["stats"]["staging_s"] for s in saves if s["stats"])
        out["write_phase"] = summary(s["stats"]["write_s"] for s in saves if s["stats"])
        out["blocking_cpu"] = summary(s["blocking_cpu_s"] for s in saves)
        for k in ("prepare_s", "prepare_cpu_s"):  # the walk, plan and tree JSON, measured inside save()
            got = [s["stats"][k] for s in saves if s["stats"] and s["stats"].get(k) is not None]
            out[k.removesuffix("_s")] = summary(got) if got else None
        out["direct_io"] = all(s["stats"] and s["stats"]["direct_io"] for s in saves)
        out["gc_save"] = _gc_summary([s["gc_save"] for s in saves])
        out["gc_to_durable"] = _gc_summary([s["gc_to_durable"] for s in saves])

        # every tensor changed, so the load has to bring the saved bytes back
        mutate(state)
        where = [step_dir(last)]

        def one_load(cold: bool) -> tuple[float, dict[str, Any]]:
            if cold:
                drop_cache(where)
            t0 = time.perf_counter()
            asyncckpt.load(root, last, into=state)
            t1 = time.perf_counter()
            return t1 - t0, gcp.window(t0, t1)

        log(f"{spec.name}: load(into=) cold, peak memory")
        drop_cache(where)
        with PeakMemory() as pm:
            first_load = one_load(cold=True)
        out["load_memory"] = pm.to_json()
        out["first_load_cold_s"] = first_load[0]
        bit_exact = checksums(state) == ref
        log(f"{spec.name}: {repeats} rounds of raw cold read, cold load, raw warm read, warm load")
        reads_cold, reads_warm, cold, warm = [], [], [], []
        for _ in range(repeats):  # each warm read right after its cold one: a large state's files evict each other
            reads_cold.append(lim.read(cold=True))
            reads_warm.append(lim.read(cold=False))
            cold.append(one_load(cold=True))
            warm.append(one_load(cold=False))
        out["read_cold"] = summary(reads_cold)
        out["read_warm"] = summary(reads_warm)
        out["read_verified"] = lim.verify_read()
        out["load_cold"] = summary(t for t, _ in cold)
        out["load_warm"] = summary(t for t, _ in warm)
        out["gc_load_cold"] = _gc_summary([first_load[1], *(w for _, w in cold)])
        out["gc_load_warm"] = _gc_summary([w for _, w in warm])
        out["load_bit_exact"] = bit_exact and checksums(state) == ref
    lim.close()
    return out


def run_case(spec: StateSpec, scratch: str, repeats: int, image_bytes: int, copy_bytes: int) -> dict[str, Any]:
    """:func:`run_state` on a fresh scratch directory (removed after); its wall time added."""
    t0 = time.perf_counter()
    log(f"=== {spec.name}")
    os.makedirs(scratch, exist_ok=True)
    try:
        res = run_state(spec, scratch, repeats, image_bytes, copy_bytes)
    finally:
        shutil.rmtree(scratch, ignore_errors=True)
    res["case_wall_s"] = time.perf_counter() - t0
    return res
