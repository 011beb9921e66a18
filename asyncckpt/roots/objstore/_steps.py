"""Steps on an object store: the store's listing adapter of ``_stepstates``, and what follows
from its rule (the newest resumable step, retention, setting a bad attempt aside).

Names (``_layout``)::

    P/step_00000300/manifest.json              the commit object, created once
    P/step_00000300/a-<attempt>/...            the attempt's objects
    P/step_00000290/bad-<attempt>.json         a bad attempt set aside (its manifest's bytes;
                                               its objects stay under a-<attempt>/)
    P/.asyncckpt/bad/step_N.<attempt>.json     bad marks (``_badmarks``)

A step prefix is looked at through a listing of its keys and one GET of its manifest (none
when a cache knows the manifest by its listed ETag): it is *complete* iff the manifest
decodes (checksum, canonical form, its step, a hex attempt) and the listing shows exactly the
manifest's names with their sizes under its attempt's prefix; ``_stepstates.state_of`` then
decides (a bad mark on that attempt: known bad). The listing is one LIST of ``step_N/``
(:func:`observe_step`: the newest resumable step, an explicit step) or one flat LIST of the
root for every step at once (:func:`observe`: ``ls``, ``gc``, retention, leftovers; the lease
holder's look, ``_view``, lists only above its floor): empty prefixes are in no flat
listing, so what every step ever written left behind costs nothing. A store error propagates
(an unreachable store is never "no checkpoint"). Torch-free; imports obstore.
"""

from __future__ import annotations

import logging
import re
import time
import uuid
from collections.abc import Callable, Iterable
from dataclasses import dataclass, field
from typing import TYPE_CHECKING

from ..._errors import CheckpointCorruptError, CheckpointNotFoundError, ObjectIntegrityError, ObjectNotFoundError
from ...format._bounds import MAX_MANIFEST_BYTES
from ...format._layout import aside_key, data_prefix, manifest_key, parse_step_dir, step_dir_name, token_of
from ...format._manifest import Manifest, decode
from ...format._stepstates import Fault, Mark, Seen, same_run, state_of, victims
from .._badmarks import STORE_PREFIX, clear_on_store, store_marks
from ._client import ObjectStore
from ._reads import ObjectInfo

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


#: What looks learned of each step's manifest, by the ETag it had when read: step -> (ETag,
#: the manifest and its bytes, or why it does not decode). A manifest is created once, so
#: the same ETag in a later listing means the same bytes: no GET.
ManifestCache = dict[int, tuple[str, tuple[Manifest, bytes] | CheckpointCorruptError]]


async def read_manifest(store: ObjectStore, step: int, deadline: float) -> tuple[Manifest, bytes] | None:
    """The decoded manifest of ``step`` and its bytes, ``None`` if there is none."""
    found = await _get_manifest(store, step, deadline)
    if found is None:
        return None
    if isinstance(found[0], CheckpointCorruptError):
        raise found[0]
    return found[0]


async def _get_manifest(
    store: ObjectStore, step: int, deadline: float
) -> tuple[tuple[Manifest, bytes] | CheckpointCorruptError, str | None] | None:
    """One GET of ``step``'s manifest: (the manifest and its bytes, or why it is corrupt;
    the ETag of the bytes read), ``None`` if there is none."""
    key = manifest_key(step)
    url = store.object_url(key)
    try:
        raw, info = await store.get_object(key, deadline, limit=MAX_MANIFEST_BYTES)
    except ObjectNotFoundError:
        return None
    except ObjectIntegrityError:
        return CheckpointCorruptError(f"manifest larger than {MAX_MANIFEST_BYTES} bytes", url), None
    try:
        m = decode(raw, url)
        if m.step != step:
            raise CheckpointCorruptError(f"manifest is for step {m.step}", url)
        check_attempt(m, url)
    except CheckpointCorruptError as e:
        return e, info.e_tag
    return (m, raw), info.e_tag


