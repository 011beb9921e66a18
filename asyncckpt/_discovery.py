"""Discovery: which steps under a root are complete, and which is the newest.

A step is complete when its directory has the committed name, its manifest parses and
passes its own checksum, and the directory holds exactly the files the manifest names,
each a regular file of the recorded size. Checksums of the data are verified by the
loader (and by ``verify``), not here, so listing stays cheap.
"""

from __future__ import annotations

import os
import pathlib
import stat

from ._errors import CheckpointCorruptError, CheckpointNotFoundError
from ._info import CheckpointInfo
from ._layout import parse_step_dir, step_dir_name
from ._manifest import MANIFEST, MAX_MANIFEST_BYTES, Manifest, decode

_NOFOLLOW = getattr(os, "O_NOFOLLOW", 0)


def read_regular_file(path: str, limit: int) -> bytes:
    """Read a regular file (never through a symlink) of at most ``limit`` bytes."""
    # O_NONBLOCK: a FIFO planted under the name must not block us (fstat rejects it below)
    fd = os.open(path, os.O_RDONLY | _NOFOLLOW | os.O_NONBLOCK | getattr(os, "O_CLOEXEC", 0))
    try:
        st = os.fstat(fd)
        if not stat.S_ISREG(st.st_mode):
            raise CheckpointCorruptError("not a regular file", path)
        if st.st_size > limit:
            raise CheckpointCorruptError(f"file larger than {limit} bytes", path)
        chunks = []
        remaining = st.st_size
        while remaining > 0:
            b = os.read(fd, remaining)
            if not b:
                break
            chunks.append(b)
            remaining -= len(b)
        return b"".join(chunks)
    finally:
        os.close(fd)


def read_manifest(step_dir: str) -> Manifest:
    """The manifest of ``step_dir``.

    Raises ``CheckpointNotFoundError`` if there is no marker (not committed) and
    ``CheckpointCorruptError`` if it is unreadable or inconsistent.
    """
    path = os.path.join(step_dir, MANIFEST)
    try:
        raw = read_regular_file(path, MAX_MANIFEST_BYTES)
    except FileNotFoundError:
        raise CheckpointNotFoundError(f"{step_dir} has no completion marker") from None
    except OSError as e:
        # ELOOP: the marker is a symlink; anything else: unreadable
        raise CheckpointCorruptError(f"manifest unreadable ({e.strerror})", path) from None
    return decode(raw, path)


def check_files(step_dir: str, manifest: Manifest) -> None:
    """Check the directory holds exactly the manifest's files with the recorded sizes."""
    try:
        present = set(os.listdir(step_dir))
    except OSError as e:
        raise CheckpointCorruptError(f"cannot list checkpoint ({e.strerror})", step_dir) from None
    expected = {f.name for f in manifest.files} | {MANIFEST}
    extra = present - expected
    if extra:
        raise CheckpointCorruptError(f"unexpected files {sorted(extra)[:5]}", step_dir)
    for f in manifest.files:
        path = os.path.join(step_dir, f.name)
        try:
            st = os.lstat(path)
        except OSError:
            raise CheckpointCorruptError("file listed in the manifest is missing", path) from None
        if not stat.S_ISREG(st.st_mode):
            raise CheckpointCorruptError("not a regular file", path)
        if st.st_size != f.size:
            raise CheckpointCorruptError(f"size {st.st_size} != {f.size} recorded in the manifest", path)


def open_step(root: str | os.PathLike[str], step: int) -> tuple[str, Manifest]:
    """Locate a step and check it is complete; return its directory and manifest."""
    step_dir = os.path.join(os.fspath(root), step_dir_name(step))
    try:
        is_dir = stat.S_ISDIR(os.lstat(step_dir).st_mode)  # a symlinked step is not ours
    except OSError:
        is_dir = False
    if not is_dir:
        raise CheckpointNotFoundError(f"no checkpoint for step {step} under {os.fspath(root)}")
    manifest = read_manifest(step_dir)
    if manifest.step != step:
        raise CheckpointCorruptError(f"manifest is for step {manifest.step}", step_dir)
    check_files(step_dir, manifest)
    return step_dir, manifest


def info_for(step_dir: str, manifest: Manifest) -> CheckpointInfo:
    return CheckpointInfo(
        step=manifest.step,
        path=pathlib.Path(step_dir),
        nbytes=manifest.nbytes,
        world_size=manifest.world_size,
        created=manifest.created,
    )


def candidate_steps(root: str | os.PathLike[str]) -> list[int]:
    """Steps whose directory has the committed name, ascending (not yet checked)."""
    try:
        names = os.listdir(os.fspath(root))
    except FileNotFoundError:
        return []
    steps = []
    for name in names:
        step = parse_step_dir(name)
        if step is not None and name == step_dir_name(step):
            steps.append(step)
    return sorted(steps)


def complete_checkpoints(root: str | os.PathLike[str]) -> list[CheckpointInfo]:
    """Every complete checkpoint under ``root``, ascending by step."""
    out = []
    for step in candidate_steps(root):
        try:
            step_dir, manifest = open_step(root, step)
        except (CheckpointNotFoundError, CheckpointCorruptError):
            continue
        out.append(info_for(step_dir, manifest))
    return out


def find_latest(root: str | os.PathLike[str]) -> CheckpointInfo | None:
    """The newest complete checkpoint under ``root``, or ``None`` if there is none.

    Incomplete, corrupt-looking and leftover directories are skipped; this never raises
    for what it finds on disk.
    """
    for step in reversed(candidate_steps(root)):
        try:
            step_dir, manifest = open_step(root, step)
        except (CheckpointNotFoundError, CheckpointCorruptError):
            continue
        return info_for(step_dir, manifest)
    return None
