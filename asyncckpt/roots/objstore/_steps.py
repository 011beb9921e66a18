"""Steps on an object store: the store's listing adapter of ``_stepstates``, and what follows
from its rule (the newest resumable step, retention, setting a bad attempt aside).

Names (``_layout``)::

    P/step_00000300/manifest.json              the commit object, created once
    P/step_00000300/a-<attempt>/...            the attempt's objects
    P/step_00000290/bad-<attempt>.json         a bad attempt set aside (its manifest's bytes;
                                               its objects stay under a-<attempt>/)
    P/.asyncckpt/bad/step_N.<attempt>.json     bad marks (``_badmarks``)

A step prefix is looked at with one LIST of ``step_N/`` and one GET of its manifest: it is
*complete* iff the manifest decodes (checksum, canonical form, its step, a hex attempt) and
the listing shows exactly the manifest's names with their sizes under its attempt's prefix;
``_stepstates.state_of`` then decides (a bad mark on that attempt: known bad). A store error
propagates (an unreachable store is never "no checkpoint"). Torch-free; imports obstore.
"""

from __future__ import annotations

import logging
import re
import uuid
from dataclasses import dataclass, field
from typing import TYPE_CHECKING

from ..._errors import CheckpointCorruptError, CheckpointNotFoundError, ObjectIntegrityError, ObjectNotFoundError
from ...format._bounds import MAX_MANIFEST_BYTES
from ...format._layout import aside_key, data_prefix, manifest_key, parse_step_dir, step_dir_name, token_of
from ...format._manifest import Manifest, decode
from ...format._stepstates import Fault, Mark, Seen, Steps, decide, same_run, state_of, victims
from .._badmarks import clear_on_store, store_marks
from ._client import ObjectInfo, ObjectStore

if TYPE_CHECKING:
    from ._lease import Lease

log = logging.getLogger("asyncckpt")

_ATTEMPT = re.compile(r"^[0-9a-f]{1,64}$")
_ASIDE = re.compile(r"^bad-([0-9a-f]{1,64})\.json$")


def check_attempt(m: Manifest, where: str) -> str:
    """``m``'s attempt id, which must be a hex token (it names keys); else corrupt."""
    if not _ATTEMPT.match(m.attempt):
        raise CheckpointCorruptError(f"manifest attempt id {m.attempt[:80]!r} is not a hex token", where)
    return m.attempt


async def candidate_steps(store: ObjectStore, deadline: float) -> list[int]:
    """Steps with a ``step_N/`` prefix on the store, newest first (numeric order)."""
    names = await store.list_dirs("", deadline)
    return sorted({s for n in names if (s := parse_step_dir(n)) is not None}, reverse=True)


async def read_manifest(store: ObjectStore, step: int, deadline: float) -> tuple[Manifest, bytes] | None:
    """The decoded manifest of ``step`` and its bytes, ``None`` if there is none."""
    key = manifest_key(step)
    url = store.object_url(key)
    try:
        raw = await store.get_bytes(key, deadline, limit=MAX_MANIFEST_BYTES)
    except ObjectNotFoundError:
        return None
    except ObjectIntegrityError:
        raise CheckpointCorruptError(f"manifest larger than {MAX_MANIFEST_BYTES} bytes", url) from None
    m = decode(raw, url)
    if m.step != step:
        raise CheckpointCorruptError(f"manifest is for step {m.step}", url)
    check_attempt(m, url)
    return m, raw


def _match(store: ObjectStore, m: Manifest, listed: list[ObjectInfo], prefix: str) -> None:
    """``CheckpointCorruptError`` unless ``listed`` (the objects under ``prefix``) are exactly
    the manifest's names with their sizes."""
    have = {o.key[len(prefix):]: o.size for o in listed if o.key.startswith(prefix)}
    for f in m.files:
        if f.name not in have:
            raise CheckpointCorruptError("object listed in the manifest is missing", store.object_url(prefix + f.name))
        if have[f.name] != f.size:
            raise CheckpointCorruptError(f"size {have[f.name]} != {f.size} recorded in the manifest",
                                         store.object_url(prefix + f.name))
    extra = sorted(set(have) - {f.name for f in m.files})
    if extra:
        raise CheckpointCorruptError(f"unexpected objects {extra[:5]}", store.object_url(prefix))


async def check_objects(store: ObjectStore, m: Manifest, deadline: float) -> None:
    """One LIST of the attempt prefix must show exactly the manifest's names and sizes."""
    prefix = data_prefix(m.step, m.attempt)
    _match(store, m, await store.list(prefix, deadline), prefix)


async def open_step(store: ObjectStore, step: int, deadline: float) -> tuple[Manifest, bytes]:
    """The manifest (and its bytes) of complete ``step``; ``CheckpointNotFoundError`` if it has
    no manifest, ``CheckpointCorruptError`` (naming the URL) if it is not complete. A bad mark
    is not consulted: an explicit step is read whatever was said of it."""
    found = await read_manifest(store, step, deadline)
    if found is None:
        raise CheckpointNotFoundError(f"no checkpoint for step {step} under {store.url}")
    await check_objects(store, found[0], deadline)
    return found