async def _cached_manifest(
    store: ObjectStore, step: int, listed: ObjectInfo, deadline: float, cache: ManifestCache | None
) -> tuple[Manifest, bytes] | None:
    """``step``'s manifest as :func:`read_manifest` reads it, from ``cache`` when the listing
    shows it with the ETag it had when read (a manifest is created once: same ETag, same
    bytes), else from one GET (then remembered)."""
    hit = cache.get(step) if cache is not None and listed.e_tag else None
    if hit is not None and hit[0] == listed.e_tag:
        got: tuple[Manifest, bytes] | CheckpointCorruptError = hit[1]
    else:
        fetched = await _get_manifest(store, step, deadline)
        if fetched is None:
            if cache is not None:
                cache.pop(step, None)
            return None
        got, e_tag = fetched
        if cache is not None and e_tag:
            cache[step] = (e_tag, got)
    if isinstance(got, CheckpointCorruptError):
        raise got
    return got


def learn_manifest(cache: ManifestCache, step: int, e_tag: str | None, raw: bytes, url: str) -> None:
    """Remember the manifest a writer just created (``e_tag`` as read back), so the look
    after its commit needs no GET of it."""
    if not e_tag:
        return
    try:
        m = decode(raw, url)
    except CheckpointCorruptError:
        return
    if m.step == step:
        cache[step] = (e_tag, (m, raw))


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
    are leftovers: ``_leftovers``)."""

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


def by_step(listed: Iterable[ObjectInfo]) -> dict[int, list[ObjectInfo]]:
    """The objects of a flat listing under each canonical ``step_N/`` prefix (a prefix with
    no object is in no listing: empty "directories" cost nothing here)."""
    out: dict[int, list[ObjectInfo]] = {}
    for o in listed:
        name, sep, _ = o.key.partition("/")
        step = parse_step_dir(name) if sep else None
        if step is not None and step_dir_name(step) == name:
            out.setdefault(step, []).append(o)
    return out


async def observe_step(
    store: ObjectStore, step: int, deadline: float, known: dict[tuple[int, str], Mark] | None = None,
    cache: ManifestCache | None = None,
) -> StepPrefix:
    """Look at ``step_N/``: one LIST, and one GET of its manifest when the listing has one.
    ``known``: the store's bad marks (read here when not given)."""
    if known is None:
        known = await store_marks(store, deadline)
    listed = await store.list(step_dir_name(step) + "/", deadline)
    return await observe_listed(store, step, listed, deadline, known, cache, fresh=True)


async def observe_listed(
    store: ObjectStore, step: int, listed: list[ObjectInfo], deadline: float,
    known: dict[tuple[int, str], Mark], cache: ManifestCache | None = None, *, fresh: bool = False,
) -> StepPrefix:
    """``step_N/`` from ``listed``, its objects as a listing showed them: one GET of its
    manifest when listed (none when ``cache`` knows it by its ETag). Unless ``fresh`` (the
    listing was of this prefix alone), objects that do not match the manifest are looked at
    again with a LIST of the prefix before the step is called corrupt: a flat listing of
    many pages is no snapshot, and a commit may have landed between two of them."""
    sd = step_dir_name(step)
    out = StepPrefix(step, listed=sorted(listed, key=lambda o: o.key))
    keys = {o.key for o in out.listed}
    for o in out.listed:
        a = _ASIDE.match(o.key[len(sd) + 1:])
        if a is not None:
            token = a.group(1)
            out.seen.append(Seen(step, f"{sd}/bad-{token}", "aside", token, mark=known.get((step, token))))
    out.owned = aside_keys(step, sorted(keys))
    mkey = manifest_key(step)
    minfo = next((o for o in out.listed if o.key == mkey), None)
    if minfo is None:
        return out
    out.owned.add(mkey)
    try:
        found = await _cached_manifest(store, step, minfo, deadline, cache)
        if found is None:  # deleted since the LIST: retired meanwhile
            out.owned.discard(mkey)
            return out
        out.manifest, out.raw = found
        mine = data_prefix(step, found[0].attempt)
        out.owned.update(k for k in keys if k.startswith(mine))
        try:
            _match(store, found[0], out.listed, mine)
        except CheckpointCorruptError:
            if fresh:
                raise
            return await observe_step(store, step, deadline, known, cache)
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


