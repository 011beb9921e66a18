"""Every command's ``--json`` output is the same for a local root and its ``s3://`` push.

A local root with four steps is pushed to a real SeaweedFS; step 2 is then damaged the same
way on both sides (one flipped byte in its shard: same size, only the CRC can tell) and a
``verify`` finds it, so each side knows it bad. ``ls``, ``info``, ``verify``, ``export`` and
``gc --dry-run`` then run against the directory and against the URL, and their JSON documents
are compared field by field after normalising only what must differ (:func:`normalised`):

- where things are: a path under the root versus a URL under the prefix, and a step's files,
  which on a store sit under the attempt that wrote them (``step_N/a-<attempt>/NAME``: the
  object-store commit writes every object of an attempt first, then creates the manifest
  that names the attempt) where a directory holds them directly (``step_N/NAME``);
- times that belong to the medium, not to the checkpoint: ``modified`` (file mtimes versus
  the store's LastModified), ``age_s`` (measured from that and from now), a bad mark's
  ``time`` (each side's verify recorded its own);
- ``export``'s ``path``: the file each run wrote (their bytes are compared instead).

Not compared, because they differ by nature, not by accident: what never committed. A push
carries committed steps only, and each medium names its own leftovers by its own layout (a
``step_N.tmp-<attempt>`` directory versus objects under ``step_N/a-<attempt>/`` with no
manifest; an attempt set aside is a ``step_N.bad-<attempt>`` directory versus a
``step_N/bad-<attempt>.json`` record). A prefix without a manifest is an uncommitted attempt
that ``gc`` removes after ``--min-age``, while a local directory with a committed name and no
manifest is reported and left alone (``left_alone``), never removed.
"""

from __future__ import annotations

import json
import re
from collections.abc import Iterator
from pathlib import Path
from typing import Any

import pytest
import torch
from _cli_util import cli_doc, option_args
from s3fixtures import get, opts, put, require_s3, shared_server

from asyncckpt import Checkpointer, remote

require_s3()

BUCKET = "parity"
URL = f"s3://{BUCKET}/run"
BAD = 2
pytestmark = pytest.mark.timeout(120)


def state(step: int) -> dict[str, Any]:
    g = torch.Generator().manual_seed(step)
    return {
        "model": {"w": torch.randn(16, 8, generator=g), "b": torch.arange(step, step + 8).to(torch.bfloat16)},
        "optim": {"state": {0: {"exp_avg": torch.randn(8, generator=g)}}, "lr": 0.1 * step},
        "rng": list(range(20)),
        "step": step,
    }


@pytest.fixture(scope="module")
def pair(tmp_path_factory: pytest.TempPathFactory) -> Iterator[tuple[Path, list[str]]]:
    """A local root and its push (``URL``), step 2 damaged and found bad on both; the CLI's
    storage options for the URL."""
    root = tmp_path_factory.mktemp("parity") / "ck"
    with Checkpointer(root, keep_last=None) as ck:
        for step in (1, 2, 3, 4):
            ck.save(step, state(step)).result(timeout=60)
    with shared_server(BUCKET) as server:
        so = opts(server.endpoint)
        remote.push(root, URL, storage_options=so, deadline_s=60)
        local = root / f"step_{BAD:08d}" / "rank00000.safetensors"
        attempt = json.loads(get(server.endpoint, URL, f"step_{BAD:08d}/manifest.json"))["attempt"]
        key = f"step_{BAD:08d}/a-{attempt}/rank00000.safetensors"
        data = bytearray(local.read_bytes())
        assert data == get(server.endpoint, URL, key)
        data[-3] ^= 0x10
        local.write_bytes(bytes(data))
        put(server.endpoint, URL, key, bytes(data))
        flags = option_args(so)
        for where, extra in ((root, []), (URL, flags)):
            assert cli_doc("verify", where, "--step", BAD, *extra)[0] == 1
        yield root, flags


#: Fields that are times of the medium (module docstring).
TIMES = {"modified", "age_s"}


def normalised(doc: Any, where: str) -> Any:
    """``doc`` with ``where`` (the root's absolute path or the URL) written ``<root>``, a
    store's ``a-<attempt>/`` level dropped from object URLs, and medium times written ``<time>``."""
    attempt_level = re.compile(re.escape(where) + r"(/step_\d{8})/a-[0-9a-f]{16}(/)")

    def walk(x: Any, key: str = "", parent: str = "") -> Any:
        if isinstance(x, dict):
            return {k: walk(v, k, key) for k, v in x.items()}
        if isinstance(x, list):
            return [walk(v, key, parent) for v in x]
        if key in TIMES or (key == "time" and parent == "bad"):
            assert isinstance(x, (int, float)), (key, x)
            return "<time>"
        if isinstance(x, str) and where in x:
            return attempt_level.sub(r"<root>\1\2", x).replace(where, "<root>")
        return x

    return walk(doc)


