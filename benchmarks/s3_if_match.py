"""Experiment (not a benchmark): does the loopback SeaweedFS enforce ``If-Match`` on PUT, through
obstore's ``mode={"e_tag": ...}``, well enough to hold a root lease by compare-and-swap?

Run: ``.venv/bin/python benchmarks/s3_if_match.py [--trials 20] [--racers 8]``. Prints one line
per question and a JSON summary (saved under benchmarks/results/ by hand). What the lease
(``asyncckpt/roots/objstore/_lease.py``) relies on:

1. a conditional update with the current ETag succeeds and returns the new ETag;
2. one with a stale ETag fails (``PreconditionError``) and leaves the object unchanged;
3. one against a missing key fails (AWS: 404; SeaweedFS: 412) - never creates it;
4. of N concurrent updates with the same current ETag exactly one wins (else two jobs could
   take over one stale lease together);
5. the ETag seen by GET, HEAD and LIST is the one ``If-Match`` compares with;
6. ``last_modified`` (the server's clock) of HEAD and LIST: its resolution, and that it moves
   on every update.

Result on SeaweedFS 4.48 (``benchmarks/results/s3-if-match-2026-12-04/output.txt``, 50 trials
of 8 racers): 1 yes (200, new ETag); 2 yes (``PreconditionError``, content unchanged); 3 412
(``PreconditionError``), nothing created; 4 exactly one winner with its bytes stored in 50 of
50 trials, every loser ``PreconditionError``; 5 PUT/GET/HEAD/LIST agree on the (quoted MD5)
ETag, and the same body again keeps the same ETag (so every lease write carries a counter);
6 whole seconds on HEAD and LIST alike, moving with each update.
"""

from __future__ import annotations

import argparse
import asyncio
import json
import sys
import time
import uuid
from pathlib import Path
from typing import Any

sys.path.insert(0, str(Path(__file__).resolve().parent.parent / "tests" / "support"))

import obstore
import obstore.exceptions as obx
from obstore.store import S3Store
from s3server import S3Server

BUCKET = "ifmatch-bucket"


def _store(server: S3Server) -> S3Store:
    return S3Store(BUCKET, prefix="exp", config=server.storage_options(),  # type: ignore[arg-type]
                   client_options={"allow_http": True})


async def _outcome(aw: Any) -> str:
    try:
        res = await aw
        return f"ok {res.get('e_tag')}"
    except obx.PreconditionError:
        return "precondition"
    except obx.AlreadyExistsError:
        return "exists"
    except FileNotFoundError:
        return "not-found"
    except Exception as e:  # noqa: BLE001 - the experiment reports whatever it is
        return f"error {type(e).__name__}: {str(e).splitlines()[0][:120]}"


async def run(server: S3Server, trials: int, racers: int) -> dict[str, Any]:
    s = _store(server)
    out: dict[str, Any] = {}
    key = f"lease-{uuid.uuid4().hex}"
    created = await obstore.put_async(s, key, b"v0", mode="create")
    e0 = created["e_tag"]
    head = await obstore.head_async(s, key)
    got = await obstore.get_async(s, key)
    listed = [m for chunk in obstore.list(s) for m in chunk if str(m["path"]).endswith(key)]
    out["etag_put_head_get_list"] = [e0, head["e_tag"], got.meta["e_tag"], listed[0]["e_tag"]]
    out["etags_agree"] = len({e0, head["e_tag"], got.meta["e_tag"], listed[0]["e_tag"]}) == 1
    out["last_modified_head_list"] = [str(head["last_modified"]), str(listed[0]["last_modified"])]

    # 1. right ETag
    r1 = await _outcome(obstore.put_async(s, key, b"v1", mode={"e_tag": e0}))
    out["update_right_etag"] = r1
    e1 = (await obstore.head_async(s, key))["e_tag"]
    # 2. stale ETag
    out["update_stale_etag"] = await _outcome(obstore.put_async(s, key, b"v2", mode={"e_tag": e0}))
    out["content_after_stale"] = bytes(await (await obstore.get_async(s, key)).bytes_async()).decode()
    # 3. missing key
    missing = f"missing-{uuid.uuid4().hex}"
    out["update_missing_key"] = await _outcome(obstore.put_async(s, missing, b"x", mode={"e_tag": e0}))
    try:
        await obstore.head_async(s, missing)
        out["missing_key_created"] = True
    except FileNotFoundError:
        out["missing_key_created"] = False
    # same body again: does the ETag change? (it is an MD5 of the body on S3)
    out["same_body_same_etag"] = await _outcome(obstore.put_async(s, key, b"v1", mode={"e_tag": e1}))
    e_same = (await obstore.head_async(s, key))["e_tag"]
    out["etag_after_same_body"] = [e1, e_same]

    # 4. racers: N concurrent updates with the same current ETag, distinct bodies
    wins: list[int] = []
    consistent = 0
    for t in range(trials):
        cur = (await obstore.head_async(s, key))["e_tag"]
        bodies = [f"trial {t} racer {i} {uuid.uuid4().hex}".encode() for i in range(racers)]
        res = await asyncio.gather(*(_outcome(obstore.put_async(s, key, b, mode={"e_tag": cur})) for b in bodies))
        oks = [i for i, r in enumerate(res) if r.startswith("ok")]
        wins.append(len(oks))
        stored = bytes(await (await obstore.get_async(s, key)).bytes_async())
        if len(oks) == 1 and stored == bodies[oks[0]]:
            consistent += 1
        others = {r for r in res if not r.startswith("ok")}
        out.setdefault("racer_losers_saw", sorted(others | set(out.get("racer_losers_saw", []))))
    out["racers"] = racers
    out["winners_per_trial"] = wins
    out["trials_exactly_one_winner_with_its_bytes_stored"] = f"{consistent}/{trials}"

    # 6. last_modified moves on update; its resolution
    lms = []
    for i in range(4):
        cur = (await obstore.head_async(s, key))["e_tag"]
        await obstore.put_async(s, key, f"tick {i}".encode(), mode={"e_tag": cur})
        h = await obstore.head_async(s, key)
        lst = next(m for chunk in obstore.list(s) for m in chunk if str(m["path"]).endswith(key))
        lms.append([time.time(), str(h["last_modified"]), str(lst["last_modified"])])
        await asyncio.sleep(0.4)
    out["last_modified_after_updates"] = lms
    return out


def main() -> None:
    ap = argparse.ArgumentParser()
    ap.add_argument("--trials", type=int, default=20)
    ap.add_argument("--racers", type=int, default=8)
    args = ap.parse_args()
    with S3Server() as server:
        server.create_bucket(BUCKET)
        res = asyncio.run(run(server, args.trials, args.racers))
    for k, v in res.items():
        print(f"{k}: {v}")
    print(json.dumps(res))


if __name__ == "__main__":
    main()
