"""Issue 26, problems 2 and 3 on an ``s3://`` root (a real SeaweedFS on loopback): the same
rule of resumability as a local root (``_stepstates``), with bad marks kept on the store.

* ``gc --keep-last 1`` after ``verify`` marked the newest step bad keeps the newest good step,
  as ``--dry-run`` predicted; the mark lies on the store, so every later reader knows it;
* ``load()`` falls back past a corrupt newest step, ``latest()`` stops answering it, saving
  that step again commits (the bad attempt set aside on the store, kept through later starts
  and retention, shown by ``ls``, removed only by ``gc --remove-bad``), and so do later steps.
"""

from __future__ import annotations

import json
import logging
import sys
import uuid
from collections.abc import Iterator
from pathlib import Path
from typing import Any

import pytest
import torch

sys.path.insert(0, str(Path(__file__).parent / "support"))

from _cli_util import run_cli, so, strict_json
from s3fixtures import data_keys, get, keys, opts, put, require_s3, shared_server
from s3server import S3Server

import asyncckpt
from asyncckpt import Checkpointer

require_s3()

BUCKET = "resumable-bucket"
pytestmark = pytest.mark.timeout(180)


@pytest.fixture(scope="module")
def s3() -> Iterator[S3Server]:
    with shared_server(BUCKET) as server:
        yield server


@pytest.fixture
def url() -> str:
    return f"s3://{BUCKET}/run-{uuid.uuid4().hex[:10]}"


def state(step: int) -> dict[str, Any]:
    return {"w": torch.full((2048,), float(step)), "extra": {"step": step}}


def attempt_of(endpoint: str, url: str, step: int) -> str:
    return str(json.loads(get(endpoint, url, f"step_{step:08d}/manifest.json"))["attempt"])


def corrupt(endpoint: str, url: str, step: int) -> str:
    """Flip one byte of ``step``'s shard object (same size: only a CRC tells); return its key."""
    key = f"step_{step:08d}/a-{attempt_of(endpoint, url, step)}/rank00000.safetensors"
    data = bytearray(get(endpoint, url, key))
    data[-5] ^= 0x01
    put(endpoint, url, key, bytes(data))
    return key


def manifests(endpoint: str, url: str) -> list[int]:
    return sorted(int(k[5:13]) for k in data_keys(endpoint, url) if k.endswith("/manifest.json"))


def test_gc_keep_last_on_a_store_keeps_the_newest_good_step(s3: S3Server, url: str) -> None:
    o, ep = opts(s3.endpoint), s3.endpoint
    with Checkpointer(url, storage_options=o) as ck:
        for s in (5, 10, 15):
            ck.save(s, state(s)).result(timeout=60)
    key = corrupt(ep, url, 15)
    r = run_cli("verify", url, "--step", "15", *so(ep))
    assert r.code == 1 and f"{url}/{key}" in r.err, r.err
    mark = f".asyncckpt/bad/step_00000015.{attempt_of(ep, url, 15)}.json"
    assert mark in keys(ep, url)  # on the store: every later reader, on any node, knows it
    doc = json.loads(get(ep, url, mark))
    assert doc["path"] == f"{url}/{key}" and doc["reason"].startswith("checksum mismatch") and url not in doc["reason"]
    dry = run_cli("gc", url, "--keep-last", "1", "--min-age", "0", "--dry-run", "--json", *so(ep))
    assert dry.code == 0, dry.err
    predicted = strict_json(dry.out)
    assert [x["step"] for x in predicted["retired"]] == [5] and predicted["kept_steps"] == [10]
    assert predicted["newest_known_bad"] == 15 and [b["step"] for b in predicted["bad"]] == [15]
    real = run_cli("gc", url, "--keep-last", "1", "--min-age", "0", "--json", *so(ep))
    assert real.code == 0, real.err
    assert strict_json(real.out)["retired"] == predicted["retired"]
    assert manifests(ep, url) == [10, 15]
    latest = asyncckpt.find_latest(url, storage_options=o)
    assert latest is not None and latest.step == 10
    assert asyncckpt.load(url, storage_options=o)["extra"]["step"] == 10
    assert run_cli("verify", url, *so(ep)).out.startswith("step 10: ok")
    # --remove-bad: the known-bad step goes (manifest, objects, mark); the good one stays
    r = run_cli("gc", url, "--remove-bad", "--min-age", "0", "--json", *so(ep))
    assert r.code == 0 and [b["removed"] for b in strict_json(r.out)["bad"]] == [True], r.err
    assert manifests(ep, url) == [10] and not [k for k in data_keys(ep, url) if k.startswith("step_00000015/")]
    assert mark not in keys(ep, url)


