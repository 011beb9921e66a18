"""Clean-up never follows a link out of the root (issue 9 C): a real racing process, real symlinks.

A leftover ``step_00000005.tmp-<hex>/sub/`` holds files; another process keeps swapping
``sub`` for a symlink to a canary directory outside the root and back (rename the directory
away, symlink in, unlink the link, rename it back) while this process runs the clean-up over
and over: ``Checkpointer`` construction (which removes leftovers), ``remove_tree`` itself, and
the ``asyncckpt gc`` command. The canary must come out with the same files and bytes. A
path-based walk (``lstat`` then ``listdir(path)``) deletes canary files within a second here.

One deterministic case swaps at the worst moment (right after the removal's ``lstat``). The
``gc`` race is a guard of the command's path (it runs the same ``remove_tree``): it did not
catch the earlier path-based walk in 3 s here, the in-process race and the deterministic case do.

``-s`` shows the figures: swaps done, clean-ups run, links met.
"""

from __future__ import annotations

import contextlib
import errno
import io
import os
import stat
import subprocess
import sys
import textwrap
import threading
import time
from collections import Counter
from pathlib import Path

import pytest
from _cli_util import run_cli

from asyncckpt import Checkpointer
from asyncckpt.roots.posix._osops import OsOps
from asyncckpt.roots.posix._remove_tree import remove_tree

RACE_S = 4.0
LEFTOVER = "step_00000005.tmp-00c0ffee"

SWAPPER = textwrap.dedent(
    """
    import os, sys, time
    root, canary, duration = sys.argv[1], sys.argv[2], float(sys.argv[3])
    lo = os.path.join(root, "LEFTOVER")
    sub, away = os.path.join(lo, "sub"), os.path.join(lo, "sub.away")
    swaps = errors = 0
    print("ready", flush=True)
    end = time.monotonic() + duration
    while time.monotonic() < end:
        try:
            # put the leftover back as a real tree whenever the clean-up removed it
            if os.path.islink(sub):
                os.unlink(sub)
            if os.path.isdir(away) and not os.path.lexists(sub):
                os.rename(away, sub)
            os.makedirs(sub, exist_ok=True)
            for i in range(4):
                f = os.path.join(sub, f"part{i}.bin")
                if not os.path.lexists(f):
                    with open(f, "wb") as fh:
                        fh.write(b"leftover")
            os.rename(sub, away)      # the directory away ...
            os.symlink(canary, sub)   # ... a link to the canary in its place
            swaps += 1
            hold = time.perf_counter() + 1e-4
            while time.perf_counter() < hold:  # 100 µs for a clean-up to walk into the link
                pass
            os.unlink(sub)            # and back
            os.rename(away, sub)
        except OSError:
            errors += 1
    print("swaps", swaps, "errors", errors, flush=True)
    """
).replace("LEFTOVER", LEFTOVER)


class CountingOps(OsOps):
    """The real OS calls, counting how often tree removal met a link where a directory was."""

    def __init__(self) -> None:
        self.links_met = 0  # a directory turned into a link between its lstat and its opening
        self.links_unlinked = 0  # a link seen by lstat: removed as a link
        self.lock = threading.Lock()

    def lstat_at(self, dir_fd: int, name: str) -> os.stat_result:
        st = super().lstat_at(dir_fd, name)
        if stat.S_ISLNK(st.st_mode):
            with self.lock:
                self.links_unlinked += 1
        return st

    def open_dir(self, name: str, dir_fd: int | None = None) -> int:
        try:
            return super().open_dir(name, dir_fd)
        except OSError as e:
            if e.errno in (errno.ELOOP, errno.ENOTDIR):
                with self.lock:
                    self.links_met += 1
            raise


def _snapshot(d: Path) -> dict[str, bytes]:
    return {str(p.relative_to(d)): p.read_bytes() for p in sorted(d.rglob("*")) if p.is_file()}


def _canary(tmp_path: Path) -> tuple[Path, dict[str, bytes]]:
    canary = tmp_path / "canary"
    (canary / "nested").mkdir(parents=True)
    for i in range(50):
        (canary / f"part{i}.bin").write_bytes(os.urandom(64) + bytes([i]))
    for i in range(5):
        (canary / "nested" / f"deep{i}.bin").write_bytes(os.urandom(32))
    return canary, _snapshot(canary)


