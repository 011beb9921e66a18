"""Real kernel faults under 4 gloo ranks (real processes): a tmpfs that fills up (ENOSPC),
a loop-mounted ext4 remounted read-only between saves (EROFS), and RLIMIT_FSIZE on one
rank (EFBIG). Nothing in the library is replaced.

For each fault every rank must raise ``SaveError`` naming the failed rank(s), the errno and
the path within ``timeout + 2 s``; nothing is committed; the previous checkpoint is still
the latest; disk usage (statvfs) is back at the pre-save level once the leader removed the
failed attempt; and the next save after removing the fault commits.

One 4-rank job runs all three scenarios in turn (one torch start-up instead of three); the
mounts need root and are skipped, with reasons starting ``needs root/mount:``, elsewhere.
The EFBIG scenario needs no root (without it, it runs without the statvfs check).
"""

from __future__ import annotations

import errno
import json
import os
import shutil
import subprocess
import time
from collections.abc import Iterator
from pathlib import Path
from typing import Any

import pytest
from _ranks import free_port, log_tail, run_ranks

WORKER = str(Path(__file__).parent / "support" / "_fault_worker.py")
WORLD = 4
TIMEOUT = 10.0  # the Checkpointer's save timeout in the ranks
SKIP = "needs root/mount:"


def _run(*cmd: str) -> subprocess.CompletedProcess[str]:
    return subprocess.run(cmd, capture_output=True, text=True, timeout=60)


def _is_mount(path: Path) -> bool:
    return os.path.ismount(path)


def _umount(path: Path) -> None:
    if _is_mount(path) and _run("umount", str(path)).returncode != 0:
        _run("umount", "-l", str(path))


class Mounts:
    """The file systems of this module; what could not be made is a skip reason."""

    def __init__(self, base: Path) -> None:
        self.base = base
        self.made: list[Path] = []
        self.skip: dict[str, str] = {}
        self.params: dict[str, Any] = {}

    def tmpfs(self, name: str, size: str) -> Path | None:
        mnt = self.base / name
        mnt.mkdir()
        r = _run("mount", "-t", "tmpfs", "-o", f"size={size},mode=0755", "tmpfs", str(mnt))
        if r.returncode != 0:
            self.skip[name] = f"{SKIP} cannot mount a tmpfs: {r.stderr.strip()}"
            return None
        self.made.append(mnt)
        return mnt

    def ext4(self, name: str, size: str) -> Path | None:
        img, mnt = self.base / f"{name}.img", self.base / name
        mnt.mkdir()
        if shutil.which("mkfs.ext4") is None:
            self.skip[name] = f"{SKIP} mkfs.ext4 is missing (apt-get install e2fsprogs)"
            return None
        for cmd in (("truncate", "-s", size, str(img)), ("mkfs.ext4", "-q", "-F", str(img))):
            r = _run(*cmd)
            if r.returncode != 0:
                self.skip[name] = f"{SKIP} {cmd[0]} failed: {r.stderr.strip()}"
                return None
        r = _run("mount", "-o", "loop", str(img), str(mnt))
        if r.returncode != 0:
            self.skip[name] = f"{SKIP} cannot loop-mount an ext4 image: {r.stderr.strip()}"
            return None
        self.made.append(mnt)
        return mnt

    def cleanup(self) -> None:
        for mnt in reversed(self.made):
            _umount(mnt)  # a loop device set up by `mount -o loop` detaches itself here


@pytest.fixture(scope="module")
def kernel_run(tmp_path_factory: pytest.TempPathFactory) -> Iterator[tuple[dict[int, dict[str, Any]], Mounts, Path]]:
    base = tmp_path_factory.mktemp("kfaults")
    m = Mounts(base)
    scenarios = []
    try:
        root_ok = os.geteuid() == 0
        if not root_ok:
            m.skip["enospc"] = m.skip["erofs"] = f"{SKIP} mounting needs root (euid {os.geteuid()})"
        else:
            full = m.tmpfs("enospc", "16m")
            if full is not None:
                # step 2 writes 4 x 6 MiB into 16 MiB
                m.params["enospc"] = {"root": str(full / "ck"), "mount": str(full), "big_numel": 1536 * 1024}
                scenarios.append("enospc")
            ro = m.ext4("erofs", "64M")
            if ro is not None:
                m.params["erofs"] = {"root": str(ro / "ck"), "mount": str(ro)}
                scenarios.append("erofs")
        small = m.tmpfs("efbig", "8m") if root_ok else None
        if small is not None:
            m.params["efbig"] = {"root": str(small / "ck"), "mount": str(small), "rank": 2}
        else:
            m.params["efbig"] = {"root": str(base / "efbig_ck"), "mount": None, "rank": 2}
        scenarios.append("efbig")
        for p in m.params.values():
            p["timeout"] = TIMEOUT
        results = _run_ranks(base, scenarios, m.params)
        yield results, m, base
    finally:
        m.cleanup()


