"""Leftovers on an object-store root: what is dead, found with as few requests as it takes,
and removed.

The object-store counterpart of ``_retention.leftovers`` / ``remove_leftovers``, from one flat
listing of the root (or the lease holder's look, ``_view``). Three kinds:

* ``dead-attempt``: objects under ``step_N/a-X/`` of a step whose manifest names another
  attempt. X can never commit (its create loses), so they are dead whoever wrote them.
* ``uncommitted``: a step prefix with no manifest (a save or push that failed, was killed,
  or a retirement interrupted after its manifest was deleted).
* ``upload``: an incomplete multipart upload (a writer killed mid-upload; the store keeps
  it, billed and invisible to LIST, until it is aborted).

The last two may belong to a live writer, so they are dead only while the root's lease
(``_lease``) is ours and they are not one of our own saves in flight: callers survey and
remove them only then (the Checkpointer at construction and after each commit, ``asyncckpt
gc URL`` for its run). A step known bad (``_stepstates``: a manifest that does not decode, a
commit whose objects do not match it, a bad mark) is never removed here (reported as left
alone, as on a POSIX root), and neither are attempts set aside (``step_N/bad-<attempt>.json``
and their objects): ``asyncckpt gc --remove-bad`` removes those.
"""

from __future__ import annotations

import datetime as _dt
import logging
from collections.abc import Collection, Sequence
from dataclasses import dataclass, field
from typing import Literal

from ..._errors import ObjectStoreError
from ...format._layout import step_dir_name
from ...format._stepstates import state_of, why_bad
from ._client import ObjectStore
from ._steps import StepPrefix, dirs_of, observe

log = logging.getLogger("asyncckpt")

Kind = Literal["dead-attempt", "uncommitted", "upload"]


@dataclass(frozen=True)
class Leftover:
    """One dead thing: ``name`` is a key prefix (``step_00000007/``, ``step_00000007/a-x/``)
    or, for an upload, its key; ``modified`` the newest ``last_modified`` of its objects (an
    upload's ``Initiated``), by the store's clock; ``size`` the bytes of its objects."""

    kind: Kind
    name: str
    size: int
    modified: _dt.datetime | None
    keys: tuple[str, ...] = ()
    upload_id: str | None = None
    step: int | None = None  # the step prefix it lies under (not set for uploads)


@dataclass
class Survey:
    """What :func:`survey` found: ``complete`` (resumable) steps, newest first, the
    ``leftovers``, the steps ``left_alone`` (name, problem: ``corrupt-manifest``,
    ``incomplete`` or ``bad``, reason), and every step prefix it looked at (``seen``: each
    held objects)."""

    complete: list[int] = field(default_factory=list)
    leftovers: list[Leftover] = field(default_factory=list)
    left_alone: list[tuple[str, str, str]] = field(default_factory=list)
    seen: set[int] = field(default_factory=set)
    nbytes: dict[int, int] = field(default_factory=dict)  # complete step -> bytes of its objects
    bad: dict[int, StepPrefix] = field(default_factory=dict)  # steps with a known-bad commit or an attempt set aside
    removed: bool = True  # (remove_dead) every leftover was removed


def _initiated(text: str) -> _dt.datetime | None:
    try:
        t = _dt.datetime.fromisoformat(text.strip().replace("Z", "+00:00"))
    except ValueError:
        return None
    return t if t.tzinfo is not None else t.replace(tzinfo=_dt.timezone.utc)


