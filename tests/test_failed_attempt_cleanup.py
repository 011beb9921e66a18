"""The clean-up of a failed attempt's directory, part by part (``_backend.remove_part``).

Rank 0 takes its own files, the names no rank owns and the files of every rank whose I/O
ended; a late rank takes its own; the directory goes with whoever removes the last part, and
a part nobody may take (a rank whose write may be stuck in the kernel) keeps it in place.
"""

from __future__ import annotations

import threading
from pathlib import Path

from asyncckpt.roots._backend import remove_part


def _attempt(d: Path, ranks: range) -> Path:
    d.mkdir()
    for r in ranks:
        (d / f"rank{r:05d}.safetensors").write_bytes(b"x" * 10)
        (d / f"rank{r:05d}.json").write_bytes(b"{}")
    (d / "manifest.json.tmp").write_bytes(b"{}")
    (d / "index.json").write_bytes(b"{}")
    return d


def test_parts_are_disjoint_and_the_last_one_takes_the_directory(tmp_path: Path) -> None:
    d = _attempt(tmp_path / "step_00000002.tmp-a", range(3))
    assert remove_part(str(d), [0, 1], True) is False  # rank 2's files stay (its write may be stuck)
    assert sorted(p.name for p in d.iterdir()) == ["rank00002.json", "rank00002.safetensors"]
    assert remove_part(str(d), [2], False) is True  # rank 2, once its I/O ended: the rest and the directory
    assert not d.exists()
    assert remove_part(str(d), [2], False) is True  # gone already: nothing to do


def test_the_leader_whose_own_io_overran_leaves_its_files_and_the_manifest(tmp_path: Path) -> None:
    d = _attempt(tmp_path / "step_00000002.tmp-b", range(2))
    assert remove_part(str(d), [1], True) is False
    assert sorted(p.name for p in d.iterdir()) == ["index.json", "manifest.json.tmp", "rank00000.json",
                                                   "rank00000.safetensors"]


def test_ranks_removing_their_parts_at_once_always_remove_the_directory(tmp_path: Path) -> None:
    for i in range(30):
        d = _attempt(tmp_path / f"step_{i:08d}.tmp-c", range(4))
        start = threading.Barrier(4)
        errors: list[BaseException] = []

        def part(r: int, d: Path = d, start: threading.Barrier = start, errors: list[BaseException] = errors) -> None:
            start.wait(10)
            try:
                remove_part(str(d), [r], r == 0)
            except BaseException as e:  # noqa: BLE001 - collected for the assertion
                errors.append(e)

        threads = [threading.Thread(target=part, args=(r,)) for r in range(4)]
        for t in threads:
            t.start()
        for t in threads:
            t.join(30)
        assert not errors, errors
        assert not d.exists(), f"round {i}: {sorted(p.name for p in d.iterdir())}"
