"""``asyncckpt export``: one rank's tensors as a flat name->tensor .safetensors or .pt file.

Any root is read the same way, through its ``Root.open_reader`` (a directory, an ``s3://``
URL read by ranged GETs with nothing stored beside OUT, a tier). A ``.safetensors`` export
streams (``asyncckpt.loading._export``): the header first, then each
tensor's bytes, assembled from a sharded checkpoint's chunks into full global tensors, read
and checksummed one bounded piece at a time, so a model larger than memory exports. A ``.pt``
export loads the selected tensors (``torch.save`` needs them all in memory). Tied tensors are
written once, under the name ``safetensors.torch.save_model`` keeps (the first in sorted
order) in ``.safetensors``; ``torch.save`` keeps the sharing itself.

The only command that imports torch, and only when it runs.
"""

from __future__ import annotations

import argparse
import os
import sys
import uuid
from collections.abc import Callable
from typing import TYPE_CHECKING, Any, TypeVar

from ..format._layout import parse_aside, parse_leftover, parse_step_dir
from ..reading import resolve_in
from ..roots import Root
from ..roots.posix._osops import DEFAULT_OPS
from ._args import DataError, UsageError, add_step, command, non_negative_int
from ._print import PROG, dump_json, human_bytes, say
from ._remote_args import add_remote_arguments, root_of
from .info import note_passed_over

if TYPE_CHECKING:
    import torch

T = TypeVar("T")

#: Output suffixes ``export`` understands; ``.safetensors`` selects safetensors, the rest torch.save.
SUFFIXES = (".safetensors", ".pt", ".pth")


def _export_path(text: str) -> str:
    if not text.lower().endswith(SUFFIXES):
        raise argparse.ArgumentTypeError(f"{text!r} must end in .safetensors, .pt or .pth")
    return text


def add_parser(sub: Any) -> argparse.ArgumentParser:
    p = command(
        sub,
        "export",
        "write one rank's tensors to a single .safetensors or .pt file",
        "Write the tensors of one rank (default 0) of a step (default: the newest resumable) as\n"
        "one flat name->tensor file for other tools: .safetensors (read by\n"
        "safetensors.torch.load_file/load_model and Hugging Face from_pretrained) or .pt/.pth (a\n"
        "torch.save of the dict, loadable with torch.load(weights_only=True)). Names are the dotted\n"
        "key paths; --key keeps only the subtree under a key and strips that prefix\n"
        "(model.layer.weight becomes layer.weight). Sharded tensors (DTensors: FSDP2, tensor\n"
        "parallel) are written whole, assembled from every rank's chunks; --rank picks whose\n"
        "other values are written. Tied tensors are written once, under the first of their names\n"
        "in sorted order (as safetensors.torch.save_model does). Non-tensor values are skipped.\n"
        ".safetensors exports stream: memory stays bounded (~16 MiB of buffers) whatever the\n"
        "size. The data is verified while it is read; the output is written atomically.\n"
        "ROOT may be an s3:// URL: the step is read from the store by ranged GETs (verified\n"
        "the same way), nothing of it is stored beside OUT.",
        "  asyncckpt export ckpt/ --to all.safetensors\n"
        "  asyncckpt export ckpt/ --step 300 --key model --to model.safetensors\n"
        "  asyncckpt export ckpt/ --step 300 --key model --to model.pt\n"
        "  asyncckpt export s3://bucket/run1 --key model --to model.safetensors",
    )
    add_step(p, "export")
    p.add_argument("--key", metavar="KEY", help="export only the subtree under this dotted key, prefix stripped")
    p.add_argument("--rank", type=non_negative_int, default=0, metavar="R", help="the rank to export (default: 0)")
    p.add_argument(
        "--to", type=_export_path, required=True, metavar="OUT", help="output file: *.safetensors, *.pt or *.pth"
    )
    p.add_argument("--force", action="store_true", help="overwrite OUT if it exists")
    add_remote_arguments(p)  # s3:// only
    return p


def named_tensors(state: Any) -> tuple[list[tuple[tuple[str, ...], torch.Tensor]], list[tuple[str, ...]]]:
    """Flatten a loaded state into ``(key path, tensor)`` pairs in saved order, and the key
    paths of the values skipped (everything not a tensor)."""
    import torch

    tensors: list[tuple[tuple[str, ...], torch.Tensor]] = []
    skipped: list[tuple[str, ...]] = []
    stack: list[tuple[Any, tuple[str, ...]]] = [(state, ())]
    while stack:
        node, path = stack.pop()
        if isinstance(node, torch.Tensor):
            tensors.append((path, node))
        elif isinstance(node, dict):
            stack.extend(reversed([(v, (*path, str(k))) for k, v in node.items()]))
        elif isinstance(node, (list, tuple)):
            stack.extend(reversed([(v, (*path, str(i))) for i, v in enumerate(node)]))
        else:
            skipped.append(path)
    return tensors, skipped