async def survey(
    store: ObjectStore,
    deadline: float,
    *,
    skip_steps: Collection[int] = (),
    keep_prefixes: Sequence[str] = (),
    uploads: bool = True,
    found: list[StepPrefix] | None = None,
) -> Survey:
    """Every step prefix under the root that holds an object, but ``skip_steps`` (one flat
    LIST of the root and one GET per manifest: ``_steps.observe``; or ``found``, the
    caller's look), and (``uploads``, where the store can list them) every incomplete upload
    not under ``keep_prefixes``."""
    out = Survey()
    if found is None:
        found = await observe(store, deadline)
    for p in found:
        step = p.step
        if step in skip_steps:
            continue
        out.seen.add(step)
        sd = step_dir_name(step) + "/"
        committed = p.committed
        if any(state_of(x) in ("bad", "aside") for x in p.seen):
            out.bad[step] = p
        if committed is not None:
            state = state_of(committed)
            if state == "complete":
                out.complete.append(step)
                # the manifest is one of its objects (what a local gc frees counts it too)
                m = p.manifest
                out.nbytes[step] = sum(f.size for f in m.files) + len(p.raw or b"") if m is not None else 0
            elif p.manifest is None:
                out.left_alone.append((sd, "corrupt-manifest", why_bad(committed)))
            elif committed.fault is not None:
                out.left_alone.append((sd, "incomplete", f"committed but not complete: {why_bad(committed)}"))
            else:
                out.left_alone.append((sd, "bad", f"known bad: {why_bad(committed)}"))
        stray = [o for o in p.listed if o.key not in p.owned]
        if not stray:
            continue
        if committed is None:
            out.leftovers.append(Leftover("uncommitted", sd, sum(o.size for o in stray),
                                          max(o.last_modified for o in stray), tuple(o.key for o in stray), step=step))
            continue
        others: dict[str, list[tuple[str, int, _dt.datetime]]] = {}
        for o in stray:
            rest = o.key[len(sd):]
            head = rest.split("/", 1)[0] + "/" if "/" in rest else rest
            others.setdefault(sd + head, []).append((o.key, o.size, o.last_modified))
        for name, objs in sorted(others.items()):
            out.leftovers.append(Leftover("dead-attempt", name, sum(s for _, s, _ in objs),
                                          max(t for _, _, t in objs), tuple(k for k, _, _ in objs), step=step))
    if uploads and store.can_list_uploads:
        try:
            pending = await store.list_uploads("", deadline)
        except ObjectStoreError as e:  # housekeeping: the bucket's lifecycle rule is the fallback
            log.warning("could not list incomplete uploads under %s: %s", store.url, e)
            pending = []
        for u in pending:
            if any(u.key.startswith(p) for p in keep_prefixes):
                continue
            out.leftovers.append(Leftover("upload", u.key, 0, _initiated(u.initiated), upload_id=u.upload_id))
    return out


async def remove(store: ObjectStore, leftovers: Sequence[Leftover], deadline: float) -> None:
    """Remove ``leftovers`` (call only while they are provably dead: module docstring), and
    the "directories" they leave empty (``ObjectStore.remove_dirs``)."""
    keys = [k for x in leftovers for k in x.keys]
    if keys:
        await store.delete(keys, deadline)
        await store.remove_dirs(
            sorted({d for x in leftovers if x.kind != "upload" for d in dirs_of(x.keys, x.name)},
                   key=lambda d: (-d.count("/"), d)),
            deadline,
        )
    for x in leftovers:
        if x.kind == "upload" and x.upload_id is not None:
            await store.abort_upload(x.name, x.upload_id, deadline)


async def remove_dead(
    store: ObjectStore, deadline: float, *, skip_steps: Collection[int] = (), keep_prefixes: Sequence[str] = (),
    looked: list[StepPrefix] | None = None,
) -> Survey:
    """Survey (``looked``: the steps as the caller's look observed them), then remove every
    leftover found (the caller holds the lease); logged. A removal that fails is logged,
    never raised: what is left is found again next time."""
    found = await survey(store, deadline, skip_steps=skip_steps, keep_prefixes=keep_prefixes, found=looked)
    if found.leftovers:
        try:
            await remove(store, found.leftovers, deadline)
        except ObjectStoreError as e:
            log.warning("could not remove leftovers under %s: %s", store.url, e)
            found.removed = False
        else:
            log.info("removed %d leftover(s) under %s: %s", len(found.leftovers), store.url,
                     ", ".join(x.name for x in found.leftovers[:10]))
    for name, _, reason in found.left_alone:
        log.warning("left alone %s: %s", store.object_url(name), reason)
    return found