def _run_ranks(base: Path, scenarios: list[str], params: dict[str, Any], deadline: float = 100.0) -> dict[int, Any]:
    out = base / "result"
    params_path = base / "params.json"
    params_path.write_text(json.dumps(params))
    port = free_port()
    args = [",".join(scenarios), str(WORLD), str(port), str(out), str(params_path)]
    t0 = time.monotonic()
    hung = run_ranks(lambda r: [WORKER, "rank", args[0], str(r), *args[1:]], WORLD, base, deadline)
    print(f"\n{WORLD} ranks ran {scenarios} in {time.monotonic() - t0:.1f}s")
    results = {}
    for r in range(WORLD):
        f = Path(f"{out}.{r}.json")
        log = log_tail(base, r)
        assert f.exists(), f"rank {r} wrote no result:\n{log}"
        results[r] = json.loads(f.read_text())
    assert not hung, f"ranks {hung} still running after {deadline}s"
    return results


def _scenario(kernel_run: tuple[dict[int, Any], Mounts, Path], name: str) -> tuple[dict[int, Any], dict[str, Any]]:
    results, m, _ = kernel_run
    if name in m.skip:
        pytest.skip(m.skip[name])
    per_rank = {r: res.get(name) for r, res in results.items()}
    for r, res in per_rank.items():
        assert res is not None, f"rank {r} did not run {name}"
        assert "crash" not in res, f"rank {r}: {res['crash']}"
    return per_rank, m.params[name]


def _assert_failed_cleanly(
    per_rank: dict[int, Any], params: dict[str, Any], err: int, failed: list[int] | None
) -> dict[str, Any]:
    root = params["root"]
    first = per_rank[0]["error"]
    assert first is not None and first["type"] == "SaveError", first
    failures = first["failures"]
    assert failures, first
    if failed is not None:
        assert sorted(int(r) for r in failures) == failed, failures
    for r, f in failures.items():
        assert f["errno"] == err, (r, f)
        assert f["path"] and f["path"].startswith(os.path.join(root, "step_00000002.tmp-")), (r, f)
        assert errno.errorcode[err] in first["msg"] and f"rank {r}" in first["msg"], first["msg"]
    for r, res in per_rank.items():
        e = res["error"]
        assert e["type"] == "SaveError" and e["step"] == 2, (r, e)
        assert e["failures"] == failures, f"rank {r} was told something else: {e}"  # the same verdict everywhere
        assert res["elapsed"] < TIMEOUT + 2, (r, res["elapsed"])
        assert res["flush_error"]["failures"] == failures, (r, res.get("flush_error"))
        assert res["latest_after_failure"] == 1, (r, res)  # no marker: the previous checkpoint is the latest
        assert res["next"] == 3 and res["steps"] == [1, 3], (r, res)  # the next save commits
        assert res["loaded_extra"] == {"rank": r, "step": 3}
    lead = per_rank[0]
    assert lead["listing_after_failure"] == ["step_00000001"], lead["listing_after_failure"]
    assert lead["listing_end"] == ["step_00000001", "step_00000003"], lead["listing_end"]
    if params.get("mount"):
        # the leader removed the failed attempt: free blocks and inodes are back where they were
        assert lead["usage_after"] == lead["usage_before"], (lead["usage_before"], lead["usage_after"])
    usage = f"; statvfs (bfree, ffree) before/after: {lead.get('usage_before')} {lead.get('usage_after')}"
    elapsed = ", ".join(f"{r}: {res['elapsed']:.2f}s" for r, res in sorted(per_rank.items()))
    print(f"\n{first['msg']}\n  elapsed per rank: {elapsed}{usage if params.get('mount') else ''}")
    return failures


@pytest.mark.needs_root
@pytest.mark.timeout(150)
def test_real_enospc_on_a_full_tmpfs_fails_every_rank_and_frees_the_space(kernel_run: Any) -> None:
    per_rank, params = _scenario(kernel_run, "enospc")
    _assert_failed_cleanly(per_rank, params, errno.ENOSPC, None)


@pytest.mark.needs_root
@pytest.mark.timeout(150)
def test_erofs_after_a_read_only_remount_fails_every_rank(kernel_run: Any) -> None:
    per_rank, params = _scenario(kernel_run, "erofs")
    failures = _assert_failed_cleanly(per_rank, params, errno.EROFS, [0])
    assert failures["0"]["exc_type"] in ("OSError", "PermissionError"), failures  # the leader's mkdir of the attempt


@pytest.mark.timeout(150)
def test_efbig_on_one_rank_fails_every_rank_naming_it(kernel_run: Any) -> None:
    per_rank, params = _scenario(kernel_run, "efbig")
    failures = _assert_failed_cleanly(per_rank, params, errno.EFBIG, [2])
    assert failures["2"]["path"].endswith("rank00002.safetensors"), failures
