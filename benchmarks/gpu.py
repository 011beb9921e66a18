"""The CUDA cases of issue 11, side by side in one run: staging a GPU state into the pinned
arena against the machine's pinned D2H copy, and restoring into CUDA targets against the raw
read of the same bytes.

    python benchmarks/gpu.py --sizes 1G,4G --restore-sizes 1G --repeats 5 --out DIR

State: the transformer-like fp32 state of ``states.py`` (model + Adam moments) on the GPU.
Every figure is a median of ``--repeats`` after a warm-up; the variants of one section run
round-robin, so a noisy neighbour hits all alike.

Save (each size):

* ``pinned D2H``: ``copy_(non_blocking=True)`` of every tensor into preallocated pinned host
  tensors, then a device synchronize (``limits.py``): the limit for staging;
* ``pinned D2H, one buffer``: one contiguous device buffer of the same bytes into one pinned
  buffer: the link's peak;
* ``asyncckpt``: ``Checkpointer.save()`` after ``reserve()`` (pinned arena): *blocking* (until
  ``save()`` returns: the copies are queued on a side stream), *staged* (until a device
  synchronize after it returns: the copies have run), ``device_copy_s`` (the same, as the
  writer saw it) and *durable* (``result()``: written, fsynced, committed);
* ``dcp.async_save[stager-cached]``: DCP's reused ``DefaultStager`` with pinned memory and
  non-blocking copies (its best stager): blocking = until ``staging_completion``, durable =
  ``upload_completion`` plus the directory fsyncs DCP does not do;
* ``raw write``: the same bytes from host memory, ``O_DIRECT`` and buffered, + fsync.

Restore (``--restore-sizes``), cold (``posix_fadvise(DONTNEED)`` after an fsync) and warm:

* ``raw read x4 -> pinned``: ``preadv`` on 4 threads into a pinned host buffer: the limit;
* ``raw read x4 -> pinned -> H2D``: the same, then one host-to-device copy (serial);
* ``asyncckpt.load(into=cuda)``: verified (CRC-32C as pieces land), and ``verify=False``;
* ``torch.load(map_location=cuda) + copy_`` into the live state.

Writes ``results.json`` (after every section, so a run cut short keeps what it measured)
and ``results.md`` to ``--out``. ``--device cpu`` runs the same harness without a GPU (a
smoke test of the script; its figures mean nothing for the GPU).
"""

from __future__ import annotations

import argparse
import json
import os
import platform
import shutil
import statistics
import sys
import tempfile
import time
from collections.abc import Callable
from typing import Any

HERE = os.path.dirname(os.path.abspath(__file__))
REPO = os.path.dirname(HERE)
for p in (HERE, REPO):
    if p not in sys.path:
        sys.path.insert(0, p)

import torch  # noqa: E402
from limits import Limits  # noqa: E402
from measure import PeakMemory, drop_cache, summary  # noqa: E402
from methods import DcpAsync, Unsupported  # noqa: E402
from restore import _parallel_read  # noqa: E402
from states import StateSpec, build_state, checksums, copy_into, format_size, mutate, parse_size  # noqa: E402

import asyncckpt  # noqa: E402
from asyncckpt.loading import _readinto  # noqa: E402


def _sync(device: torch.device) -> None:
    if device.type == "cuda":
        torch.cuda.synchronize(device)


def _med(xs: list[float]) -> float | None:
    return statistics.median(xs) if xs else None


