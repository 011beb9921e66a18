"""A long run of saves: does the cost of a save grow with the run's length? (issue 32)

    python benchmarks/s3_soak.py                                   # 2,000 saves of each variant
    python benchmarks/s3_soak.py --saves 300 --variants seaweedfs  # one variant, shorter
    python benchmarks/s3_soak.py --out benchmarks/results/<name>

One loop per variant, each saving every iteration (``keep_last=2``, ``max_pending=2``, the
state's values changed in place between saves, as a trainer does):

- ``local``: a local root (``--local-mib``, 32 MiB by default);
- ``seaweedfs``: an ``s3://`` root on a loopback SeaweedFS, every request through a counting
  proxy (``--s3-mib``, 4 MiB by default: loopback S3 costs the server ~15 CPU-s per GiB, and
  the question is the per-save overhead, not the bandwidth);
- ``seaweedfs-keeps-prefixes``: the same with the proxy refusing the removal of empty
  "directories", so the store keeps one per step ever written (what SeaweedFS does on its
  own): the writer's look must not list or walk them;
- ``control``: no asyncckpt, the same objects PUT (shard, tree, manifest) and the step two
  back DELETEd, through the same proxy: the floor of a save on this machine.

Per save: the time from one ``save()`` call to the next (the loop's period), the blocking
time (``save()`` returning), the durable time (``statistics.total_s``), and on a store the
requests sent between two calls, by kind. Windows of 100 saves: the last window against the
first (time: median; requests: mean), and the noise of the run (the spread of the window
medians). Writes ``results.json``, ``table.md`` and, with matplotlib, ``soak.png`` (time
and requests per save against the save number) under ``--out``.
"""

from __future__ import annotations

import argparse
import datetime as _dt
import json
import os
import platform
import resource
import shutil
import statistics
import sys
import tempfile
import time
import uuid
from collections import Counter
from pathlib import Path
from typing import Any

ROOT = Path(__file__).resolve().parent.parent
sys.path.insert(0, str(ROOT / "tests" / "support"))
sys.path.insert(0, str(ROOT))

import torch  # noqa: E402

from asyncckpt import Checkpointer  # noqa: E402

MiB = 1024 * 1024
BUCKET = "soak-bucket"
WINDOW = 100
VARIANTS = ("local", "seaweedfs", "seaweedfs-keeps-prefixes", "control")


def make_state(size: int) -> dict[str, Any]:
    n = size // 4 // 4
    return {"model": {f"layer{i}.weight": torch.randn(n) for i in range(4)}, "step": 0}


def _kind(seen: Any) -> str:
    q = set(seen.query)
    if seen.path.endswith("/.asyncckpt/owner"):
        return "lease"
    what = ("LIST" if "list-type" in q else "LIST uploads" if "uploads" in q else "DELETE (bulk)" if "delete" in q
            else "manifest" if seen.path.endswith("/manifest.json") else "object")
    return what if what.startswith(("LIST", "DELETE")) else f"{seen.method} {what}"


def _rss_mib() -> float:
    with open("/proc/self/statm") as f:
        return int(f.read().split()[1]) * os.sysconf("SC_PAGE_SIZE") / MiB


def soak(ck: Checkpointer, state: dict[str, Any], saves: int, proxy: Any | None, label: str) -> list[dict[str, Any]]:
    """Save every iteration; one record per save (durable filled in when known)."""
    rows: list[dict[str, Any]] = []
    pending: list[tuple[Any, dict[str, Any]]] = []
    first = state["model"]["layer0.weight"]
    n0 = len(proxy.seen) if proxy is not None else 0
    t_start = t_prev = time.perf_counter()
    for i in range(saves):
        first[0] = float(i)  # the trainer changed the state
        state["step"] = i
        t0 = time.perf_counter()
        h = ck.save(i + 1, state)
        t1 = time.perf_counter()
        row: dict[str, Any] = {"save": i + 1, "blocking_s": t1 - t0, "period_s": t1 - t_prev}
        t_prev = t1
        if proxy is not None:
            n1 = len(proxy.seen)
            row["requests"] = dict(Counter(_kind(x) for x in proxy.seen[n0:n1]))
            n0 = n1
        if (i + 1) % WINDOW == 0:
            row["rss_mib"] = _rss_mib()
        rows.append(row)
        pending.append((h, row))
        still = []
        for hh, r in pending:
            if hh.done():
                st = hh.result().statistics
                r["durable_s"] = st.total_s if st is not None else None
            else:
                still.append((hh, r))
        pending = still
        if (i + 1) % 500 == 0:
            print(f"  {label}: {i + 1} saves, {time.perf_counter() - t_start:.0f}s", flush=True)
    for hh, r in pending:
        st = hh.result(timeout=600).statistics
        r["durable_s"] = st.total_s if st is not None else None
    return rows