# ------------------------------------------------------------------------------ observation


def aside_keys(step: int, keys: list[str]) -> set[str]:
    """Of ``keys`` (under ``step_N/``), those of attempts set aside: each record
    ``bad-<attempt>.json`` and its attempt's objects. Kept until ``gc --remove-bad``."""
    sd = step_dir_name(step) + "/"
    tokens = [a.group(1) for k in keys if (a := _ASIDE.match(k[len(sd):])) is not None]
    return {k for k in keys for t in tokens if k == aside_key(step, t) or k.startswith(data_prefix(step, t))}


@dataclass
class StepPrefix:
    """What one ``step_N/`` prefix holds: its entries as ``_stepstates`` sees them (the
    committed one, when it has a manifest, and every attempt set aside), the manifest and its
    bytes when it decodes, the objects listed, and which of them belong to an entry (the rest
    are leftovers: ``_remote_leftovers``)."""

    step: int
    seen: list[Seen] = field(default_factory=list)
    manifest: Manifest | None = None
    raw: bytes | None = None
    listed: list[ObjectInfo] = field(default_factory=list)
    owned: set[str] = field(default_factory=set)
    error: CheckpointCorruptError | None = None  # why the committed entry is not complete

    @property
    def committed(self) -> Seen | None:
        return next((s for s in self.seen if s.kind == "committed"), None)


async def observe_step(
    store: ObjectStore, step: int, deadline: float, known: dict[tuple[int, str], Mark] | None = None
) -> StepPrefix:
    """Look at ``step_N/``: one LIST, and one GET of its manifest when the listing has one.
    ``known``: the store's bad marks (read here when not given)."""
    if known is None:
        known = await store_marks(store, deadline)
    sd = step_dir_name(step)
    out = StepPrefix(step, listed=await store.list(sd + "/", deadline))
    keys = {o.key for o in out.listed}
    for o in out.listed:
        a = _ASIDE.match(o.key[len(sd) + 1:])
        if a is not None:
            token = a.group(1)
            out.seen.append(Seen(step, f"{sd}/bad-{token}", "aside", token, mark=known.get((step, token))))
    out.owned = aside_keys(step, sorted(keys))
    mkey = manifest_key(step)
    if mkey not in keys:
        return out
    out.owned.add(mkey)
    try:
        found = await read_manifest(store, step, deadline)
        if found is None:  # deleted since the LIST: retired meanwhile
            out.owned.discard(mkey)
            return out
        out.manifest, out.raw = found
        mine = data_prefix(step, found[0].attempt)
        out.owned.update(k for k in keys if k.startswith(mine))
        _match(store, found[0], out.listed, mine)
    except CheckpointCorruptError as e:
        out.error = e
        if out.manifest is None:  # which attempt it names is unknown: nothing of the step is a leftover
            out.owned = set(keys)
        msg, path = str(e), e.path
        reason = msg[: -len(path) - 2] if path and msg.endswith(f": {path}") else msg
        m = out.manifest
        out.seen.insert(0, Seen(step, sd, "committed", None if m is None else m.attempt,
                                0.0 if m is None else m.created, Fault("corrupt", reason, path, proven=True)))
        return out
    m = out.manifest
    out.seen.insert(0, Seen(step, sd, "committed", m.attempt, m.created, None, known.get((step, token_of(m.attempt)))))
    return out


async def observe(store: ObjectStore, deadline: float) -> list[StepPrefix]:
    """Every step prefix under the store's root, oldest first."""
    known = await store_marks(store, deadline)
    return [await observe_step(store, s, deadline, known) for s in sorted(await candidate_steps(store, deadline))]


async def step_states(store: ObjectStore, deadline: float) -> Steps:
    """The state of every entry under the store's root (``_stepstates.decide``)."""
    return decide(s for p in await observe(store, deadline) for s in p.seen)


async def newest_resumable(
    store: ObjectStore, deadline: float, skip: frozenset[int] = frozenset(),
    passed: list[tuple[int, CheckpointCorruptError]] | None = None,
) -> tuple[Manifest, bytes] | None:
    """The newest resumable step not in ``skip`` (manifest, bytes), or ``None``; looks at the
    steps newest first and stops at the first. Steps passed over as corrupt or known bad are
    logged and, with ``passed``, listed there (newest first)."""
    known = await store_marks(store, deadline)
    for step in await candidate_steps(store, deadline):
        if step in skip:
            continue
        found = await observe_step(store, step, deadline, known)
        seen = found.committed
        if seen is None:
            continue
        state = state_of(seen)
        if state == "complete" and found.manifest is not None and found.raw is not None:
            return found.manifest, found.raw
        if state == "bad":
            err = found.error
            if err is None and seen.mark is not None:
                err = CheckpointCorruptError(f"known bad: verification failed: {seen.mark.reason}",
                                             seen.mark.path or None)  # fmt: skip
            if err is not None:
                log.info("asyncckpt: passing over remote step %d under %s: %s", step, store.url, err)
                if passed is not None:
                    passed.append((step, err))
    return None