def both(root: Path, flags: list[str], *argv: Any) -> tuple[Any, Any]:
    """The JSON of ``asyncckpt ARGV[0] WHERE ARGV[1:] --json`` for the root and the URL,
    normalised, and the same exit status from both."""
    code_l, near, err_l = cli_doc(argv[0], root, *argv[1:], "--json")
    code_r, far, err_r = cli_doc(argv[0], URL, *argv[1:], "--json", *flags)
    assert code_l == code_r, (argv, code_l, code_r, near, far, err_l, err_r)
    return normalised(near, str(root)), normalised(far, URL)


def assert_fields_equal(near: Any, far: Any, path: str = "") -> None:
    """Equal, field by field, naming the first field that differs."""
    if isinstance(near, dict) and isinstance(far, dict):
        assert list(near) == list(far), (path, list(near), list(far))
        for k in near:
            assert_fields_equal(near[k], far[k], f"{path}.{k}")
    elif isinstance(near, list) and isinstance(far, list):
        assert len(near) == len(far), (path, near, far)
        for i, (a, b) in enumerate(zip(near, far, strict=True)):
            assert_fields_equal(a, b, f"{path}[{i}]")
    else:
        assert near == far and type(near) is type(far), (path, near, far)


def test_ls(pair: tuple[Path, list[str]]) -> None:
    near, far = both(*pair, "ls")
    assert [(r["step"], r["status"]) for r in near] == [(1, "complete"), (2, "bad"), (3, "complete"), (4, "complete")]
    assert near[1]["bad"]["path"] == "<root>/step_00000002/rank00000.safetensors"
    assert_fields_equal(near, far)


@pytest.mark.parametrize("extra", [[], ["--step", "1"], ["--step", str(BAD)], ["--rank", "0", "--full"]])
def test_info(pair: tuple[Path, list[str]], extra: list[str]) -> None:
    near, far = both(*pair, "info", *extra)
    assert near["step"] == (int(extra[1]) if extra[:1] == ["--step"] else 4)
    assert_fields_equal(near, far)


@pytest.mark.parametrize("extra", [[], ["--step", "3"], ["--step", str(BAD)], ["--all"]])
def test_verify(pair: tuple[Path, list[str]], extra: list[str]) -> None:
    near, far = both(*pair, "verify", *extra)
    assert [(s["step"], s["status"]) for s in near["steps"]] == {
        "": [(4, "ok")], "3": [(3, "ok")], str(BAD): [(BAD, "corrupt")],
        "--all": [(1, "ok"), (2, "corrupt"), (3, "ok"), (4, "ok")]}[extra[-1] if extra else ""]  # fmt: skip
    assert_fields_equal(near, far)


@pytest.mark.parametrize("name", ["model.safetensors", "model.pt"])
@pytest.mark.parametrize("extra", [["--key", "model"], ["--step", "3"]])
def test_export(pair: tuple[Path, list[str]], tmp_path: Path, name: str, extra: list[str]) -> None:
    root, flags = pair
    outs = []
    for side, where, more in (("near", root, []), ("far", URL, flags)):
        dest = tmp_path / side / name
        dest.parent.mkdir()
        code, doc, err = cli_doc("export", where, "--to", dest, *extra, "--json", *more)
        assert code == 0 and doc.pop("path") == str(dest), (doc, err)
        outs.append((doc, dest))
    (near, a), (far, b) = outs
    assert near["step"] == (3 if "--step" in extra else 4)
    assert_fields_equal(near, far)
    if name.endswith(".safetensors"):
        assert a.read_bytes() == b.read_bytes()
    else:
        x, y = torch.load(a, weights_only=True), torch.load(b, weights_only=True)
        assert list(x) == list(y) and all(torch.equal(x[k], y[k]) and x[k].dtype == y[k].dtype for k in x)


@pytest.mark.parametrize("extra", [[], ["--keep-last", "1"], ["--keep-last", "2", "--remove-bad"], ["--min-age", "0"]])
def test_gc_dry_run(pair: tuple[Path, list[str]], extra: list[str]) -> None:
    near, far = both(*pair, "gc", "--dry-run", *extra)
    assert near["dry_run"] is True and [b["step"] for b in near["bad"]] == [BAD]
    assert_fields_equal(near, far)


def test_nothing_was_changed_by_the_dry_runs(pair: tuple[Path, list[str]]) -> None:
    root, _ = pair
    steps = sorted(p.name for p in root.iterdir() if p.name.startswith("step_"))
    assert steps == [f"step_{s:08d}" for s in (1, 2, 3, 4)]