#: Skipped subtrees named in the text note (``--json`` lists every value).
SHOWN_SKIPPED = 8


def summarise(skipped: list[tuple[str, ...]], tensors: list[tuple[str, ...]]) -> list[tuple[str, int]]:
    """The skipped values grouped into the largest subtrees that hold no tensor, in saved order:
    ``(dotted key, values under it)``. An RNG state saved as a tuple of 625 ints is one entry
    (``rng, 627``), not 627."""
    inner = {p[:k] for p in tensors for k in range(len(p) + 1)}  # every key above a tensor
    groups: dict[tuple[str, ...], int] = {}
    for p in skipped:
        k = next((k for k in range(1, len(p) + 1) if p[:k] not in inner), len(p))
        groups[p[:k]] = groups.get(p[:k], 0) + 1
    return [(".".join(q) if q else "_", n) for q, n in groups.items()]


def select_key(tensors: list[tuple[str, T]], key: str | None) -> dict[str, T]:
    """The tensors under dotted prefix ``key`` with the prefix stripped (all of them when ``None``)."""
    out: dict[str, T] = {}
    for name, t in tensors:
        if key is None:
            new = name
        elif name.startswith(key + "."):
            new = name[len(key) + 1 :]
        elif name == key:
            raise UsageError(f"--key {key} names a single tensor, not a subtree; use its parent key")
        else:
            continue
        if new in out:
            raise DataError(f"two tensors would both be named {new!r} in the exported file")
        out[new] = t
    if not out:
        from .._errors import CheckpointNotFoundError

        tops = sorted({n.split(".", 1)[0] for n, _ in tensors})
        hint = f" (top-level keys with tensors: {', '.join(tops[:10])})" if tops else ""
        raise CheckpointNotFoundError(f"no tensors under key {key!r}{hint}")
    return out


class _Sink:
    """The file ``torch.save`` writes to, keeping the ``OSError`` a write raised: torch's zip
    writer reports it as a ``RuntimeError`` that has lost the errno ("unexpected pos")."""

    def __init__(self, f: Any) -> None:
        self.f = f
        self.error: OSError | None = None

    def write(self, data: Any) -> int:
        try:
            return int(self.f.write(data))
        except OSError as e:
            self.error = e
            raise

    def flush(self) -> None:
        self.f.flush()


def write_torch(path: str, tensors: dict[str, torch.Tensor]) -> None:
    """``torch.save`` the flat dict ``tensors`` to ``path`` (loadable with ``weights_only=True``),
    fsynced. An error writing it is an ``OSError`` naming ``path`` (a full disk: ENOSPC)."""
    import torch

    with open(path, "xb") as f:
        sink = _Sink(f)
        try:
            torch.save({n: t.detach().cpu().contiguous() for n, t in tensors.items()}, sink)  # type: ignore[arg-type]
        except RuntimeError:
            if sink.error is None:
                raise
            raise OSError(sink.error.errno, sink.error.strerror, path) from None
        f.flush()
        os.fsync(f.fileno())


def _atomic_write(dest: str, writer: Callable[[str], object], force: bool) -> None:
    """Have ``writer`` fill a temporary file beside ``dest``, then rename it into place."""
    if os.path.lexists(dest) and not force:
        raise UsageError(f"{dest} already exists (pass --force to overwrite it)")
    parent = os.path.dirname(os.path.abspath(dest))
    tmp = os.path.join(parent, f".{os.path.basename(dest)}.tmp-{uuid.uuid4().hex[:12]}")
    try:
        writer(tmp)
        os.replace(tmp, dest)
    except BaseException:
        try:
            os.unlink(tmp)
        except FileNotFoundError:
            pass
        raise
    DEFAULT_OPS.fsync_dir(parent)


def run(args: argparse.Namespace) -> int:
    """Write one rank's tensors (or those under ``--key``) of a step as a flat name->tensor file."""
    dest: str = args.to
    if os.path.isdir(dest):  # os.replace would name the temporary file, not this
        raise UsageError(f"{dest} is a directory: --to names the file to write")
    if os.path.lexists(dest) and not args.force:
        raise UsageError(f"{dest} already exists (pass --force to overwrite it)")
    root = root_of(args)
    try:
        return _run(args, root, dest)
    finally:
        root.close()


