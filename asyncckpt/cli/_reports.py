"""What ``gc`` and ``verify`` report, said the same way for every root (both are written once
against ``asyncckpt.roots.Root``)."""

from __future__ import annotations

import sys
from typing import Any

from ..loading._verify import Problem
from ._print import PROG, dump_json, human_age, human_bytes, say


class Report:
    """What a gc run did, said as it goes (text) or as one JSON document at the end: the same
    lines and shape for a local root and an ``s3://`` one."""

    def __init__(self, root: str, dry: bool, text: bool, min_age: float) -> None:
        self.dry, self.text, self.min_age = dry, text, min_age
        self.doc: dict[str, Any] = {"root": root, "dry_run": dry, "removed": [], "kept": [], "retired": []}
        self.freed = 0

    def kept(self, name: str, age: float) -> None:
        self.doc["kept"].append({"name": name, "age_s": round(age, 3)})
        if self.text:
            say(
                f"kept {name}: modified {human_age(age)} ago, a save may still be writing it "
                f"(--min-age {self.min_age:g}s; pass --min-age 0 to remove it)"
            )

    def removed(self, name: str, what: str, size: int) -> None:
        self.doc["removed"].append({"name": name, "size": size})
        if self.text:
            say(f"{'would remove' if self.dry else 'removed'} {name} ({what}, {human_bytes(size)})")
        self.freed += size

    def retired(self, step: int, size: int) -> None:
        self.doc["retired"].append({"step": step, "size": size})
        if self.text:
            say(f"{'would retire' if self.dry else 'retired'} step {step} ({human_bytes(size)})")
        self.freed += size

    def keeping(self, steps: list[int]) -> None:
        self.doc["kept_steps"] = steps
        if steps and self.text:
            say(f"keeping {len(steps)} complete checkpoint(s): step {', '.join(map(str, steps))}")

    def left_alone(self, name: str, problem: str | None, reason: str | None) -> None:
        self.doc.setdefault("left_alone", []).append({"name": name, "problem": problem, "reason": reason})
        if self.text:
            say(f"left alone {name}: incomplete, {reason}; inspect it and remove it by hand if unwanted")

    def bad(self, name: str, step: int, what: str, reason: str, size: int, removed: bool) -> None:
        """A known-bad step (``what="bad"``) or a bad attempt set aside (``"aside"``): removed
        (``--remove-bad``) or kept for inspection, never counted by ``--keep-last``."""
        self.doc.setdefault("bad", []).append(
            {"name": name, "step": step, "kind": what, "reason": reason, "size": size, "removed": removed})
        if removed:
            self.freed += size
        if not self.text:
            return
        label = "known bad" if what == "bad" else "bad attempt set aside"
        if removed:
            say(f"{'would remove' if self.dry else 'removed'} {name} ({label}: {reason}, {human_bytes(size)})")
        else:
            say(f"kept {name}: {label}, {reason}; never counted by --keep-last, load() passes over it "
                "(--remove-bad removes it)")

    def newest_bad(self, step: int, newest: int | None) -> None:
        """The highest step is known bad: say what resumes instead."""
        self.doc["newest_known_bad"] = step
        if self.text:
            instead = f"step {newest} is the newest resumable one" if newest is not None else "nothing is resumable"
            say(f"{PROG}: warning: step {step}, the highest, is known bad; {instead}", sys.stderr)

    def finish(self) -> int:
        self.doc.setdefault("kept_steps", [])
        self.doc.setdefault("left_alone", [])
        self.doc.setdefault("bad", [])
        self.doc["freed"] = self.freed
        if self.text:
            say(f"{'would free' if self.dry else 'freed'} {human_bytes(self.freed)}")
        else:
            dump_json(self.doc)
        return 0


def report(
    results: list[dict[str, Any]], step: int, problems: list[Problem], where: str, files: int, nbytes: int,
    as_json: bool,
    note: str | None = None,
) -> None:
    """Add the verdict on one verified step to ``results`` and, unless ``as_json``, print it
    (and ``note``: what decides nothing, such as files the manifest does not list)."""
    # retired by a running job while we read it: gone, not damaged; an I/O error: unreadable
    # (the storage failed, the data may be fine: nothing was marked)
    status = (
        "ok" if not problems
        else "not found" if all(p.vanished for p in problems)
        else "unreadable" if all(p.io or p.vanished for p in problems)
        else "corrupt"
    )  # fmt: skip
    results.append({
        "step": step, "status": status, "ok": not problems, "path": where, "files": files, "bytes": nbytes,
        "problems": [{"path": p.path, "reason": p.reason} for p in problems], "note": note,
    })  # fmt: skip
    if as_json:
        return
    if note is not None:
        say(f"{PROG}: step {step}: note: {note}", sys.stderr)
    for p in problems:
        say(f"{PROG}: step {step}: {status}: {p}", sys.stderr)
    if not problems:
        say(f"step {step}: ok ({files} files, {human_bytes(nbytes)} verified)")


def summarize(results: list[dict[str, Any]], root: str, asked: int, as_json: bool) -> int:
    """Print the closing summary (or the JSON document) and return the exit status: 0 when
    every result is ok."""
    results.sort(key=lambda r: int(r["step"]))
    good = sum(1 for r in results if r["ok"])
    if as_json:
        dump_json({"root": root, "ok": good, "failed": len(results) - good, "steps": results})
    elif asked > 1:
        say(f"{good} of {asked} checkpoints ok")
    return 0 if good == len(results) else 1