def save_cases(
    spec: StateSpec, repeats: int, scratch: str, deadline: float, compare_cpu: bool = False
) -> dict[str, Any]:
    device = torch.device(spec.device)
    state = build_state(spec)
    lim = Limits(state, os.path.join(scratch, "raw"))
    nbytes = lim.nbytes
    flat = torch.empty(nbytes, dtype=torch.uint8, device=device)
    flat_host = torch.empty(nbytes, dtype=torch.uint8, pin_memory=device.type == "cuda")

    def one_buffer() -> float:
        _sync(device)
        t0 = time.perf_counter()
        flat_host.copy_(flat, non_blocking=True)
        _sync(device)
        return time.perf_counter() - t0

    ck = asyncckpt.Checkpointer(os.path.join(scratch, "ack"), keep_last=1)
    ck.reserve(state)
    dcp = DcpAsync("stager-cached")
    notes: list[str] = []
    dead: set[str] = set()
    try:
        dcp.open(os.path.join(scratch, "dcp"), state)
    except Exception as e:  # noqa: BLE001 - an older torch without DCP's stager: the row is left out
        dead.add("dcp")
        notes.append(f"dcp: unsupported here: {type(e).__name__}: {e}")
    step = [0]
    samples: dict[str, list[float]] = {
        k: []
        for k in (
            "pinned D2H",
            "pinned D2H, one buffer",
            "asyncckpt blocking",
            "asyncckpt staged",
            "asyncckpt device_copy_s",
            "asyncckpt durable",
            "asyncckpt writer CPU",
            "asyncckpt write_s",
            "asyncckpt fsync_s",
            "asyncckpt commit_s",
            "asyncckpt direct_io",
            "asyncckpt, CPU copy of the state: blocking",
            "asyncckpt, CPU copy of the state: durable",
            "dcp blocking",
            "dcp durable",
            "raw write O_DIRECT",
            "raw write buffered",
        )
    }

    def run_asyncckpt() -> None:
        step[0] += 1
        _sync(device)
        t0 = time.perf_counter()
        h = ck.save(step[0], state)
        t1 = time.perf_counter()
        _sync(device)
        t2 = time.perf_counter()
        info = h.result(600)
        t3 = time.perf_counter()
        st = info.statistics
        assert st is not None
        samples["asyncckpt blocking"].append(t1 - t0)
        samples["asyncckpt staged"].append(t2 - t0)
        samples["asyncckpt device_copy_s"].append(st.device_copy_s)
        samples["asyncckpt durable"].append(t3 - t0)
        samples["asyncckpt writer CPU"].append(st.writer_cpu_s)
        samples["asyncckpt write_s"].append(st.write_s)
        samples["asyncckpt fsync_s"].append(st.fsync_s)
        samples["asyncckpt commit_s"].append(st.commit_s)
        samples["asyncckpt direct_io"].append(float(st.direct_io))

    cpu_state = build_state(StateSpec(spec.kind, spec.nbytes, spec.n_tensors, "cpu")) if compare_cpu else None
    ck_cpu = asyncckpt.Checkpointer(os.path.join(scratch, "ack-cpu"), keep_last=1)
    if cpu_state is not None:
        ck_cpu.reserve(cpu_state)

    def run_cpu_state() -> None:
        """The same bytes from host memory: the file-system path without the device copy."""
        step[0] += 1
        t0 = time.perf_counter()
        h = ck_cpu.save(step[0], cpu_state)
        t1 = time.perf_counter()
        h.result(600)
        samples["asyncckpt, CPU copy of the state: blocking"].append(t1 - t0)
        samples["asyncckpt, CPU copy of the state: durable"].append(time.perf_counter() - t0)

    def run_dcp() -> None:
        step[0] += 1
        _sync(device)
        t0 = time.perf_counter()
        pending = dcp.save(step[0], state)
        t1 = time.perf_counter()
        dcp.finish(pending)
        t2 = time.perf_counter()
        samples["dcp blocking"].append(t1 - t0)
        samples["dcp durable"].append(t2 - t0)
        dcp.remove(step[0])

    def raw(direct: bool) -> None:
        samples["raw write O_DIRECT" if direct else "raw write buffered"].append(lim.write(direct=direct))
        if lim.last_file:
            os.unlink(lim.last_file)

    variants: list[tuple[str, Callable[[], None]]] = [
        ("pinned D2H", lambda: samples["pinned D2H"].append(lim.memcpy())),
        ("pinned D2H, one buffer", lambda: samples["pinned D2H, one buffer"].append(one_buffer())),
        ("asyncckpt", run_asyncckpt),
        *([("asyncckpt cpu state", run_cpu_state)] if cpu_state is not None else []),
        ("dcp", run_dcp),
        ("raw O_DIRECT", lambda: raw(True)),
        ("raw buffered", lambda: raw(False)),
    ]
    try:
        for rep in range(repeats + 1):  # the first round is the warm-up
            if rep > 1 and time.monotonic() > deadline:
                notes.append(f"stopped after {rep - 1} repeats: the run's time budget was spent")
                break
            for name, fn in variants:
                if name in dead:
                    continue
                try:
                    fn()
                except Unsupported as e:
                    dead.add(name)
                    notes.append(f"{name}: unsupported here: {e}")
                except Exception as e:
                    if name != "dcp":
                        raise
                    dead.add(name)  # the baseline failing must not cost the run its other rows
                    notes.append(f"dcp: failed: {type(e).__name__}: {e}")
                print(f"save {spec.name} round {rep}: {name} done", file=sys.stderr, flush=True)
            if rep == 0:
                for xs in samples.values():
                    xs.clear()
        # correctness: the checkpoint holds the state as it was at the call
        want = checksums(state)
        step[0] += 1
        h = ck.save(step[0], state)
        mutate(state)
        info = h.result(600)
        got = asyncckpt.load(info.path.parent, step[0])
        verified = checksums(got) == want
    finally:
        ck.close()
        ck_cpu.close()
        dcp.close()
    return {
        "state": {"spec": spec.to_json(), "name": spec.name, "nbytes": nbytes},
        "samples": samples,
        "summary": {k: summary(v) for k, v in samples.items() if v},
        "verified_after_mutation": verified,
        "notes": notes,
    }