def _start_swapper(root: Path, canary: Path, duration: float) -> subprocess.Popen[str]:
    p = subprocess.Popen(
        [sys.executable, "-c", SWAPPER, str(root), str(canary), str(duration)],
        stdout=subprocess.PIPE,
        stderr=subprocess.PIPE,
        text=True,
    )
    assert p.stdout is not None
    assert p.stdout.readline().strip() == "ready"
    return p


def _finish_swapper(p: subprocess.Popen[str]) -> tuple[int, int]:
    out, err = p.communicate(timeout=60)
    assert p.returncode == 0, err
    words = out.split()
    return int(words[words.index("swaps") + 1]), int(words[words.index("errors") + 1])


@pytest.mark.timing  # the race must really run: it needs the CPUs to itself
@pytest.mark.timeout(60)
def test_symlink_swaps_under_cleanup_never_delete_outside_the_root(tmp_path: Path) -> None:
    root = tmp_path / "ck"
    root.mkdir()
    canary, before = _canary(tmp_path)
    ops = CountingOps()
    constructions = removals = 0
    failed: Counter[str] = Counter()  # errno names of clean-ups that failed (safely) under the race
    swapper = _start_swapper(root, canary, RACE_S)
    try:
        end = time.monotonic() + RACE_S
        while time.monotonic() < end:
            try:
                Checkpointer(root, timeout=30, os_ops=ops).close()  # takes the root: removes leftovers
                constructions += 1
            except OSError as e:  # the tree kept changing under it: may fail, never escape the root
                failed[errno.errorcode.get(e.errno or 0, str(e.errno))] += 1
            try:
                remove_tree(str(root / LEFTOVER), ops)
                removals += 1
            except OSError as e:
                failed[errno.errorcode.get(e.errno or 0, str(e.errno))] += 1
    finally:
        swaps, swap_errors = _finish_swapper(swapper)
    after = _snapshot(canary)
    assert sorted(after) == sorted(before), f"canary files lost: {sorted(set(before) - set(after))[:10]}"
    assert after == before
    assert swaps > 100 and ops.links_unlinked > 10, (swaps, ops.links_unlinked)  # the race really ran
    # failures are the tree changing under the removal, never a permission or a read-only root
    assert set(failed) <= {"ENOTEMPTY", "EAGAIN", "ENOENT", "EEXIST"}, failed
    # once the swapper stopped, the clean-up removes the whole leftover, links and all
    with Checkpointer(root, timeout=30):
        assert not (root / LEFTOVER).exists()
    assert _snapshot(canary) == before
    print(
        f"\ncanary ({len(before)} files) intact after {RACE_S:.0f}s: {swaps} swaps ({swap_errors} disturbed), "
        f"{constructions} Checkpointer constructions, {removals} remove_tree calls, clean-ups that failed "
        f"safely {dict(failed)}, {ops.links_unlinked} links removed as links, "
        f"{ops.links_met} directories turned into links under the removal"
    )


@pytest.mark.timeout(60)
def test_gc_command_under_symlink_swaps_never_deletes_outside_the_root(tmp_path: Path) -> None:
    from asyncckpt.cli import main as cli_main

    root = tmp_path / "ck"
    root.mkdir()
    canary, before = _canary(tmp_path)
    race_s = 3.0
    codes: Counter[int] = Counter()
    swapper = _start_swapper(root, canary, race_s)
    try:
        end = time.monotonic() + race_s
        while time.monotonic() < end:
            # the command's own entry point, in this process: hundreds of runs in the race
            out, err = io.StringIO(), io.StringIO()
            with contextlib.redirect_stdout(out), contextlib.redirect_stderr(err):
                code = cli_main(["gc", str(root), "--min-age", "0", "--json"])
            assert code in (0, 1), (code, err.getvalue())  # 1: the tree changed under it, said in one line
            assert "Traceback" not in err.getvalue() and "internal error" not in err.getvalue(), err.getvalue()
            codes[code] += 1
    finally:
        swaps, _ = _finish_swapper(swapper)
    after = _snapshot(canary)
    assert after == before, f"canary files lost: {sorted(set(before) - set(after))[:10]}"
    r = run_cli("gc", root, "--min-age", "0", timeout=30)  # the installed command, as a process
    assert r.code == 0 and not (root / LEFTOVER).exists(), r.err
    assert _snapshot(canary) == before
    print(f"\ncanary intact after {sum(codes.values())} gc runs ({codes[1]} hit the race) during {swaps} swaps")


