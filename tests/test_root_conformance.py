"""One conformance suite for every :class:`asyncckpt.roots.Root` (zarr's ``StoreTests`` style):
a local directory on ``tmp_path``, memory, and the real SeaweedFS on loopback. Each case is a
rule every root keeps: an attempt is invisible until its commit, a commit is atomic and a
second commit of the step is refused, retire never takes the newest resumable step nor counts
a bad one, leftovers are found and removed, ownership is exclusive, reads are bounded by the
manifest (a truncated or grown file is named corrupt before anything is read).

The faults are made the way each medium makes them: files rewritten on disk, objects put
with a plain obstore client, the memory store changed in place (``Rig.tamper``)."""

from __future__ import annotations

import contextlib
import itertools
import threading
import time
import uuid
from collections.abc import Callable, Iterator
from pathlib import Path
from typing import Any

import pytest

from asyncckpt import CheckpointCorruptError, CheckpointNotFoundError, RootInUseError
from asyncckpt.format._checksum import crc32c
from asyncckpt.format._manifest import MANIFEST, FileEntry, Manifest, decode, encode, shard_name, tree_name
from asyncckpt.loading._verify import verify_opened, verify_step
from asyncckpt.roots import Root, _memory, open_root

pytestmark = pytest.mark.timeout(120)

_names = itertools.count()


class Rig:
    """A fresh root of one kind, a second handle on it (another claimant), and ``tamper``:
    replace the bytes of a committed step's file behind the root's back."""

    def __init__(self, where: str, tamper: Callable[[int, str, str, bytes], None], **kw: Any) -> None:
        self.where, self.kw = where, kw
        self.root: Root = open_root(where, **kw)
        self._tamper = tamper
        self.opened = [self.root]

    def other(self, impatient: bool = False) -> Root:
        """Another handle on the root (another claimant). ``impatient``: a store's lease taker
        gives up after 3 s (else it watches a live holder until a renewal, seconds)."""
        kw = dict(self.kw, deadline_s=3.0) if impatient and "deadline_s" in self.kw else self.kw
        r = open_root(self.where, **kw)
        self.opened.append(r)
        return r

    def tamper(self, step: int, name: str, data: bytes) -> None:
        m = self.root.open_step(step)
        self._tamper(step, m.attempt, name, data)

    def close(self) -> None:
        for r in self.opened:
            r.close()


def _posix(tmp_path: Path) -> Rig:
    root = tmp_path / "ck"
    root.mkdir()

    def tamper(step: int, attempt: str, name: str, data: bytes) -> None:
        (root / f"step_{step:08d}" / name).write_bytes(data)

    return Rig(str(root), tamper)


def _memory_rig() -> Rig:
    name = f"conformance-{next(_names)}-{uuid.uuid4().hex[:6]}"

    def tamper(step: int, attempt: str, fname: str, data: bytes) -> None:
        mem = _memory.store(name)
        with mem.lock:
            mem.steps[step].files[fname] = data

    return Rig(f"memory://{name}", tamper)


@pytest.fixture(scope="module")
def s3() -> Iterator[Any]:
    from s3fixtures import require_s3, running_server

    require_s3()
    with running_server("conformance") as server:
        yield server


def _s3(server: Any) -> Rig:
    from s3fixtures import opts, put

    url = f"s3://conformance/r{next(_names)}-{uuid.uuid4().hex[:6]}"

    def tamper(step: int, attempt: str, name: str, data: bytes) -> None:
        put(server.endpoint, url, f"step_{step:08d}/a-{attempt}/{name}", data)

    return Rig(url, tamper, storage_options=opts(server.endpoint), deadline_s=60.0)


@pytest.fixture(params=["posix", "memory", "s3"])
def rig(request: pytest.FixtureRequest, tmp_path: Path) -> Iterator[Rig]:
    if request.param == "posix":
        r = _posix(tmp_path)
    elif request.param == "memory":
        r = _memory_rig()
    else:
        r = _s3(request.getfixturevalue("s3"))
    try:
        yield r
    finally:
        r.close()
        if request.param == "memory":
            _memory.drop(r.where[len("memory://"):])


def payload(step: int, tag: bytes = b"") -> dict[str, bytes]:
    return {shard_name(0): b"S" * 64 + tag + step.to_bytes(4, "little"), tree_name(0): b'{"step": %d}' % step}


def manifest(step: int, attempt: str, files: dict[str, bytes], created: float | None = None) -> bytes:
    entries = [FileEntry(n, len(d), crc32c(d), 0) for n, d in files.items()]
    return encode(step, attempt, 1, sum(len(d) for d in files.values()),
                  time.time() if created is None else created, entries, {})  # fmt: skip


def save(root: Root, step: int, tag: bytes = b"") -> dict[str, bytes]:
    """Commit ``step`` through the root's own attempt: what a one-rank save does."""
    files = payload(step, tag)
    a = root.begin(step)
    for name, data in files.items():
        a.write(name, data)
    a.commit(manifest(step, a.attempt, files))
    return files