def test_store_root_falls_back_then_saves_the_bad_step_again(
    s3: S3Server, url: str, caplog: pytest.LogCaptureFixture
) -> None:
    o, ep = opts(s3.endpoint), s3.endpoint
    with Checkpointer(url, storage_options=o, keep_last=2) as ck:
        for s in (5, 10, 15):
            ck.save(s, state(s)).result(timeout=60)
    assert manifests(ep, url) == [10, 15]
    corrupt(ep, url, 15)
    old = attempt_of(ep, url, 15)
    with Checkpointer(url, storage_options=o, keep_last=2) as ck:
        latest = ck.latest()
        assert latest is not None and latest.step == 15  # nobody has read its data yet
        with caplog.at_level(logging.WARNING, logger="asyncckpt"):
            assert ck.load()["extra"]["step"] == 10
        assert any("does not verify" in r.getMessage() for r in caplog.records)
        latest = ck.latest()
        assert latest is not None and latest.step == 10
        assert ck.steps() == [10]
        assert f".asyncckpt/bad/step_00000015.{old}.json" in keys(ep, url)
        ck.save(15, state(15)).result(timeout=60)  # the bad attempt is set aside
        ck.save(20, state(20)).result(timeout=60)  # keep_last=2 counts 15 and 20: 10 goes
        assert ck.steps() == [15, 20]
    aside = [k for k in data_keys(ep, url) if k.startswith(f"step_00000015/bad-{old}") or
             k.startswith(f"step_00000015/a-{old}/")]  # fmt: skip
    assert sorted(aside) == sorted([f"step_00000015/bad-{old}.json", f"step_00000015/a-{old}/rank00000.json",
                                    f"step_00000015/a-{old}/rank00000.safetensors"])  # fmt: skip
    assert manifests(ep, url) == [15, 20] and attempt_of(ep, url, 15) != old
    assert asyncckpt.load(url, 15, storage_options=o)["extra"]["step"] == 15
    # a later start (which removes leftovers under its lease) keeps the set-aside attempt
    with Checkpointer(url, storage_options=o, keep_last=2) as ck:
        assert ck.latest().step == 20  # type: ignore[union-attr]
        ck.save(25, state(25)).result(timeout=60)
    assert all(k in data_keys(ep, url) for k in aside)
    r = run_cli("ls", url, "--json", *so(ep))
    rows = strict_json(r.out)
    by = {(x["step"], x["status"]) for x in rows}
    assert (15, "aside") in by and (20, "complete") in by and (25, "complete") in by, rows
    row = next(x for x in rows if x["status"] == "aside")
    assert row["name"] == f"step_00000015/bad-{old}.json" and "set aside" in row["reason"] and not row["resumable"]
    text = run_cli("ls", url, *so(ep)).out
    assert any(ln.split()[1] == "aside" for ln in text.splitlines()[1:]), text
    r = run_cli("gc", url, "--remove-bad", "--min-age", "0", *so(ep))
    assert r.code == 0 and "removed step_00000015/bad-" in r.out, (r.out, r.err)
    assert not [k for k in data_keys(ep, url) if k in aside] and manifests(ep, url) == [20, 25]