@pytest.mark.timeout(30)
def test_links_inside_a_leftover_are_removed_as_links(tmp_path: Path) -> None:
    root = tmp_path / "ck"
    root.mkdir()
    canary, before = _canary(tmp_path)
    lo = root / LEFTOVER
    (lo / "sub").mkdir(parents=True)
    (lo / "sub" / "to_canary").symlink_to(canary, target_is_directory=True)
    (lo / "to_file").symlink_to(canary / "part0.bin")
    (lo / "dangling").symlink_to(tmp_path / "nowhere")
    top = root / "step_00000006.tmp-0bad"
    top.symlink_to(canary, target_is_directory=True)  # a leftover name that is itself a link
    with Checkpointer(root, timeout=30):
        assert not lo.exists() and not os.path.lexists(top)
    assert _snapshot(canary) == before


class SwapAtTheWorstMoment(OsOps):
    """Stands in for the racing process at the worst moment, once: right after the removal's
    lstat saw ``sub`` as a directory, ``sub`` is moved away and a link to the canary put there."""

    def __init__(self, sub: Path, away: Path, canary: Path) -> None:
        self.sub, self.away, self.canary = sub, away, canary
        self.swapped = False

    def _swap(self) -> None:
        if not self.swapped:
            self.swapped = True
            os.rename(self.sub, self.away)
            os.symlink(self.canary, self.sub)

    def lstat_at(self, dir_fd: int, name: str) -> os.stat_result:
        st = super().lstat_at(dir_fd, name)
        if name == self.sub.name and stat.S_ISDIR(st.st_mode):
            self._swap()
        return st

    def lstat(self, path: str) -> os.stat_result:  # the path-based walk of earlier versions
        st = super().lstat(path)
        if path == str(self.sub) and stat.S_ISDIR(st.st_mode):
            self._swap()
        return st


@pytest.mark.timeout(30)
def test_directory_swapped_for_a_link_between_lstat_and_open_is_not_followed(tmp_path: Path) -> None:
    root = tmp_path / "ck"
    canary, before = _canary(tmp_path)
    lo = root / LEFTOVER
    (lo / "sub").mkdir(parents=True)
    for i in range(3):
        (lo / "sub" / f"part{i}.bin").write_bytes(b"leftover")  # the same names as canary files
    ops = SwapAtTheWorstMoment(lo / "sub", tmp_path / "moved-away", canary)
    removed: bool | OSError
    try:
        removed = remove_tree(str(lo), ops)
    except OSError as e:
        removed = e
    assert ops.swapped
    after = _snapshot(canary)
    assert after == before, f"canary files lost: {sorted(set(before) - set(after))[:10]}"
    assert removed is True, removed
    assert not os.path.lexists(lo)  # the link was removed as a link, the leftover is gone
    assert sorted(p.name for p in (tmp_path / "moved-away").iterdir()) == ["part0.bin", "part1.bin", "part2.bin"]


def test_a_removal_error_names_the_full_path_of_the_entry(tmp_path: Path) -> None:
    """The *at() calls name only the entry; the error names its path under the tree."""
    tree = tmp_path / "step_00000003.tmp-0abc"
    (tree / "sub").mkdir(parents=True)
    (tree / "sub" / "a").write_bytes(b"a")

    class Refill(OsOps):  # stands in for another process writing into the directory
        def listdir_fd(self, fd: int) -> list[str]:
            names = super().listdir_fd(fd)
            if "a" in names:
                os.close(os.open(tree / "sub" / "late", os.O_CREAT | os.O_WRONLY, 0o644))
            return names

    with pytest.raises(OSError) as ei:
        remove_tree(str(tree), Refill())
    assert ei.value.errno == errno.ENOTEMPTY
    assert ei.value.filename == str(tree / "sub"), ei.value.filename
    assert (tree / "sub" / "late").exists()  # nothing else was touched