def restore_cases(spec: StateSpec, repeats: int, scratch: str, deadline: float) -> dict[str, Any]:
    device = torch.device(spec.device)
    state = build_state(spec)
    want = checksums(state)
    root = os.path.join(scratch, "rst")
    with asyncckpt.Checkpointer(root) as ck:
        info = ck.save(1, state).result(600)
    step_dir = str(info.path)
    pt = os.path.join(scratch, "state.pt")
    with open(pt, "wb") as f:
        torch.save(state, f)
        f.flush()
        os.fsync(f.fileno())
    lim = Limits(state, os.path.join(scratch, "rraw"))
    lim.write()
    assert lim.last_file is not None
    raw_file, nbytes = lim.last_file, lim.nbytes
    pinned = torch.empty(nbytes, dtype=torch.uint8, pin_memory=device.type == "cuda")
    pinned_view = memoryview(pinned.numpy()).cast("B")  # type: ignore[arg-type]
    on_device = torch.empty(nbytes, dtype=torch.uint8, device=device)

    def raw_read() -> None:
        _parallel_read(raw_file, pinned_view, nbytes, 4)

    def raw_read_h2d() -> None:
        raw_read()
        on_device.copy_(pinned, non_blocking=True)
        _sync(device)

    def load(verify: bool) -> None:
        asyncckpt.load(root, 1, into=state, verify=verify)
        _sync(device)

    cpu_state = build_state(StateSpec(spec.kind, spec.nbytes, spec.n_tensors, "cpu"))

    def load_cpu() -> None:
        asyncckpt.load(root, 1, into=cpu_state)

    def load_threads(n: int) -> None:
        saved = _readinto.THREADS
        _readinto.THREADS = n
        try:
            load(True)
        finally:
            _readinto.THREADS = saved

    def torch_load() -> None:
        copy_into(state, torch.load(pt, map_location=device, weights_only=True))
        _sync(device)

    variants: dict[str, tuple[list[str], Callable[[], None]]] = {
        "raw read x4 -> pinned": ([raw_file], raw_read),
        "raw read x4 -> pinned -> H2D": ([raw_file], raw_read_h2d),
        "asyncckpt.load(into=)": ([step_dir], lambda: load(True)),
        "asyncckpt.load(into=, verify=False)": ([step_dir], lambda: load(False)),
        "torch.load(map_location) + copy_": ([pt], torch_load),
        "asyncckpt.load(into=), 8 I/O threads": ([step_dir], lambda: load_threads(8)),
        "asyncckpt.load(into=) into CPU targets": ([step_dir], load_cpu),
    }
    times: dict[str, dict[str, list[float]]] = {v: {"cold": [], "warm": []} for v in variants}
    notes: list[str] = []
    for _, fn in variants.values():
        fn()  # warm-up
    for mode in ("cold", "warm"):
        for rep in range(repeats):
            if rep > 1 and time.monotonic() > deadline:
                notes.append(f"{mode}: stopped after {rep} repeats: the run's time budget was spent")
                break
            for name, (files, fn) in variants.items():
                if mode == "cold":
                    drop_cache(files)
                else:
                    fn()
                _sync(device)
                t0 = time.perf_counter()
                fn()
                times[name][mode].append(time.perf_counter() - t0)
                print(f"restore {spec.name} {mode}: {name} {times[name][mode][-1]:.3f} s", file=sys.stderr, flush=True)
    mutate(state)
    asyncckpt.load(root, 1, into=state)
    verified = checksums(state) == want
    drop_cache([step_dir])
    with PeakMemory() as pm:
        load(True)
    return {
        "state": {"spec": spec.to_json(), "name": spec.name, "nbytes": nbytes},
        "times": {n: {m: summary(xs) for m, xs in d.items() if xs} for n, d in times.items()},
        "samples": times,
        "peak_extra_rss_load_into": pm.to_json(),
        "verified": verified,
        "notes": notes,
    }