async def observe(store: ObjectStore, deadline: float, cache: ManifestCache | None = None) -> list[StepPrefix]:
    """Every step prefix under the store's root that holds an object, oldest first: one flat
    LIST of the root (paginated: one request per 1,000 keys) and one GET per manifest (per
    mark), whatever number of steps were ever written and retired."""
    listed = await store.list("", deadline)
    known = await store_marks(store, deadline, listed=[o for o in listed if o.key.startswith(STORE_PREFIX)])
    grouped = by_step(listed)
    return [await observe_listed(store, s, grouped[s], deadline, known, cache) for s in sorted(grouped)]


#: A look that keeps seeing the listing change answers "none" after this long (and this many rounds).
_SETTLE_S = 10.0
_MIN_ROUNDS = 3


async def newest_resumable(
    store: ObjectStore, deadline: float, skip: frozenset[int] = frozenset(),
    passed: list[tuple[int, CheckpointCorruptError]] | None = None,
) -> tuple[Manifest, bytes] | None:
    """The newest resumable step not in ``skip`` (manifest, bytes), or ``None``; looks at the
    steps newest first and stops at the first. Steps passed over as corrupt or known bad are
    logged and, with ``passed``, listed there (newest first).

    Safe against a writer retiring steps meanwhile, as a local root's look is
    (``posix._discovery``): a step whose manifest was listed and is gone when read was
    retired, so whatever replaced it is newer than the listing: it lists again; and
    ``None`` is only answered from two identical listings of the step prefixes, so a
    checkpoint that existed throughout the look is never missed."""
    known = await store_marks(store, deadline)
    previous: list[int] | None = None
    settle = time.monotonic() + _SETTLE_S
    rounds = 0
    while True:
        rounds += 1
        candidates = await candidate_steps(store, deadline)
        bad: list[tuple[int, CheckpointCorruptError]] = []
        vanished = False
        for step in candidates:
            if step in skip:
                continue
            found = await observe_step(store, step, deadline, known)
            seen = found.committed
            if seen is None:
                if any(o.key == manifest_key(step) for o in found.listed):
                    vanished = True  # listed, then deleted before its GET: retired meanwhile
                    break
                continue  # no manifest: an attempt in progress or dead, or an empty prefix
            state = state_of(seen)
            if state == "complete" and found.manifest is not None and found.raw is not None:
                _pass_over(store, bad, passed)
                return found.manifest, found.raw
            if state == "bad":
                err = found.error
                if err is None and seen.mark is not None:
                    err = CheckpointCorruptError(f"known bad: verification failed: {seen.mark.reason}",
                                                 seen.mark.path or None)  # fmt: skip
                if err is not None:
                    bad.append((step, err))
        if (not vanished and candidates == previous) or (rounds >= _MIN_ROUNDS and time.monotonic() > settle):
            _pass_over(store, bad, passed)
            return None
        previous = candidates


def _pass_over(store: ObjectStore, bad: list[tuple[int, CheckpointCorruptError]],
               passed: list[tuple[int, CheckpointCorruptError]] | None) -> None:
    """Log the steps a look passed over (corrupt, known bad) and add them to ``passed``."""
    for step, err in bad:
        log.info("asyncckpt: passing over remote step %d under %s: %s", step, store.url, err)
    if passed is not None:
        passed.extend(bad)