def control(store: Any, state: dict[str, Any], saves: int, proxy: Any) -> list[dict[str, Any]]:
    """The same objects a save writes, PUT and DELETEd with obstore directly (no asyncckpt)."""
    import obstore

    blob = memoryview(bytearray(sum(t.numel() * 4 for t in state["model"].values())))
    rows = []
    n0 = len(proxy.seen)
    t_prev = time.perf_counter()
    for i in range(saves):
        t0 = time.perf_counter()
        sd = f"step_{i + 1:08d}"
        obstore.put(store, f"{sd}/a-x/rank00000.safetensors", blob, use_multipart=False)
        obstore.put(store, f"{sd}/a-x/rank00000.json", b"{}")
        obstore.put(store, f"{sd}/manifest.json", b"{}", mode="create")
        if i >= 2:
            old = f"step_{i - 1:08d}"
            obstore.delete(store, [f"{old}/manifest.json"])
            obstore.delete(store, [f"{old}/a-x/rank00000.safetensors", f"{old}/a-x/rank00000.json"])
        t1 = time.perf_counter()
        n1 = len(proxy.seen)
        rows.append({"save": i + 1, "blocking_s": t1 - t0, "durable_s": t1 - t0, "period_s": t1 - t_prev,
                     "requests": dict(Counter(_kind(x) for x in proxy.seen[n0:n1]))})
        n0, t_prev = n1, t1
    return rows


def summarize(rows: list[dict[str, Any]]) -> dict[str, Any]:
    """First and last window against each other, and the noise of the run's windows."""
    windows = [rows[i : i + WINDOW] for i in range(0, len(rows) - WINDOW + 1, WINDOW)] or [rows]
    first, last = windows[0][5:] if len(windows) > 1 else windows[0], windows[-1]

    def med(ws: list[dict[str, Any]], key: str) -> float:
        vals = [r[key] for r in ws if r.get(key) is not None]
        return statistics.median(vals) if vals else float("nan")

    def req(ws: list[dict[str, Any]]) -> float:
        return statistics.mean(sum(r.get("requests", {}).values()) for r in ws) if "requests" in ws[0] else 0.0

    period = [med(w, "period_s") for w in windows]
    out: dict[str, Any] = {"saves": len(rows), "windows": len(windows)}
    for key in ("period_s", "blocking_s", "durable_s"):
        out[key] = {"first": med(first, key), "last": med(last, key), "windows": [med(w, key) for w in windows]}
    out["period_s"]["noise"] = (max(period) - min(period)) / statistics.median(period) if period else 0.0
    if "requests" in rows[0]:
        out["requests"] = {"first": req(first), "last": req(last), "windows": [req(w) for w in windows]}
        kinds: Counter[str] = Counter()
        for r in last:
            kinds.update(r["requests"])
        out["requests"]["last_by_kind"] = {k: v / len(last) for k, v in sorted(kinds.items())}
    rss = [r["rss_mib"] for r in rows if "rss_mib" in r]
    if rss:
        out["rss_mib"] = {"first": rss[0], "last": rss[-1]}
    return out