def _targets(r: dict[str, Any]) -> list[dict[str, Any]]:
    """Issue 11's figures for the GPU, with verdicts."""
    out: list[dict[str, Any]] = []
    for s in r.get("save", []):
        m = {k: _med(v) for k, v in s["samples"].items()}
        name = s["state"]["name"]
        d2h, staged = m.get("pinned D2H"), m.get("asyncckpt staged")
        if d2h and staged:
            out.append({"state": name, "target": "D2H staging >= 0.8x pinned D2H throughput",
                        "value": d2h / staged, "ok": d2h / staged >= 0.8})  # fmt: skip
        direct, durable = m.get("raw write O_DIRECT"), m.get("asyncckpt durable")
        buffered = m.get("raw write buffered")
        best = min(x for x in (direct, buffered) if x) if (direct or buffered) else None
        if best and durable:
            out.append({"state": name, "target": "durable <= 1.1x raw write + fsync (the faster)",
                        "value": durable / best, "ok": durable / best <= 1.1})  # fmt: skip
        if m.get("dcp durable") and durable:
            out.append({"state": name, "target": "durable vs dcp.async_save[stager-cached] (ratio, lower is better)",
                        "value": durable / m["dcp durable"], "ok": None})  # fmt: skip
    for s in r.get("restore", []):
        name = s["state"]["name"]
        t = {k: {mode: (v.get(mode) or {}).get("median") for mode in ("cold", "warm")} for k, v in s["times"].items()}
        lim, ack = t["raw read x4 -> pinned"], t["asyncckpt.load(into=)"]
        tl = t["torch.load(map_location) + copy_"]
        for mode, goal in (("cold", 0.9), ("warm", 0.8)):
            if lim[mode] and ack[mode]:
                out.append({"state": name, "target": f"{mode} restore into CUDA, verified >= {goal}x raw read",
                            "value": lim[mode] / ack[mode], "ok": lim[mode] / ack[mode] >= goal})  # fmt: skip
        if tl["cold"] and ack["cold"]:
            out.append({"state": name, "target": "cold restore >= 2x faster than torch.load",
                        "value": tl["cold"] / ack["cold"], "ok": tl["cold"] / ack["cold"] >= 2.0})  # fmt: skip
    return out