async def resumable(store: ObjectStore, deadline: float) -> list[tuple[Manifest, bytes]]:
    """Every resumable step, newest first: one look (:func:`observe`); none only from two
    looks that saw the same step prefixes (:func:`newest_resumable`'s rule)."""
    previous: list[int] | None = None
    settle = time.monotonic() + _SETTLE_S
    rounds = 0
    while True:
        rounds += 1
        found = await observe(store, deadline)
        out = [(p.manifest, p.raw) for p in reversed(found)
               if p.committed is not None and state_of(p.committed) == "complete" and p.manifest is not None
               and p.raw is not None]  # fmt: skip
        listing = [p.step for p in found]
        if out or listing == previous or (rounds >= _MIN_ROUNDS and time.monotonic() > settle):
            return out
        previous = listing


# ------------------------------------------------------------------------------ acting on it


def dirs_of(keys: Iterable[str], top: str) -> list[str]:
    """The "directory" keys (``.../``) at or below ``top`` that hold ``keys``, deepest first:
    what :meth:`ObjectStore.remove_dirs` takes after those keys were deleted."""
    out: set[str] = set()
    for k in keys:
        parts = k.split("/")[:-1]
        for j in range(1, len(parts) + 1):
            d = "/".join(parts[:j]) + "/"
            if d.startswith(top):
                out.add(d)
    return sorted(out, key=lambda d: (-d.count("/"), d))


async def remove_step(store: ObjectStore, step: int, deadline: float, listed: Iterable[str] | None = None) -> bool:
    """Retire the commit of ``step``: its manifest first (it stops being complete at once),
    then every object of the step but those of attempts set aside (``listed``: the step's
    keys as a look just showed them, else one LIST of the prefix), then the "directories"
    left empty. Returns whether the prefix holds nothing any more."""
    sd = step_dir_name(step) + "/"
    mkey = manifest_key(step)
    await store.delete([mkey], deadline)
    keys = [o.key for o in await store.list(sd, deadline)] if listed is None else list(listed)
    kept = aside_keys(step, keys)
    rest = [k for k in keys if k not in kept and k != mkey]
    if rest:
        await store.delete(rest, deadline)
    await store.remove_dirs([d for d in dirs_of([*rest, mkey], sd) if not any(k.startswith(d) for k in kept)],
                            deadline)
    return not kept


def doomed(found: Iterable[StepPrefix], keep_last: int, protect: frozenset[int] = frozenset(),
           run: str | None = None) -> list[int]:
    """Which steps of ``found`` retention retires to keep the newest ``keep_last`` resumable
    ones (``_stepstates.victims``; with ``run``, only that run's steps count and go)."""
    good = {p.step: p for p in found if p.committed is not None and state_of(p.committed) == "complete"
            and (run is None or p.manifest is None or same_run(p.manifest.run, run))}
    return victims([(s, p.committed.created if p.committed else 0.0) for s, p in good.items()], keep_last,
                   protect=protect)


async def retire(
    store: ObjectStore, keep_last: int, deadline: float, lease: Lease | None = None,
    protect: frozenset[int] = frozenset(), run: str | None = None, *,
    found: list[StepPrefix] | None = None, removed: Callable[[int], None] | None = None,
) -> list[int]:
    """Keep the newest ``keep_last`` resumable steps; retire older resumable ones
    (``_stepstates.victims``: known-bad steps are neither counted nor removed, the newest
    resumable one never is). With ``lease``: nothing is removed once it was taken over
    (``RootInUseError``). With ``run``, only that run's steps count and go (``_runs``).
    ``found``: the steps as the caller's look just observed them (``_view``: the
    lease holder's; their listed keys are removed without another LIST), else one look
    now; ``removed(step)`` is told of each step whose prefix was emptied.
    Returns the retired steps, ascending."""
    if found is None:
        found = await observe(store, deadline)
        listed: dict[int, list[str] | None] = {}
    else:
        listed = {p.step: [o.key for o in p.listed] for p in found}
    out = doomed(found, keep_last, protect, run)
    for step in out:
        if lease is not None:
            lease.check()
        if await remove_step(store, step, deadline, listed.get(step)) and removed is not None:
            removed(step)
    return out


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