def run_variant(name: str, args: argparse.Namespace) -> tuple[list[dict[str, Any]], dict[str, Any]]:
    if name == "local":
        scratch = tempfile.mkdtemp(prefix="asyncckpt-soak-", dir=args.scratch)
        try:
            with Checkpointer(scratch, keep_last=2, max_pending=2) as ck:
                rows = soak(ck, make_state(args.local_mib * MiB), args.saves, None, name)
            return rows, {"size_mib": args.local_mib, "root": "local"}
        finally:
            shutil.rmtree(scratch, ignore_errors=True)
    from s3fixtures import opts, store_for
    from s3proxy import FaultProxy, Rule
    from s3server import S3Server

    # room for every byte written (SeaweedFS reclaims deleted space only when it vacuums)
    volumes = max(8, int(args.saves * args.s3_mib * 1.3 / 256) + 4)
    server = S3Server(volumes=volumes)
    server.start()
    try:
        server.create_bucket(BUCKET)
        proxy = FaultProxy(server.s3_port, max_lifetime=24 * 3600).start()
        try:
            url = f"s3://{BUCKET}/soak-{uuid.uuid4().hex[:8]}"
            state = make_state(args.s3_mib * MiB)
            if name == "control":
                return control(store_for(proxy.endpoint, url), state, args.saves, proxy), {"size_mib": args.s3_mib}
            if name == "seaweedfs-keeps-prefixes":  # the removal of empty "directories" refused
                proxy.add(Rule("status", method="POST", query_has=("delete",),
                               body_regex=rb"/(step_\d+|a-[0-9a-f]+)</Key>", times=10**9, status=400,
                               code="InvalidArgument"))
            with Checkpointer(url, storage_options=opts(proxy.endpoint), keep_last=2, max_pending=2) as ck:
                rows = soak(ck, state, args.saves, proxy, name)
            import obstore

            prefixes = len(obstore.list_with_delimiter(store_for(server.endpoint, url), None)["common_prefixes"])
            return rows, {"size_mib": args.s3_mib, "prefixes_left": prefixes}
        finally:
            proxy.stop()
    finally:
        server.close()


def table(results: dict[str, Any]) -> str:
    lines = [
        f"# Soak: {results['saves']} saves per variant, keep_last=2, max_pending=2 ({results['machine']})",
        "",
        "Time per save = the loop's period (one `save()` call to the next); medians of the first 100 saves "
        "(saves 6-100) and the last 100. Noise: the spread of the 100-save window medians of the period "
        "over the run, relative to their median. Requests: mean per save, lease renewals included.",
        "",
        "| variant | size | time/save first → last | blocking first → last | durable first → last | noise "
        "| requests/save first → last | RSS first → last |",
        "|---|---|---|---|---|---|---|---|",
    ]
    for name, v in [*results["variants"].items(), *results.get("baseline", {}).items()]:
        s = v["summary"]

        def ms(key: str, s: dict[str, Any] = s) -> str:
            return f"{s[key]['first'] * 1e3:.0f} → {s[key]['last'] * 1e3:.0f} ms"

        req = f"{s['requests']['first']:.1f} → {s['requests']['last']:.1f}" if "requests" in s else "-"
        rss = f"{s['rss_mib']['first']:.0f} → {s['rss_mib']['last']:.0f} MiB" if "rss_mib" in s else "-"
        lines.append(f"| {name} | {v['meta']['size_mib']} MiB | {ms('period_s')} | {ms('blocking_s')} | "
                     f"{ms('durable_s')} | {s['period_s']['noise'] * 100:.0f}% | {req} | {rss} |")
    lines.append("")
    for name, v in results["variants"].items():
        if "requests" in v["summary"]:
            kinds = ", ".join(f"{k} {n:.2f}" for k, n in v["summary"]["requests"]["last_by_kind"].items())
            extra = f"; step prefixes left on the store: {v['meta']['prefixes_left']}" if "prefixes_left" in v["meta"] \
                else ""
            lines.append(f"- {name}, the last 100 saves, requests per save: {kinds}{extra}")
    return "\n".join(lines) + "\n"


def plot(results: dict[str, Any], path: Path) -> bool:
    try:
        import matplotlib

        matplotlib.use("Agg")
        import matplotlib.pyplot as plt
    except ImportError:
        print("matplotlib is not installed: no soak.png")
        return False
    fig, (ax1, ax2) = plt.subplots(2, 1, figsize=(10, 8), sharex=True)
    k = 25  # running statistics over 25 saves: the curve, not the jitter (saves overlap: max_pending=2)
    series = [(name, v, "-") for name, v in results["variants"].items()]
    series += [(name, v, "--") for name, v in results.get("baseline", {}).items()]
    for n, (name, v, ls) in enumerate(series):
        rows, color = v["rows"], f"C{n}"
        xs = [r["save"] for r in rows]
        ys = [statistics.median(r["period_s"] for r in rows[max(0, i - k + 1) : i + 1]) * 1e3 for i in range(len(rows))]
        ax1.plot(xs, ys, label=f"{name} ({v['meta']['size_mib']} MiB)", lw=1, ls=ls, color=color)
        if rows and "requests" in rows[0]:
            req = [sum(r["requests"].values()) for r in rows]
            ax2.plot(xs, [statistics.mean(req[max(0, i - k + 1) : i + 1]) for i in range(len(req))], label=name,
                     lw=1, ls=ls, color=color)
    ax1.set_ylabel("time per save, ms (running median of 25)")
    ax1.set_yscale("log")
    ax1.legend(fontsize=8)
    ax2.set_ylabel("requests per save (running mean of 25)")
    ax2.set_xlabel("save number")
    ax2.set_yscale("log")
    ax2.legend(fontsize=8)
    fig.suptitle(f"asyncckpt soak, keep_last=2 ({results['machine']})")
    fig.tight_layout()
    fig.savefig(path, dpi=110)
    return True