def report(r: dict[str, Any]) -> str:
    lines = [f"# GPU cases ({r['machine'].get('gpu')}, torch {r['machine']['torch']}, {r['machine']['when']})", ""]
    for s in r.get("save", []):
        n = s["state"]["nbytes"]
        lines += [f"## save, {s['state']['name']} ({format_size(n)}B)", "", "| figure | median (s) | min-max | GB/s |",
                  "|---|---|---|---|"]  # fmt: skip
        for k, v in s["samples"].items():
            if not v:
                continue
            med = statistics.median(v)
            rate = "" if k.endswith(("CPU", "_s", "direct_io")) else f"{n / med / 1e9:.1f}" if med > 0 else ""
            lines.append(f"| {k} | {med:.4f} | {min(v):.4f}-{max(v):.4f} | {rate} |")
        lines += ["", f"state at the call restored after an immediate mutation: {s['verified_after_mutation']}"]
        lines += [f"- {x}" for x in s["notes"]] + [""]
    for s in r.get("restore", []):
        n = s["state"]["nbytes"]
        lines += [f"## restore, {s['state']['name']}", "", "| variant | cold (s) | GB/s | warm (s) | GB/s |",
                  "|---|---|---|---|---|"]  # fmt: skip
        for k, v in s["times"].items():
            cells = []
            for mode in ("cold", "warm"):
                med = (v.get(mode) or {}).get("median")
                cells += [f"{med:.4f}", f"{n / med / 1e9:.1f}"] if med else ["", ""]
            lines.append(f"| {k} | {' | '.join(cells)} |")
        rss = s["peak_extra_rss_load_into"]
        lines += ["", f"verified: {s['verified']}; peak extra RSS of a cold load(into=): {rss}"]
        lines += [f"- {x}" for x in s["notes"]] + [""]
    lines += ["## targets", "", "| state | target | measured | verdict |", "|---|---|---|---|"]
    for t in _targets(r):
        verdict = "n/a" if t["ok"] is None else "met" if t["ok"] else "missed"
        lines.append(f"| {t['state']} | {t['target']} | {t['value']:.2f}x | {verdict} |")
    return "\n".join(lines) + "\n"


def main(argv: list[str] | None = None) -> int:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--sizes", default="1G", help="save cases: state sizes")
    ap.add_argument("--restore-sizes", default="1G", help="restore cases: state sizes ('none' skips)")
    ap.add_argument("--repeats", type=int, default=5)
    ap.add_argument("--budget-s", type=float, default=1e9, help="stop repeating (keep >= 2) past this many seconds")
    ap.add_argument("--device", default="cuda")
    ap.add_argument("--compare-cpu", action="store_true", help="save cases: also save a CPU copy of the state")
    ap.add_argument("--out", default=os.path.join(REPO, "bench-results", "gpu"))
    ap.add_argument("--scratch", default=None)
    ap.add_argument("--report-only", default=None)
    args = ap.parse_args(argv)
    if args.report_only:
        with open(args.report_only) as f:
            md = report(json.load(f))
        print(md)
        return 0
    if args.device == "cuda" and not torch.cuda.is_available():
        ap.error("no CUDA here (--device cpu runs the harness as a smoke test)")
    deadline = time.monotonic() + args.budget_s
    os.makedirs(args.out, exist_ok=True)
    result: dict[str, Any] = {
        "machine": {
            "platform": platform.platform(),
            "cpus": os.cpu_count(),
            "torch": torch.__version__,
            "cuda": torch.version.cuda,
            "gpu": torch.cuda.get_device_name(0) if args.device == "cuda" else None,
            "when": time.strftime("%Y-%m-%dT%H:%M:%SZ", time.gmtime()),
        },
        "repeats": args.repeats,
        "save": [],
        "restore": [],
    }

    def dump() -> None:
        with open(os.path.join(args.out, "results.json"), "w") as f:
            json.dump(result, f, indent=1)
        with open(os.path.join(args.out, "results.md"), "w") as f:
            f.write(report(result))

    scratch = args.scratch or tempfile.mkdtemp(prefix="asyncckpt-gpu-")
    try:
        for size in [s for s in args.restore_sizes.split(",") if s and s != "none"]:
            spec = StateSpec("transformer", parse_size(size), device=args.device)
            result["restore"].append(restore_cases(spec, args.repeats, os.path.join(scratch, spec.name), deadline))
            shutil.rmtree(os.path.join(scratch, spec.name), ignore_errors=True)
            dump()
        for size in args.sizes.split(","):
            spec = StateSpec("transformer", parse_size(size), device=args.device)
            result["save"].append(
                save_cases(spec, args.repeats, os.path.join(scratch, spec.name), deadline, args.compare_cpu)
            )
            shutil.rmtree(os.path.join(scratch, spec.name), ignore_errors=True)
            dump()
    finally:
        if args.scratch is None:
            shutil.rmtree(scratch, ignore_errors=True)
    print(report(result))
    return 0


if __name__ == "__main__":
    sys.exit(main())