async def newest_step(store: ObjectStore, deadline: float, *, warn: bool = False) -> int | None:
    """The newest resumable step; with ``warn``, each newer step passed over (corrupt, known
    bad) is logged as a WARNING, as a load that falls back logs it."""
    passed: list[tuple[int, CheckpointCorruptError]] = []
    found = await newest_resumable(store, deadline, passed=passed)
    for s, e in passed if warn else ():
        log.warning("asyncckpt: remote step %d under %s does not verify (%s); falling back", s, store.url, e)
    return None if found is None else found[0].step


async def resumable(store: ObjectStore, deadline: float) -> list[tuple[Manifest, bytes]]:
    """Every resumable step, newest first."""
    out = []
    for p in reversed(await observe(store, deadline)):
        seen = p.committed
        if seen is not None and state_of(seen) == "complete" and p.manifest is not None and p.raw is not None:
            out.append((p.manifest, p.raw))
    return out


# ------------------------------------------------------------------------------ acting on it


async def _remove_step(store: ObjectStore, step: int, deadline: float) -> None:
    """Retire the commit of ``step``: its manifest first (it stops being complete at once),
    then every object of the step but those of attempts set aside."""
    await store.delete([manifest_key(step)], deadline)
    listed = [o.key for o in await store.list(step_dir_name(step) + "/", deadline)]
    kept = aside_keys(step, listed)
    rest = [k for k in listed if k not in kept]
    if rest:
        await store.delete(rest, deadline)


async def retire(
    store: ObjectStore, keep_last: int, deadline: float, lease: Lease | None = None,
    protect: frozenset[int] = frozenset(), run: str | None = None,
) -> list[int]:
    """Keep the newest ``keep_last`` resumable steps; retire older resumable ones
    (``_stepstates.victims``: known-bad steps are neither counted nor removed, the newest
    resumable one never is). With ``lease``: nothing is removed once it was taken over
    (``RootInUseError``). With ``run``, only that run's steps count and go (``_runs``).
    Returns the retired steps, ascending."""
    found = await observe(store, deadline)
    good = {p.step: p for p in found if p.committed is not None and state_of(p.committed) == "complete"
            and (run is None or p.manifest is None or same_run(p.manifest.run, run))}
    doomed = victims([(s, p.committed.created if p.committed else 0.0) for s, p in good.items()], keep_last,
                     protect=protect)  # fmt: skip
    for step in doomed:
        if lease is not None:
            lease.check()
        await _remove_step(store, step, deadline)
    return doomed


async def remove_bad(store: ObjectStore, p: StepPrefix, deadline: float, lease: Lease | None = None) -> int:
    """``gc --remove-bad``: remove what of step prefix ``p`` is known bad: a known-bad commit
    (its manifest first, then every object of the step that is not a resumable commit's) and
    every attempt set aside, with their bad marks. Returns the bytes removed."""
    committed = p.committed
    bad = committed is not None and state_of(committed) == "bad"
    keep: set[str] = set()
    if not bad and p.manifest is not None:
        mine = data_prefix(p.step, p.manifest.attempt)
        keep = {o.key for o in p.listed if o.key == manifest_key(p.step) or o.key.startswith(mine)}
    doomed = [o.key for o in p.listed if o.key not in keep and (bad or o.key in p.owned)]
    if not doomed:
        return 0
    if lease is not None:
        lease.check()
    if bad:
        await store.delete([manifest_key(p.step)], deadline)  # first: it stops being a commit at once
    await store.delete(doomed, deadline)
    for s in p.seen:
        if s.attempt is not None and (s.kind == "aside" or state_of(s) == "bad"):
            await clear_on_store(store, p.step, s.attempt, deadline)
    log.info("removed %d object(s) of bad attempts under %s", len(doomed), store.object_url(step_dir_name(p.step)))
    return sum(o.size for o in p.listed if o.key in set(doomed))


async def set_aside(store: ObjectStore, p: StepPrefix, deadline: float) -> str:
    """Set the known-bad committed entry of ``p`` aside so that its step can be saved again:
    its manifest's bytes copied to ``step_N/bad-<attempt>.json`` (from then on its objects are
    kept, never leftovers), then the manifest deleted. Returns the record's key."""
    attempt = p.manifest.attempt if p.manifest is not None else uuid.uuid4().hex[:16]
    raw = p.raw
    if raw is None:  # the manifest does not decode: keep its bytes as they are
        try:
            raw = await store.get_bytes(manifest_key(p.step), deadline, limit=MAX_MANIFEST_BYTES)
        except (ObjectNotFoundError, ObjectIntegrityError):
            raw = b""
    key = aside_key(p.step, attempt)
    await store.put_file(key, memoryview(raw), deadline)
    await store.delete([manifest_key(p.step)], deadline)
    log.warning("asyncckpt: step %d under %s is known bad; set aside as %s (kept for inspection) to save it again",
                p.step, store.url, key)  # fmt: skip
    return key