def resumable(root: Root) -> list[int]:
    return [r.step for r in root.list_steps() if r.resumable]


class TestRoot:
    """The rules every root keeps (module docstring)."""

    def test_capabilities_say_how_it_differs(self, rig: Rig) -> None:
        caps = rig.root.caps
        assert caps.kind in ("posix", "objstore", "memory")
        assert {"posix": "flock", "objstore": "lease", "memory": "lock"}[caps.kind] == caps.ownership
        assert caps.mmap == (caps.kind == "posix")

    def test_empty_root_lists_nothing(self, rig: Rig) -> None:
        assert rig.root.list_steps() == []
        assert rig.root.newest_resumable() is None
        assert rig.root.leftovers() == []
        with pytest.raises(CheckpointNotFoundError):
            rig.root.open_step(1)

    def test_committed_step_lists_opens_and_reads(self, rig: Rig) -> None:
        files = save(rig.root, 3)
        (row,) = rig.root.list_steps()
        assert (row.step, row.state, row.resumable, row.complete, row.ranks) == (3, "complete", True, True, 1)
        assert row.size >= sum(map(len, files.values())) and row.files == 3
        assert row.as_json(time.time())["status"] == "complete"
        m = rig.root.open_step(3)
        assert {f.name: f.size for f in m.files} == {n: len(d) for n, d in files.items()}
        assert rig.root.newest_resumable() == 3
        for name, data in files.items():
            assert rig.root.read(3, name) == data
            assert rig.root.read(3, name, 2, 5) == data[2:7]
            assert rig.root.read(3, name, len(data), 0) == b""

    def test_reads_are_bounded_by_the_manifest(self, rig: Rig) -> None:
        files = save(rig.root, 1)
        shard = files[shard_name(0)]
        with pytest.raises(ValueError, match="outside"):
            rig.root.read(1, shard_name(0), 0, len(shard) + 1)
        with pytest.raises(ValueError, match="outside"):
            rig.root.read(1, shard_name(0), -1, 2)
        with pytest.raises(CheckpointNotFoundError):
            rig.root.read(1, "rank00001.safetensors")
        with pytest.raises(CheckpointNotFoundError):
            rig.root.read(2, shard_name(0))

    @pytest.mark.parametrize("how", ["truncated", "grown"])
    def test_a_file_not_of_its_listed_size_is_corrupt(self, rig: Rig, how: str) -> None:
        save(rig.root, 1)
        good = save(rig.root, 2)
        shard = good[shard_name(0)]
        rig.tamper(2, shard_name(0), shard[:10] if how == "truncated" else shard + b"\0" * (1 << 20))
        with pytest.raises(CheckpointCorruptError):
            rig.root.read(2, shard_name(0), 0, 4)
        with pytest.raises(CheckpointCorruptError):
            rig.root.open_step(2)
        rows = {r.step: r for r in rig.root.list_steps()}
        # the problem's code is the medium's (a store's LIST cannot tell "missing" from "size")
        assert rows[2].state == "bad" and not rows[2].resumable and rows[2].problem in ("size-mismatch", "corrupt")
        passed: list[tuple[int, CheckpointCorruptError]] = []
        assert rig.root.newest_resumable(passed) == 1  # the last good checkpoint still resumes
        assert [s for s, _ in passed] == [2]

    def test_a_torn_attempt_is_invisible_and_a_leftover(self, rig: Rig) -> None:
        save(rig.root, 1)
        a = rig.root.begin(2)
        for name, data in payload(2).items():
            a.write(name, data)
        # written, never committed (the writer died): no reader may take it
        assert resumable(rig.root) == [1]
        assert rig.root.newest_resumable() == 1
        with pytest.raises(CheckpointNotFoundError):
            rig.root.open_step(2)
        (left,) = rig.root.leftovers()
        assert left.size >= sum(map(len, payload(2).values())) and left.age_s < 3600
        rig.root.remove([left])
        assert rig.root.leftovers() == []
        assert resumable(rig.root) == [1] and rig.root.read(1, tree_name(0)) == payload(1)[tree_name(0)]

    def test_an_aborted_attempt_leaves_nothing(self, rig: Rig) -> None:
        a = rig.root.begin(5)
        a.write(shard_name(0), b"x" * 10)
        a.abort()
        assert rig.root.list_steps() == [] and rig.root.leftovers() == []

    def test_a_second_commit_of_a_step_is_refused(self, rig: Rig) -> None:
        first = rig.root.begin(7)
        second = rig.other().begin(7)  # another writer, begun before either committed
        one, two = payload(7, b"one"), payload(7, b"two")
        for name in one:
            first.write(name, one[name])
            second.write(name, two[name])
        first.commit(manifest(7, first.attempt, one))
        with pytest.raises(FileExistsError):
            second.commit(manifest(7, second.attempt, two))
        # the committed step is the first, whole
        assert rig.root.read(7, shard_name(0)) == one[shard_name(0)]
        assert resumable(rig.root) == [7]
        with pytest.raises(FileExistsError):
            rig.root.begin(7)  # and a step committed is never begun again

    def test_two_commits_racing_one_wins(self, rig: Rig) -> None:
        attempts = [rig.root.begin(9), rig.other().begin(9)]
        files = [payload(9, b"a"), payload(9, b"b")]
        for a, f in zip(attempts, files, strict=True):
            for name, data in f.items():
                a.write(name, data)
        gate = threading.Barrier(2, timeout=30)
        outcome: list[BaseException | None] = [None, None]

        def commit(i: int) -> None:
            gate.wait()
            try:
                attempts[i].commit(manifest(9, attempts[i].attempt, files[i]))
            except BaseException as e:  # noqa: BLE001 - the loser's error is the assertion
                outcome[i] = e

        threads = [threading.Thread(target=commit, args=(i,)) for i in (0, 1)]
        for t in threads:
            t.start()
        for t in threads:
            t.join(60)
        assert not any(t.is_alive() for t in threads)
        lost = [i for i in (0, 1) if outcome[i] is not None]
        assert len(lost) == 1 and isinstance(outcome[lost[0]], FileExistsError), outcome
        won = 1 - lost[0]
        assert rig.root.read(9, shard_name(0)) == files[won][shard_name(0)]  # the winner, whole
        assert resumable(rig.root) == [9]

    def test_a_reader_racing_the_writer_reads_every_step_it_is_given(self, rig: Rig) -> None:
        done = threading.Event()
        seen: list[int] = []
        errors: list[BaseException] = []

        def read() -> None:
            reader = rig.other()
            while not done.is_set():
                try:
                    step = reader.newest_resumable()
                    if step is not None:
                        assert reader.read(step, tree_name(0)) == payload(step)[tree_name(0)]
                        seen.append(step)
                except CheckpointNotFoundError:
                    pass  # retired between the look and the read: gone, never torn
                except BaseException as e:  # noqa: BLE001 - reported below
                    errors.append(e)
                    return

        t = threading.Thread(target=read)
        t.start()
        try:
            for step in range(1, 7):
                save(rig.root, step)
                rig.root.retire(2)
        finally:
            done.set()
            t.join(60)
        assert not errors, errors
        assert seen == sorted(seen)
        assert resumable(rig.root) == [5, 6]

    def test_a_manifest_naming_files_not_written_is_not_committed(self, rig: Rig) -> None:
        save(rig.root, 1)
        a = rig.root.begin(2)
        files = payload(2)
        a.write(tree_name(0), files[tree_name(0)])  # the shard never written
        if rig.root.caps.checks_commit:
            with pytest.raises(CheckpointCorruptError):
                a.commit(manifest(2, a.attempt, files))
            with pytest.raises(CheckpointNotFoundError):
                rig.root.open_step(2)
        else:  # committed as told, but never taken by a reader
            a.commit(manifest(2, a.attempt, files))
            with pytest.raises(CheckpointCorruptError):
                rig.root.open_step(2)
        assert resumable(rig.root) == [1] and rig.root.newest_resumable() == 1

    def test_ownership_is_exclusive_between_two_claimants(self, rig: Rig) -> None:
        claim = rig.root.claim("first")
        with pytest.raises(RootInUseError):
            rig.other(impatient=True).claim("second")
        claim.check()
        claim.release()
        claim.release()  # idempotent
        again = rig.other().claim("second")
        try:
            with pytest.raises(RootInUseError):
                rig.other(impatient=True).claim("third")
        finally:
            again.release()
        rig.root.claim("fourth").release()

    def test_retire_keeps_the_newest_and_lists_what_is_left(self, rig: Rig) -> None:
        for step in (1, 2, 3, 4):
            save(rig.root, step)
        claim = rig.root.claim("retire")
        try:
            with pytest.raises(ValueError):
                rig.root.retire(0)  # never every step: the newest resumable one always stays
            assert rig.root.retire(2, dry_run=True) == [1, 2]
            assert resumable(rig.root) == [1, 2, 3, 4]  # a dry run changes nothing
            assert rig.root.retire(2) == [1, 2]
            assert [r.step for r in rig.root.list_steps()] == [3, 4]
            assert rig.root.retire(1) == [3]
        finally:
            claim.release()
        assert resumable(rig.root) == [4] and rig.root.newest_resumable() == 4
        with pytest.raises(CheckpointNotFoundError):
            rig.root.open_step(3)
        assert rig.root.read(4, tree_name(0)) == payload(4)[tree_name(0)]

    def test_a_bad_step_neither_counts_nor_goes_and_never_hides_the_last_good(self, rig: Rig) -> None:
        for step in (1, 2, 3):
            save(rig.root, step)
        m = rig.root.open_step(3)
        assert rig.root.mark_bad(3, m.attempt, "rank00000.safetensors", "crc mismatch")
        rows = {r.step: r for r in rig.root.list_steps()}
        assert rows[3].state == "bad" and rows[3].bad is not None and rows[3].bad["reason"] == "crc mismatch"
        assert rig.root.newest_resumable() == 2
        assert rig.root.retire(1) == [1]  # step 2 is the newest resumable: it stays; bad 3 is not counted
        assert [r.step for r in rig.root.list_steps()] == [2, 3]
        with pytest.raises(ValueError):
            rig.root.remove_bad(rows[2])  # never a resumable step
        assert rig.root.clear_bad(3, m.attempt)
        assert rig.root.newest_resumable() == 3
        assert rig.root.mark_bad(3, m.attempt, "rank00000.safetensors", "crc mismatch")
        rig.root.remove_bad({r.step: r for r in rig.root.list_steps()}[3])
        assert [r.step for r in rig.root.list_steps()] == [2] and rig.root.newest_resumable() == 2

    def test_a_bad_step_is_set_aside_when_saved_again(self, rig: Rig) -> None:
        save(rig.root, 1)
        m = rig.root.open_step(1)
        rig.root.mark_bad(1, m.attempt, "rank00000.safetensors", "crc mismatch")
        files = save(rig.root, 1, b"again")
        states = sorted(r.state for r in rig.root.list_steps())
        assert states == ["aside", "complete"]
        assert rig.root.read(1, shard_name(0)) == files[shard_name(0)]


    def test_a_file_streamed_in_parts_commits_and_reads_back(self, rig: Rig) -> None:
        """``Attempt.write_from``: a file bigger than one part is asked for in bounded parts
        (never whole), its CRC-32C returned; the step commits and reads back byte for byte."""
        size = 37 * (1 << 20) + 5  # above the POSIX window (16 MiB) and a store part
        data = bytes(range(256)) * (size // 256) + b"x" * (size % 256)
        asked: list[int] = []
        lock = threading.Lock()

        def read(offset: int, view: memoryview) -> None:
            with lock:
                asked.append(view.nbytes)
            view[:] = data[offset:offset + view.nbytes]

        tree = b'{"step": 4}'
        a = rig.root.begin(4, attempt="00ab" * 4)
        assert a.attempt == "00ab" * 4
        crc = a.write_from(shard_name(0), size, read)
        assert crc == crc32c(data)
        a.write(tree_name(0), tree)
        a.commit(manifest(4, a.attempt, {shard_name(0): data, tree_name(0): tree}))
        assert sum(asked) == size and max(asked) <= 16 << 20 and len(asked) >= 3
        assert rig.root.read(4, shard_name(0)) == data
        with rig.root.open_reader(4) as r:  # the manifest's own bytes, as committed
            assert decode(r.manifest_raw, "x") == r.manifest and len(r.manifest_raw) == r.manifest_size

    def test_a_streamed_write_whose_source_fails_commits_nothing(self, rig: Rig) -> None:
        def read(offset: int, view: memoryview) -> None:
            if offset:
                raise OSError(5, "source failed", "src")
            view[:] = b"s" * view.nbytes

        a = rig.root.begin(6)
        with pytest.raises(OSError, match="source failed"):
            a.write_from(shard_name(0), 20 << 20, read)
        a.abort()
        assert rig.root.list_steps() == [] and rig.root.leftovers() == []

    @pytest.mark.parametrize("bad", ["", "XYZ", "a/b", "0" * 65])
    def test_an_attempt_id_that_is_not_a_hex_token_is_refused(self, rig: Rig, bad: str) -> None:
        with pytest.raises(ValueError, match="hex token"):
            rig.root.begin(1, attempt=bad)
        assert rig.root.list_steps() == []


class TestFindLatest:
    """``asyncckpt.find_latest`` and ``Root.resumable``: one look for every root, so every kind
    answers the same: the newest complete step, described from the manifest that look read
    (``roots._find.describe``); bad, incomplete, torn and set-aside entries passed over;
    ``None`` on an empty root."""

    @staticmethod
    def find(rig: Rig) -> Any:
        from asyncckpt import find_latest

        return find_latest(rig.where, storage_options=rig.kw.get("storage_options"))

    @staticmethod
    def check_info(rig: Rig, info: Any, step: int) -> None:
        from asyncckpt import CheckpointInfo
        from asyncckpt._info import info_from_json, info_to_json
        from asyncckpt.remote import RemoteCheckpointInfo

        m = rig.root.open_step(step)
        assert (info.step, info.nbytes, info.world_size, info.created, info.run) == (
            step, m.nbytes, m.world_size, m.created, m.run)  # fmt: skip
        where = rig.root.locate(step)
        if rig.root.caps.kind == "objstore":
            assert type(info) is RemoteCheckpointInfo and (info.url, info.attempt) == (where, m.attempt)
        else:
            assert type(info) is CheckpointInfo and info.statistics is None
            assert (str(info.path), info.url) == ((where, None) if rig.root.caps.kind == "posix" else
                                                  (f"step_{step:08d}", where))  # fmt: skip
        back = info_from_json(info_to_json(info))  # what every rank of latest() gets
        assert back == info and back.run == info.run and type(back) is type(info)

    def test_an_empty_root_has_none(self, rig: Rig) -> None:
        assert self.find(rig) is None
        assert rig.root.resumable() == [] and rig.root.resumable(newest=True) == []

    def test_the_newest_complete_step_described_from_its_manifest(self, rig: Rig) -> None:
        for step in (1, 2, 3):
            save(rig.root, step)
        self.check_info(rig, self.find(rig), 3)
        assert [m.step for m in rig.root.resumable()] == [1, 2, 3]
        (newest,) = rig.root.resumable(newest=True)
        assert newest == rig.root.open_step(3)

    def test_bad_incomplete_torn_and_aside_entries_are_passed_over(self, rig: Rig) -> None:
        for step in (1, 2, 3, 4):
            save(rig.root, step)
        m3 = rig.root.open_step(3)
        assert rig.root.mark_bad(3, m3.attempt, "rank00000.safetensors", "crc mismatch")  # known bad
        rig.tamper(4, shard_name(0), b"short")  # its files are not its manifest's: corrupt
        torn = rig.root.begin(5)  # written, never committed
        for name, data in payload(5).items():
            torn.write(name, data)
        a = rig.root.begin(6)  # committed naming a file it never wrote (refused, or never resumable)
        a.write(tree_name(0), payload(6)[tree_name(0)])
        with pytest.raises((CheckpointCorruptError, FileExistsError)) if rig.root.caps.checks_commit else \
                contextlib.nullcontext():  # fmt: skip
            a.commit(manifest(6, a.attempt, payload(6)))
        self.check_info(rig, self.find(rig), 2)
        assert [m.step for m in rig.root.resumable()] == [1, 2]
        assert [m.step for m in rig.root.resumable(newest=True)] == [2]
        save(rig.root, 3, b"again")  # the bad attempt set aside: the step saved again is resumable
        assert any(r.state == "aside" for r in rig.root.list_steps())
        self.check_info(rig, self.find(rig), 3)
        assert rig.root.open_step(3).attempt != m3.attempt
        assert [m.step for m in rig.root.resumable()] == [1, 2, 3]

    def test_a_local_root_missing_has_none_and_its_path_is_absolute(
        self, tmp_path: Path, monkeypatch: pytest.MonkeyPatch
    ) -> None:
        from asyncckpt import find_latest

        assert find_latest(tmp_path / "missing") is None
        with pytest.raises(ValueError, match="s3://"):
            find_latest(tmp_path, storage_options={"endpoint": "http://127.0.0.1:1"})  # meaningless here: refused
        monkeypatch.chdir(tmp_path)
        rig = _posix(tmp_path)
        try:
            save(rig.root, 4)
            info = find_latest("ck")  # relative: described where it is (Root.locate)
            assert info is not None and info.path == tmp_path / "ck" / "step_00000004"
        finally:
            rig.close()

    def test_the_answer_agrees_with_the_listing_and_newest_resumable(self, rig: Rig) -> None:
        for step in (2, 5, 9):
            save(rig.root, step)
        rig.root.mark_bad(9, rig.root.open_step(9).attempt, "rank00000.safetensors", "crc mismatch")
        listed = [r.step for r in rig.root.list_steps() if r.resumable]
        assert [m.step for m in rig.root.resumable()] == listed == [2, 5]
        assert rig.root.newest_resumable() == self.find(rig).step == 5


class TestRegistry:
    def test_the_scheme_picks_the_root(self, tmp_path: Path) -> None:
        assert open_root(tmp_path).caps.kind == "posix"
        assert open_root(str(tmp_path)).caps.kind == "posix"
        assert open_root("memory://x").caps.kind == "memory"
        assert open_root("s3://bucket/prefix").caps.kind == "objstore"  # no I/O until a call

    @pytest.mark.parametrize("bad", ["", "memory://", "ftp://host/x", "gs://bucket/p"])
    def test_bad_roots_are_refused_at_the_call(self, bad: str) -> None:
        with pytest.raises(ValueError):
            open_root(bad)

    def test_only_a_path_or_str(self) -> None:
        with pytest.raises(TypeError):
            open_root(3)  # type: ignore[arg-type]
        with pytest.raises(TypeError):
            open_root(b"/tmp")  # type: ignore[arg-type]

    def test_options_of_a_store_are_refused_for_a_local_root(self, tmp_path: Path) -> None:
        with pytest.raises(ValueError, match="s3://"):
            open_root(tmp_path, storage_options={"endpoint": "http://x"})

    @pytest.mark.parametrize("command", ["ls", "info", "verify", "gc"])
    def test_the_command_line_calls_an_unknown_scheme_a_usage_error(
        self, command: str, capsys: pytest.CaptureFixture[str]
    ) -> None:
        from asyncckpt.cli import EXIT_USAGE, main

        assert main([command, "ftp://host/x"]) == EXIT_USAGE
        assert "unknown root scheme" in capsys.readouterr().err


@pytest.fixture(scope="module")
def real(tmp_path_factory: pytest.TempPathFactory) -> tuple[Manifest, dict[str, bytes]]:
    """A real one-rank checkpoint (a shard, a structure file) saved by a Checkpointer: its
    manifest and its files' bytes, to commit into any root (:func:`commit_real`)."""
    import torch

    from asyncckpt import Checkpointer

    where = tmp_path_factory.mktemp("real") / "ck"
    with Checkpointer(where) as ck:
        ck.save(1, {"w": torch.arange(4096, dtype=torch.float32), "step": 1}).result(timeout=60)
    d = where / "step_00000001"
    m = decode((d / MANIFEST).read_bytes(), str(d))
    return m, {f.name: (d / f.name).read_bytes() for f in m.files}


def commit_real(root: Root, step: int, real: tuple[Manifest, dict[str, bytes]]) -> str:
    """Commit ``real``'s files as ``step`` through the root's own attempt; its attempt id."""
    m, files = real
    a = root.begin(step)
    for name, data in files.items():
        a.write(name, data)
    a.commit(encode(step, a.attempt, m.world_size, m.nbytes, m.created, m.files, m.extra))
    return a.attempt


class TestStepReader:
    """``Root.open_reader``: one committed step held open, read in ranges bounded by its
    manifest, and the one verification engine on top of it (``loading._verify``)."""

    def test_reads_are_the_files_and_bounded_by_the_manifest(self, rig: Rig) -> None:
        files = save(rig.root, 1)
        shard = files[shard_name(0)]
        with rig.root.open_reader(1) as r:
            assert r.manifest.step == 1 and r.manifest_size > 0
            assert r.read(shard_name(0)) == shard and r.read(shard_name(0), 3, 4) == shard[3:7]
            out = bytearray(5)
            r.read_into(shard_name(0), len(shard) - 5, memoryview(out))
            assert bytes(out) == shard[-5:]
            assert r.read(shard_name(0), len(shard), 0) == b""
            # honest but huge: refused by the manifest's bound before anything is asked of the medium
            with pytest.raises(ValueError, match="outside"):
                r.read(shard_name(0), 0, 1 << 62)
            with pytest.raises(ValueError, match="outside"):
                r.read_into(shard_name(0), 1, memoryview(bytearray(len(shard))))
            with pytest.raises(CheckpointNotFoundError):
                r.read("rank00001.safetensors")
            assert r.locate(shard_name(0)) == rig.root.locate(1, r.manifest.attempt, shard_name(0))
            assert r.still_there()
        with pytest.raises(CheckpointNotFoundError):
            rig.root.open_reader(2)

    def test_a_file_truncated_under_an_open_reader_is_corrupt_never_short(self, rig: Rig) -> None:
        files = save(rig.root, 1)
        shard = files[shard_name(0)]
        with rig.root.open_reader(1) as r:
            assert r.read(shard_name(0), 0, 4) == shard[:4]  # opened (a POSIX reader holds its fd now)
            rig.tamper(1, shard_name(0), shard[:10])
            with pytest.raises(CheckpointCorruptError):
                r.read(shard_name(0), 0, len(shard))
        with pytest.raises(CheckpointCorruptError):
            rig.root.open_reader(1)  # truncated before the opening: the opening says so

    def test_a_reader_racing_retention_never_reads_another_commit(self, rig: Rig) -> None:
        files = save(rig.root, 1)
        with rig.root.open_reader(1) as r:
            assert r.read(tree_name(0)) == files[tree_name(0)]
            save(rig.root, 2)
            assert rig.root.retire(1) == [1]
            again = save(rig.root, 1, b"again")  # the step committed anew, by another attempt
            assert again[shard_name(0)] != files[shard_name(0)]
            try:
                assert r.read(shard_name(0)) == files[shard_name(0)]  # this commit's bytes, or
            except (CheckpointNotFoundError, CheckpointCorruptError):
                pass  # gone: never the other commit's bytes
            assert not r.still_there()
            problems = verify_opened(rig.root, r)
            assert [p.vanished for p in problems] == [True], problems  # not damage, not "ok"
        assert all(row.bad is None for row in rig.root.list_steps())  # nothing marked
        assert resumable(rig.root) == [1, 2] and rig.root.read(1, shard_name(0)) == again[shard_name(0)]

    def test_verify_passes_what_loads_and_marks_what_does_not_through_the_root(
        self, rig: Rig, real: tuple[Manifest, dict[str, bytes]]
    ) -> None:
        attempt = commit_real(rig.root, 5, real)
        assert verify_step(rig.root, 5) == []
        shard = real[1][shard_name(0)]
        flipped = bytearray(shard)
        flipped[-3] ^= 0x10  # same size: only a checksum can tell
        rig._tamper(5, attempt, shard_name(0), bytes(flipped))
        problems = verify_step(rig.root, 5)
        assert [(p.reason, p.io, p.vanished) for p in problems] == [("checksum mismatch", False, False)]
        assert problems[0].path == rig.root.locate(5, attempt, shard_name(0))
        (row,) = rig.root.list_steps()
        assert row.state == "bad" and row.bad is not None and row.bad["path"] == problems[0].path
        assert rig.root.newest_resumable() is None
        rig._tamper(5, attempt, shard_name(0), shard)  # repaired: a passing verify drops the mark
        assert verify_step(rig.root, 5) == []
        assert rig.root.newest_resumable() == 5


def test_a_posix_reader_holds_a_bounded_number_of_files_open(tmp_path: Path) -> None:
    """A step of many files (one per rank and more) read through one reader opens at most
    ``MAX_OPEN`` of them at once, and gives every one back at its close."""
    import os

    from asyncckpt.roots.posix._root import MAX_OPEN

    def held() -> int:  # descriptors open on the root's files: not the process's whole count,
        # which other tests' threads in this worker may change meanwhile (CI saw 25 == 26)
        here = 0
        for fd in os.listdir("/proc/self/fd"):
            try:
                here += os.readlink(f"/proc/self/fd/{fd}").startswith(str(tmp_path))
            except OSError:
                pass  # closed meanwhile
        return here

    root = open_root(str(tmp_path))
    files = {f"rank{r:05d}.json": b"x" * (r + 1) for r in range(3 * MAX_OPEN)}
    a = root.begin(1)
    for name, data in files.items():
        a.write(name, data)
    a.commit(manifest(1, a.attempt, files))
    before = held()
    with root.open_reader(1) as r:
        for name, data in files.items():
            assert r.read(name) == data
            assert held() <= before + 1 + MAX_OPEN  # + the directory
    assert held() == before
    root.close()


@pytest.fixture(scope="module")
def mixed(tmp_path_factory: pytest.TempPathFactory) -> tuple[dict[str, Any], list[tuple[Manifest, dict[str, bytes]]]]:
    """A state of mixed dtypes and layouts, and two real one-rank checkpoints of it (steps 1
    and 2, saved by a Checkpointer) to commit into any root."""
    import torch

    from asyncckpt import Checkpointer

    g = torch.Generator().manual_seed(27)
    state = {
        "w": torch.randn(257, 33, generator=g),
        "h": torch.randn(64, generator=g).to(torch.bfloat16),
        "ids": torch.randint(-(2**40), 2**40, (100,), generator=g),
        "mask": torch.rand(77, generator=g) > 0.5,
        "t": torch.randn(8, 16, generator=g).t(),  # not contiguous
        "empty": torch.empty(0, 3),
        "meta": {"lr": 0.1, "name": "x"},
    }
    where = tmp_path_factory.mktemp("mixed") / "ck"
    out = []
    with Checkpointer(where) as ck:
        for step in (1, 2):
            ck.save(step, {**state, "step": step}).result(timeout=60)
    for step in (1, 2):
        d = where / f"step_{step:08d}"
        m = decode((d / MANIFEST).read_bytes(), str(d))
        out.append((m, {f.name: (d / f.name).read_bytes() for f in m.files}))
    return state, out


def _load(rig: Rig, step: int | None = None, **kw: Any) -> Any:
    import asyncckpt

    return asyncckpt.load(rig.where, step, storage_options=rig.kw.get("storage_options"), **kw)


def _same_bits(a: Any, b: Any) -> None:
    import torch

    assert a.dtype == b.dtype and a.shape == b.shape
    assert torch.equal(a.contiguous().view(-1).view(torch.uint8), b.contiguous().view(-1).view(torch.uint8))


class TestLoad:
    """One loader for every root (``loading._resume`` over ``Root.open_reader``): the same
    committed checkpoint loads bit-identically from a directory, a store and memory, and the
    same damage is the same error type with the same mark-and-fall-back rule."""

    def test_the_same_checkpoint_loads_bit_identically(self, rig: Rig, mixed: Any) -> None:
        import torch

        state, steps = mixed
        for i, real in enumerate(steps, 1):
            commit_real(rig.root, i, real)
        for got in (_load(rig), _load(rig, 1)):
            assert got["step"] in (1, 2) and got["meta"] == state["meta"]
            for k in ("w", "h", "ids", "mask", "t", "empty"):
                _same_bits(got[k], state[k])
        into = {k: torch.zeros_like(v) if isinstance(v, torch.Tensor) else v for k, v in state.items()}
        _load(rig, 2, into=into, verify_first=True)
        for k in ("w", "h", "ids", "mask", "t"):
            _same_bits(into[k], state[k])

    def test_the_same_damage_is_the_same_error_marked_and_passed_over(self, rig: Rig, mixed: Any) -> None:
        state, steps = mixed
        for i, real in enumerate(steps, 1):
            commit_real(rig.root, i, real)
        shard = bytearray(steps[1][1][shard_name(0)])
        shard[-7] ^= 0x40  # same size: only the CRC-32C can tell
        rig.tamper(2, shard_name(0), bytes(shard))
        with pytest.raises(CheckpointCorruptError) as ei:
            _load(rig, 2)
        assert "checksum mismatch" in str(ei.value) and shard_name(0) in str(ei.value)
        assert [r.state for r in rig.root.list_steps() if r.step == 2] == ["bad"]  # marked by the load
        assert rig.root.newest_resumable() == 1
        got = _load(rig)  # step=None: the newest that verifies
        assert got["step"] == 1
        _same_bits(got["w"], state["w"])

    def test_a_truncated_file_is_corrupt_and_nothing_loads_in_its_place(self, rig: Rig, mixed: Any) -> None:
        _, steps = mixed
        commit_real(rig.root, 1, steps[0])
        rig.tamper(1, shard_name(0), steps[0][1][shard_name(0)][:100])
        with pytest.raises(CheckpointCorruptError):
            _load(rig, 1)
        with pytest.raises(CheckpointCorruptError, match="verifies"):
            _load(rig)  # the only step is damaged: its verdict, never an older one or "not found"

    def test_a_missing_step_is_not_found(self, rig: Rig) -> None:
        with pytest.raises(CheckpointNotFoundError):
            _load(rig)
        save(rig.root, 1)
        with pytest.raises(CheckpointNotFoundError):
            _load(rig, 5)


class TestTierRoot:
    """Tier mode's reading side as one root (``roots._tier.TierRoot``): a directory and a
    second root read as the union of their steps, a step from the directory when it is
    resumable there, else from the other; the one loader has no tier case."""

    @pytest.fixture
    def tier(self, tmp_path: Path) -> Iterator[tuple[Root, Root, Root]]:
        from asyncckpt.roots._tier import TierRoot

        near, far_rig = _posix(tmp_path), _memory_rig()
        far = far_rig.root
        tier = TierRoot(near.root, far, lambda skip: far.newest_resumable(skip=skip))
        try:
            yield tier, near.root, far
        finally:
            tier.close()
            _memory.drop(far_rig.where[len("memory://"):])

    def test_steps_are_the_union_and_each_is_read_where_it_is_resumable(self, tier: Any, mixed: Any) -> None:
        from asyncckpt.loading import _resume

        root, near, far = tier
        state, steps = mixed
        commit_real(near, 1, steps[0])
        commit_real(far, 1, steps[0])
        commit_real(far, 2, steps[1])  # only on the far tier, and the newest
        assert root.newest_resumable() == 2 and [r.step for r in root.list_steps()] == [1, 2]
        with root.open_reader(1) as r:
            assert r.locate().startswith(near.url)
        with root.open_reader(2) as r:
            assert r.locate() == far.locate(2)
        step, got = _resume.load_newest(root, rank=0, verify=True)
        assert step == 2
        _same_bits(got["w"], state["w"])
        with pytest.raises(ValueError, match="only on the store"):
            _resume.load_step(root, 2, rank=0, verify=True, mmap=True)
        assert _resume.load_step(root, 1, rank=0, verify=True, mmap=True)["step"] == 1  # local: mapped

    def test_a_damaged_local_copy_is_read_from_the_other_tier_and_marks_go_where_read(
        self, tier: Any, mixed: Any, tmp_path: Path
    ) -> None:
        from asyncckpt.loading import _resume

        root, near, far = tier
        _, steps = mixed
        commit_real(near, 1, steps[0])
        commit_real(far, 1, steps[0])
        (tmp_path / "ck" / "step_00000001" / shard_name(0)).write_bytes(b"x")  # truncated: not resumable here
        assert _resume.load_step(root, 1, rank=0, verify=True)["step"] == 1  # from the far tier
        shard = bytearray(steps[0][1][shard_name(0)])
        shard[-3] ^= 1
        mem = _memory.store(far.url[len("memory://"):])
        with mem.lock:
            mem.steps[1].files[shard_name(0)] = bytes(shard)
        with pytest.raises(CheckpointCorruptError, match="checksum mismatch"):
            _resume.load_step(root, 1, rank=0, verify=True)
        assert [r.state for r in far.list_steps()] == ["bad"]  # marked where it was read
        with pytest.raises(CheckpointCorruptError):
            _resume.load_newest(root, rank=0, verify=True)  # nothing verifies on either tier
