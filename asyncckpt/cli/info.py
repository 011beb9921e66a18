"""``asyncckpt info``: the key tree one rank saved in a step (structure file and header only)."""

from __future__ import annotations

import argparse
import json
import sys
import time
from typing import Any

from ..format._header import TensorSlot
from ..format._manifest import Manifest
from ..reading import Entry, local_time, outline_in, resolve_in, timestamp
from ._args import add_step, command, non_negative_int
from ._print import PROG, dump_json, human_age, human_bytes, say
from ._remote_args import add_remote_arguments, root_of

#: Containers of plain values longer than this are shown on one abbreviated line (``--full``: all).
SHOWN_ITEMS = 8
#: Children shown of any other container (``--full``: all).
SHOWN_CHILDREN = 100
_VALUE_WIDTH = 72


def add_parser(sub: Any) -> argparse.ArgumentParser:
    p = command(
        sub,
        "info",
        "show the saved keys of a checkpoint",
        "Show the tree of keys one rank saved in a step: every tensor with its dtype, shape and\n"
        "size, and every other value (numbers, strings, ...) as saved. Long lists of plain values\n"
        f"(an RNG state) are abbreviated to their first {SHOWN_ITEMS} items; --full shows all. Reads only\n"
        "the structure file and the shard header, not the tensor data (use 'verify' for that).\n"
        "ROOT may be an s3:// URL (the same objects, with ranged GETs for the header).",
        "  asyncckpt info ckpt/                  # newest resumable step, rank 0\n"
        "  asyncckpt info ckpt/ --step 300 --rank 3\n"
        "  asyncckpt info ckpt/ --json\n"
        "  asyncckpt info s3://bucket/run1 --storage-option endpoint=http://127.0.0.1:8333",
    )
    add_step(p, "show")
    p.add_argument("--rank", type=non_negative_int, default=0, metavar="R", help="the rank to show (default: 0)")
    p.add_argument("--full", action="store_true", help="show every item of long lists")
    add_remote_arguments(p)  # s3:// only
    return p


def _clip(text: str, limit: int) -> str:
    return text if len(text) <= limit else text[: limit - 3] + "..."


def _value_repr(v: Any, limit: int = _VALUE_WIDTH) -> str:
    return _clip(repr(v), limit)


def describe(e: Entry) -> str:
    """The right-hand column of the text view."""
    if e.kind == "tensor":
        return f"{e.dtype} {list(e.shape or ())}  {human_bytes(e.nbytes or 0)}"
    if e.kind == "bytes":
        return f"bytes ({human_bytes(e.nbytes or 0)})"
    if e.kind == "generator":
        return f"torch.Generator ({e.value}; state {e.dtype} {list(e.shape or ())}, {human_bytes(e.nbytes or 0)})"
    if e.kind == "value":
        return _value_repr(e.value)
    if e.length is None:
        return f"{e.kind} {_clip(json.dumps(e.value), _VALUE_WIDTH - len(e.kind))}"
    if e.length == 0:
        return f"{e.kind} (empty)"
    unit = "key" if e.kind == "dict" else "item"
    return f"{e.kind} ({e.length} {unit}{'s' if e.length != 1 else ''})"


def lines(entries: list[Entry], full: bool) -> list[tuple[str, str]]:
    """(label, description) rows, abbreviated unless ``full``.

    A long container of plain values (an RNG state) becomes one line with its first items;
    any other container shows its first :data:`SHOWN_CHILDREN` children and a count of the rest.
    """
    out: list[tuple[str, str]] = []
    skip_below: int | None = None
    open_: list[list[int]] = []  # [depth, children seen] of the containers around the current entry
    for i, e in enumerate(entries):
        if skip_below is not None:
            if e.depth > skip_below:
                continue
            skip_below = None
        while open_ and open_[-1][0] >= e.depth:
            depth, seen = open_.pop()
            if not full and seen > SHOWN_CHILDREN:
                out.append(("  " * max(depth + 1, 0) + "...", f"{seen - SHOWN_CHILDREN} more (--full shows all)"))
        if open_ and open_[-1][0] == e.depth - 1:
            open_[-1][1] += 1
            if not full and open_[-1][1] > SHOWN_CHILDREN:
                skip_below = e.depth
                continue
        label = "  " * max(e.depth, 0) + e.label
        if not full and e.scalars and (e.length or 0) > SHOWN_ITEMS:
            items = [_value_repr(c.value, 24) for c in entries[i + 1 : i + 1 + SHOWN_ITEMS]]
            more = (e.length or 0) - SHOWN_ITEMS
            out.append((label, f"{describe(e)} [{', '.join(items)}, ... {more} more] (--full shows all)"))
            skip_below = e.depth
            continue
        out.append((label, describe(e)))
        if e.length is not None:
            open_.append([e.depth, 0])
    while open_:
        depth, seen = open_.pop()
        if not full and seen > SHOWN_CHILDREN:
            out.append(("  " * max(depth + 1, 0) + "...", f"{seen - SHOWN_CHILDREN} more (--full shows all)"))
    return out


def run(args: argparse.Namespace) -> int:
    """Print the saved keys of one rank of one step: tensors with dtype/shape/bytes, other values as saved."""
    root = root_of(args)
    manifest, passed = resolve_in(root, args.step)
    note_passed_over(passed, manifest.step, "showing")
    entries, slots = outline_in(root, manifest, args.rank)
    return _show(args, manifest, root.locate(manifest.step), entries, slots)


def note_passed_over(passed: list[tuple[int, str]], chosen: int, doing: str) -> None:
    """Say on stderr which newer steps a command that takes "the newest" passed over, and why."""
    for step, why in passed:
        say(f"{PROG}: note: passed over step {step} ({why})", sys.stderr)
    if passed:
        say(f"{PROG}: note: {doing} step {chosen}, the newest resumable one", sys.stderr)


def _show(
    args: argparse.Namespace, manifest: Manifest, where: str, entries: list[Entry], slots: dict[str, TensorSlot]
) -> int:
    rank_bytes = sum(s.end - s.begin for s in slots.values())
    created = timestamp(manifest.created)
    if args.json:
        dump_json(
            {
                "step": manifest.step,
                "path": where,
                "rank": args.rank,
                "world_size": manifest.world_size,
                "created": created,
                "run": manifest.run,
                "nbytes": manifest.nbytes,
                "rank_nbytes": rank_bytes,
                "tensors": len(slots),
                "extra": manifest.extra,
                "entries": [e.as_json() for e in entries],
            }
        )
        return 0
    say(f"step {manifest.step}  {where}")
    ago = f" ({human_age(time.time() - created)} ago)" if created is not None else ""
    say(f"created {local_time(created)}{ago}")
    say(f"run {manifest.run if manifest.run is not None else 'none recorded (written before run ids)'}")
    say(
        f"rank {args.rank} of {manifest.world_size}: {len(slots)} tensor(s), {human_bytes(rank_bytes)}"
        f" (all ranks: {human_bytes(manifest.nbytes)})"
    )
    if manifest.extra:
        say(f"extra {json.dumps(manifest.extra, sort_keys=True)}")
    say()
    rows = lines(entries, args.full)
    width = min(max((len(label) for label, _ in rows), default=0), 56)
    for label, text in rows:
        say(f"{label.ljust(width)}  {text}".rstrip())
    return 0