def _run(args: argparse.Namespace, root: Root, dest: str) -> int:
    """:func:`run` of the opened ``root`` (any kind: read through ``Root.open_reader``)."""
    if root.caps.kind == "posix":
        parent = os.path.realpath(os.path.dirname(os.path.abspath(dest)))
        inside = os.path.basename(parent)
        if os.path.dirname(parent) == os.path.realpath(args.root) and (
            parse_step_dir(inside) is not None or parse_leftover(inside) is not None or parse_aside(inside) is not None
        ):
            raise UsageError(f"refusing to write into {inside}: a checkpoint's own directory holds only its files")
    # the manifest first: a rank the step lacks is refused before anything is read
    manifest, passed = resolve_in(root, args.step)
    note_passed_over(passed, manifest.step, "exporting")
    if args.rank >= manifest.world_size:
        raise DataError(
            f"step {manifest.step} was saved by {manifest.world_size} rank(s); there is no rank {args.rank}"
        )
    from ..loading._export import dotted  # torch: only this command needs it

    if dest.lower().endswith(".safetensors"):
        tensors, keys, skipped, dropped = _stream(args, root, manifest.step, dest)
        nbytes = sum(_export_nbytes(s) for s in tensors.values())
    else:
        from ..checkpointer._loader import read  # torch: only this command needs it

        state = read(root, manifest.step, rank=args.rank, verify=True)
        pairs, skipped = named_tensors(state)
        loaded = select_key([(dotted(k), t) for k, t in pairs], args.key)
        _atomic_write(dest, lambda p: write_torch(p, loaded), args.force)
        nbytes = sum(t.numel() * t.element_size() for t in loaded.values())
        tensors, keys, dropped = dict(loaded), [k for k, _ in pairs], {}
    if args.key is not None:
        skipped = [s for s in skipped if dotted(s).startswith(args.key + ".")]
    groups = summarise(skipped, keys)
    if args.json:
        dump_json(
            {"path": os.path.abspath(dest), "step": manifest.step, "rank": args.rank, "key": args.key,
             "tensors": len(tensors), "nbytes": nbytes, "skipped": [k for k, _ in groups],
             "skipped_values": [dotted(s) for s in skipped]}
        )  # fmt: skip
        return 0
    where = f" under {args.key!r}" if args.key is not None else ""
    say(
        f"wrote {len(tensors)} tensor(s){where}, {human_bytes(nbytes)}, of step {manifest.step} "
        f"rank {args.rank} to {dest}"
    )
    if dropped:
        shown = ", ".join(f"{d} (= {k})" for d, k in list(dropped.items())[:5]) + (", ..." if len(dropped) > 5 else "")
        say(f"{PROG}: note: tied tensor(s) written once; left out: {shown}", sys.stderr)
    if skipped:
        shown = ", ".join(k if n == 1 else f"{k} ({n} values)" for k, n in groups[:SHOWN_SKIPPED])
        if len(groups) > SHOWN_SKIPPED:
            shown += f", ... {len(groups) - SHOWN_SKIPPED} more"
        say(f"{PROG}: note: skipped {len(skipped)} non-tensor value(s) under {len(groups)} key(s) "
            f"(--json lists them all): {shown}", sys.stderr)
    return 0


def _export_nbytes(src: Any) -> int:
    from ..loading._exportwrite import nbytes_of

    return nbytes_of(src)


def _stream(
    args: argparse.Namespace, root: Root, step: int, dest: str
) -> tuple[dict[str, Any], list[tuple[str, ...]], list[tuple[str, ...]], dict[str, str]]:
    """Stream the selected tensors of ``step`` into ``dest`` (atomically); return them by
    output name, the key paths of every tensor of the rank, those of the skipped values, and
    the tied names left out. What a failed read means is judged as a load judges it
    (``_resume.judge``): a checksum failure is recorded as the step's bad mark (an I/O error
    is not: it says nothing about the checkpoint), and either on a step retired or replaced
    meanwhile is ``CheckpointNotFoundError``."""
    from .._errors import CheckpointCorruptError, CheckpointReadError
    from ..loading import _export, _resume  # torch: only this command needs it

    with root.open_reader(step) as reader:
        try:
            ex = _export.export_of(reader, args.rank)
            selected = select_key(ex.named, args.key)
            kept, dropped = _export.drop_aliases(selected)
            try:  # before anything is created: a header safetensors would refuse is never written
                layout = ex.plan(kept)
            except ValueError as e:
                raise DataError(
                    f"step {step} cannot be exported as one .safetensors file: {e}; export part of it (--key) "
                    "or to a .pt file"
                ) from None
            _atomic_write(dest, lambda p: ex.write(p, kept, layout), args.force)
        except (CheckpointCorruptError, CheckpointReadError) as e:  # the step's: not the output's
            _resume.judge(root, reader, e)
            raise
        return dict(kept), ex.keys, ex.skipped, dropped