def _compact(obj: Any) -> Any:
    """``obj`` with its floats rounded to 10 us, and each variant's rows stored as columns
    (every sample kept; the JSON stays small). :func:`_expand` undoes the columns."""
    if isinstance(obj, float):
        return round(obj, 5)
    if isinstance(obj, dict):
        out = {k: _compact(v) for k, v in obj.items() if k != "rows"}
        if "rows" in obj:
            rows = obj["rows"]
            kinds = sorted({k for r in rows for k in r.get("requests", {})})
            cols: dict[str, Any] = {key: [_compact(r.get(key)) for r in rows]
                                    for key in ("save", "period_s", "blocking_s", "durable_s", "rss_mib")}
            if kinds:
                cols["requests"] = {k: [r["requests"].get(k, 0) for r in rows] for k in kinds}
            out["columns"] = cols
        return out
    if isinstance(obj, list):
        return [_compact(v) for v in obj]
    return obj


def _expand(variant: dict[str, Any]) -> dict[str, Any]:
    """A variant as :func:`_compact` stored it, with its rows back."""
    if "columns" not in variant:
        return variant
    cols = variant["columns"]
    rows = []
    for i, save in enumerate(cols["save"]):
        row = {k: cols[k][i] for k in ("period_s", "blocking_s", "durable_s", "rss_mib") if cols[k][i] is not None}
        row["save"] = save
        if "requests" in cols:
            row["requests"] = {k: v[i] for k, v in cols["requests"].items() if v[i]}
        rows.append(row)
    return {**{k: v for k, v in variant.items() if k != "columns"}, "rows": rows}


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--saves", type=int, default=2000)
    ap.add_argument("--variants", default=",".join(VARIANTS))
    ap.add_argument("--local-mib", type=int, default=32)
    ap.add_argument("--s3-mib", type=int, default=4)
    ap.add_argument("--out", default="bench-results/s3-soak")
    ap.add_argument("--scratch", default=None)
    ap.add_argument("--baseline", default=None,
                    help="a results.json of an earlier run (e.g. the code before the fix) to draw beside this one")
    ap.add_argument("--report-only", default=None, help="re-render table.md and soak.png from a results.json")
    args = ap.parse_args()
    out = Path(args.out)
    out.mkdir(parents=True, exist_ok=True)
    if args.report_only:
        results = json.loads(Path(args.report_only).read_text())
        results["variants"] = {k: _expand(v) for k, v in results["variants"].items()}
        results.pop("baseline", None)
    else:
        results = {"saves": args.saves, "date": _dt.datetime.now().isoformat(timespec="seconds"),
                   "machine": f"{platform.node()}, {os.cpu_count()} CPUs", "python": platform.python_version(),
                   "torch": torch.__version__, "variants": {}}
        for name in args.variants.split(","):
            if name not in VARIANTS:
                raise SystemExit(f"unknown variant {name!r}; one of {VARIANTS}")
            print(f"{name}: {args.saves} saves", flush=True)
            t0 = time.monotonic()
            rows, meta = run_variant(name, args)
            meta["wall_s"] = time.monotonic() - t0
            meta["maxrss_mib"] = resource.getrusage(resource.RUSAGE_SELF).ru_maxrss / 1024
            results["variants"][name] = {"meta": meta, "rows": rows, "summary": summarize(rows)}
            (out / "results.json").write_text(json.dumps(_compact(results)))
    if args.baseline:
        base = json.loads(Path(args.baseline).read_text())
        results["baseline"] = {f"{k} (before, {base['saves']} saves)": _expand(v) for k, v in base["variants"].items()}
    (out / "results.json").write_text(json.dumps(_compact(results)))
    (out / "table.md").write_text(table(results))
    plot(results, out / "soak.png")
    print((out / "table.md").read_text())


if __name__ == "__main__":
    main()
