"""The growth run's figures, issue 32's targets with verdicts, the markdown and the PNG.

Every figure is computed from one state's two cases of the same run (``growth_cases.py``):
the asyncckpt median against the limit's median. Per-tensor figures (the tensor-count
sweep):

* save fixed work = (``save()`` blocking - the memcpy of the same tensors) / tensors: the
  walk, the layout plan, the tree's JSON and the per-tensor bookkeeping of the copy; and the
  same three measured inside ``save()`` (``SaveStatistics.prepare_s``, wall and the caller
  thread's CPU, ``prepare_cpu_s``) / tensors, no difference of two noisy wall times;
* load above the raw read = (cold ``load(into=)`` - raw cold read) / tensors, and the marginal
  cost, (load_k - load_j) / (n_k - n_j) between neighbouring counts: what one more tensor costs
  (the fixed cost of a load, manifest and header, cancels out), constant if loads are linear;
* memory per tensor: peak extra RSS of ``load(into=)`` / tensors; of the warm-up save less the
  staging buffer (laid out like the shard file, rounded up to 4 KiB) / tensors.
"""

from __future__ import annotations

import itertools
import statistics
from typing import Any

KiB = 1024
MiB = 1 << 20

#: issue 32's targets: (key, text)
TARGETS = (
    ("durable", "durable ≤ 1.2× raw O_DIRECT write + fsync, at every size"),
    ("save_fixed", "save: fixed work ≤ 5 µs per tensor (at the largest count)"),
    ("save_prepare", "save: walk + plan + tree JSON ≤ 5 µs per tensor, timed inside `save()` (at the largest count)"),
    ("save_memory", "save: ≤ 1 KiB per tensor above the staging buffer (at the largest count)"),
    ("save_gc", "save: no collector pass in `save()` (at every count)"),
    ("load_marginal", "load: ≤ 20 µs per extra tensor, between every two counts (linear)"),
    ("load_memory", "load: ≤ 1 KiB of peak memory per tensor (at the largest count)"),
)


def _med(case: dict[str, Any], key: str) -> float | None:
    v = case.get(key)
    return v.get("median") if isinstance(v, dict) else None


def _min(case: dict[str, Any], key: str) -> float | None:
    v = case.get(key)
    return v.get("min") if isinstance(v, dict) else None


def _ratio(a: float | None, b: float | None) -> float | None:
    return a / b if a is not None and b else None


Case = dict[str, Any]


def figures_of(c: Case) -> dict[str, Any]:
    """One state's figures: the medians, their ratios to the limits, and the per-tensor figures."""
    spec, info = c["spec"], c.get("state_info", {})
    n = info.get("n_tensors") or spec.get("n_tensors") or 1
    f: dict[str, Any] = {"state": c["state"], "kind": spec["kind"], "size": spec["nbytes"], "n_tensors": n,
                         "nbytes": info.get("nbytes", spec["nbytes"]), "ok": c.get("status") == "ok"}  # fmt: skip
    if not f["ok"]:
        f["why"] = f"{c.get('status')}: {c.get('reason', '')}"
        return f
    f.update(memcpy=_med(c, "memcpy"), raw_direct=_med(c, "write_direct"), read_cold=_med(c, "read_cold"),
             read_warm=_med(c, "read_warm"), blocking=_med(c, "blocking"), durable=_med(c, "durable"),
             load_cold=_med(c, "load_cold"), load_warm=_med(c, "load_warm"), write_phase=_med(c, "write_phase"),
             save_rss=c["save_memory"]["extra_bytes"], staging_bytes=c["staging_buffer_bytes"],
             load_rss=c["load_memory"]["extra_bytes"], bit_exact=c["load_bit_exact"], direct_io=c["direct_io"],
             gc_save_passes=_med(c["gc_save"], "passes"), gc_save_s=_med(c["gc_save"], "total_s"),
             gc_save_passes_samples=c["gc_save"]["passes"]["samples"],
             gc_save_max_s=max(c["gc_save"]["max_s"]["samples"], default=0.0),
             gc_durable_passes=_med(c["gc_to_durable"], "passes"),
             gc_load_passes=_med(c["gc_load_cold"], "passes"), gc_load_s=_med(c["gc_load_cold"], "total_s"),
             gc_load_max_s=max(c["gc_load_cold"]["max_s"]["samples"], default=0.0))  # fmt: skip
    f["save_above_staging"] = f["save_rss"] - f["staging_bytes"]
    f["save_bytes_per_tensor"] = f["save_above_staging"] / n
    f["load_bytes_per_tensor"] = f["load_rss"] / n
    f["blocking_x"] = _ratio(f["blocking"], f["memcpy"])
    f["durable_x"] = _ratio(f["durable"], f["raw_direct"])
    f["write_phase_x"] = _ratio(f["write_phase"], f["raw_direct"])
    f["load_cold_x"] = _ratio(f["load_cold"], f["read_cold"])
    f["load_warm_x"] = _ratio(f["load_warm"], f["read_warm"])
    f["save_fixed_us"] = (f["blocking"] - f["memcpy"]) / n * 1e6
    prep, prep_cpu = _med(c, "prepare"), _med(c, "prepare_cpu")  # (None: an asyncckpt without prepare_s)
    f["save_prepare_us"] = prep / n * 1e6 if prep is not None else None
    f["save_prepare_cpu_us"] = prep_cpu / n * 1e6 if prep_cpu is not None else None
    f["load_us"] = f["load_cold"] / n * 1e6
    f["load_above_us"] = (f["load_cold"] - f["read_cold"]) / n * 1e6
    # the same from the fastest repeat of each: on a shared machine, the closest to an unloaded one
    b = {k: _min(c, k) for k in ("memcpy", "write_direct", "read_cold", "read_warm", "blocking", "durable",
                                 "load_cold", "load_warm")}  # fmt: skip
    f["best"] = {
        "blocking_x": _ratio(b["blocking"], b["memcpy"]),
        "durable_x": _ratio(b["durable"], b["write_direct"]),
        "load_cold_x": _ratio(b["load_cold"], b["read_cold"]),
        "load_warm_x": _ratio(b["load_warm"], b["read_warm"]),
        "save_fixed_us": (b["blocking"] - b["memcpy"]) / n * 1e6,
        "save_prepare_us": _min(c, "prepare") / n * 1e6 if prep is not None else None,
        "load_above_us": (b["load_cold"] - b["read_cold"]) / n * 1e6,
        "load_cold": b["load_cold"],
    }
    return f


def evaluate(data: dict[str, Any]) -> tuple[dict[str, Any], list[dict[str, Any]]]:
    """The figures of every state (``sizes`` and ``counts``) and the targets' verdicts."""
    figs: dict[str, Any] = {"sizes": [], "counts": []}
    for c in data.get("results", []):
        f = figures_of(c)
        figs["sizes" if f["kind"] == "transformer" else "counts"].append(f)
    counts = sorted((f for f in figs["counts"] if f["ok"]), key=lambda f: f["n_tensors"])
    for prev, cur in itertools.pairwise(counts):
        dn = cur["n_tensors"] - prev["n_tensors"]
        cur["load_marginal_us"] = (cur["load_cold"] - prev["load_cold"]) / dn * 1e6
        cur["save_marginal_us"] = (cur["blocking"] - prev["blocking"]) / dn * 1e6
        cur["best"]["load_marginal_us"] = (cur["best"]["load_cold"] - prev["best"]["load_cold"]) / dn * 1e6
    figs["noise"] = noise(data)
    sizes = [f for f in figs["sizes"] if f["ok"]]
    last = counts[-1] if counts else None

    def verdict(key: str, figs: list[dict[str, Any]], name: str, limit: float, fmt: str, label: Any) -> dict[str, Any]:
        """Met when every one of ``figs`` has ``name`` <= ``limit``, on the medians and on the best repeats."""
        med = [f[name] for f in figs]
        best = [f["best"].get(name, f[name]) for f in figs]
        text = ", ".join(
            f"{label(f)}: {fmt.format(m)}" + ("" if fmt.format(m) == fmt.format(b) else f" (best {fmt.format(b)})")
            for f, m, b in zip(figs, med, best, strict=True)
        )
        return {"key": key, "target": dict(TARGETS)[key], "measured": text,
                "met": all(m <= limit for m in med), "met_best": all(b <= limit for b in best)}  # fmt: skip

    def by_size(f: dict[str, Any]) -> str:
        return _size(f["size"])

    def by_count(f: dict[str, Any]) -> str:
        return _count(f["n_tensors"])

    t = []
    if sizes:
        t.append(verdict("durable", sizes, "durable_x", 1.2, "{:.2f}×", by_size))
    if last:
        for f in counts:  # memory and GC passes are measured once (memory) or counted: no best repeat
            f["best"]["gc_save_passes"] = min(f["gc_save_passes_samples"], default=0)
            f["save_kib_per_tensor"] = f["save_bytes_per_tensor"] / KiB
            f["load_kib_per_tensor"] = f["load_bytes_per_tensor"] / KiB
            f["best"]["save_kib_per_tensor"] = f["save_kib_per_tensor"]
            f["best"]["load_kib_per_tensor"] = f["load_kib_per_tensor"]
        t.append(verdict("save_fixed", [last], "save_fixed_us", 5, "{:.1f} µs", by_count))
        if last.get("save_prepare_us") is not None:
            t.append(verdict("save_prepare", [last], "save_prepare_us", 5, "{:.2f} µs", by_count))
        t.append(verdict("save_memory", [last], "save_kib_per_tensor", 1, "{:.2f} KiB", by_count))
        t.append(verdict("save_gc", counts, "gc_save_passes", 0, "{:.0f} passes", by_count))
        marg = [f for f in counts if "load_marginal_us" in f]
        if marg:
            t.append(verdict("load_marginal", marg, "load_marginal_us", 20, "{:.1f} µs", lambda f: "→" + by_count(f)))
        t.append(verdict("load_memory", [last], "load_kib_per_tensor", 1, "{:.2f} KiB", by_count))
    return figs, t


NOISE_KEYS = ("memcpy", "raw_direct", "read_cold", "read_warm", "blocking", "durable", "load_cold", "load_warm")


def noise(data: dict[str, Any]) -> dict[str, Any] | None:
    """The noise state's figures in the main run and in the repeat at the end, and their spread."""
    again = [c for c in data.get("noise") or [] if c.get("status") == "ok"]
    first = [c for c in data.get("results", []) if again and c["state"] == again[0]["state"]]
    if not again or not first or first[0].get("status") != "ok":
        return None
    f1, f2 = figures_of(first[0]), figures_of(again[0])
    rows = {}
    for k in (*NOISE_KEYS, "blocking_x", "durable_x", "load_cold_x", "load_warm_x"):
        if f1.get(k) and f2.get(k):
            rows[k] = {"first": f1[k], "again": f2[k], "change": f2[k] / f1[k] - 1}
    spreads: dict[str, list[float]] = {}
    for case in (first[0], again[0]):
        for k, v in case.items():
            if isinstance(v, dict) and v.get("n", 0) >= 2 and v.get("median"):
                spreads.setdefault(k, []).append((v["max"] - v["min"]) / v["median"])
    return {"state": again[0]["state"], "figures": rows, "within_run_spread": {k: max(v) for k, v in spreads.items()}}


# ---------------------------------------------------------------------- markdown
def _size(n: float) -> str:
    return f"{n / (1 << 30):g} GiB" if n >= 1 << 30 else f"{n / MiB:g} MiB"


def _count(n: int) -> str:
    return f"{n // 1000}k" if n % 1000 == 0 else str(n)


def _s(x: float | None, digits: int = 3) -> str:
    return "-" if x is None else f"{x:.{digits}f}"


def _x(x: float | None) -> str:
    return "-" if x is None else f"{x:.2f}×"


def _prep(f: dict[str, Any]) -> str:
    """The walk, plan and tree JSON per tensor, wall (caller CPU), or "-" when not measured."""
    if f.get("save_prepare_us") is None:
        return "-"
    return f"{f['save_prepare_us']:.2f} ({f['save_prepare_cpu_us']:.2f})"


def _mib(n: float | None) -> str:
    return "-" if n is None else f"{n / MiB:.1f}"


def markdown(data: dict[str, Any]) -> str:
    meta, cfg = data.get("meta", {}), data.get("config", {})
    figs = data.get("figures") or evaluate(data)[0]
    lines = [
        "# Growth run: costs against state size and tensor count (issue 32)",
        "",
        f"{meta.get('date', '?')}, {meta.get('cpu', '?')}, {meta.get('cpus', '?')} CPUs, "
        f"{(meta.get('mem_bytes') or 0) / (1 << 30):.0f} GiB RAM, scratch {meta.get('scratch_fs', '?')}; "
        f"torch {meta.get('torch', '?')}, "
        f"asyncckpt {meta.get('asyncckpt_checkout') or meta.get('asyncckpt_commit', '?')}; "
        "load average at the start "
        f"{meta.get('loadavg', '?').split(' ')[:3]}, at the end {str(meta.get('loadavg_end', '?')).split(' ')[:3]}; "
        f"wall {meta.get('wall_s', 0) / 60:.0f} min.",
        "",
        f"Each (case, state) in its own process; medians of {cfg.get('repeats', '?')} after a warm-up; every limit "
        "measured in the same run (memcpy: `copy_` of every tensor into preallocated ones, the faster of 1 and "
        "the default thread count; raw write: O_DIRECT `os.write` loop of 16 MiB calls + fsync of file and "
        f"directory, from a {cfg.get('image', '?')} file image written over and over; raw read: `preadv` after "
        "`posix_fadvise(DONTNEED)` (cold) or right after a read (warm)). asyncckpt: `Checkpointer(root)` with "
        "its defaults; durable = `handle.result()` returning; loads are `load(root, step, into=state)` after "
        "every tensor was changed, checked bit-exact.",
        "",
    ]
    targets = data.get("targets") or []
    if targets:
        lines += [
            "## Targets",
            "",
            f"Verdicts on the medians; in parentheses and in the last column, the same from the fastest of the "
            f"{cfg.get('repeats', '?')} repeats of each figure and of its limit (on a shared machine, the closest to "
            "an unloaded one).",
            "",
            "| target | measured: median (best) | verdict | on the best repeats |",
            "|---|---|---|---|",
        ]
        for t in targets:
            v = "met" if t["met"] else "missed"
            vb = "met" if t.get("met_best") else "missed"
            lines.append(f"| {t['target']} | {t['measured']} | **{v}** | {vb} |")
        lines.append("")
    if figs["sizes"]:
        lines += [
            "## Sizes (transformer-shaped state)",
            "",
            "| size | tensors | blocking s (× memcpy) | memcpy s | durable s (× raw) | raw O_DIRECT s "
            "| write phase s (× raw) "
            "| cold load s (× raw) | raw cold read s | warm load s (× raw) | raw warm read s | save peak extra MiB "
            "(above staging) | load peak extra MiB | bit-exact |",
            "|---|---|---|---|---|---|---|---|---|---|---|---|---|---|",
        ]
        for f in figs["sizes"]:
            if not f["ok"]:
                lines.append(f"| {_size(f['size'])} | {f['n_tensors']} | {f['why']} |" + " |" * 10)
                continue
            lines.append(
                f"| {_size(f['size'])} | {f['n_tensors']} | {_s(f['blocking'])} ({_x(f['blocking_x'])}) | "
                f"{_s(f['memcpy'])} | {_s(f['durable'])} ({_x(f['durable_x'])}) | {_s(f['raw_direct'])} | "
                f"{_s(f['write_phase'])} ({_x(f['write_phase_x'])}) | "
                f"{_s(f['load_cold'])} ({_x(f['load_cold_x'])}) | {_s(f['read_cold'])} | "
                f"{_s(f['load_warm'])} ({_x(f['load_warm_x'])}) | {_s(f['read_warm'])} | {_mib(f['save_rss'])} "
                f"({_mib(f['save_above_staging'])}) | {_mib(f['load_rss'])} | {'yes' if f['bit_exact'] else 'NO'} |"
            )
        lines.append("")
    if figs["counts"]:
        lines += [
            "## Tensor counts (the same bytes in more tensors)",
            "",
            "| tensors | size | blocking s (× memcpy) | memcpy s | save fixed µs/tensor "
            "| save walk+plan+JSON µs/tensor: wall (CPU) | durable s (× raw) "
            "| cold load s (× raw) | raw cold read s | load µs/tensor (above raw) "
            "| marginal µs/extra tensor: load, save "
            "| save B/tensor above staging | load B/tensor | GC in `save()`: passes, s (longest) "
            "| GC in cold load: passes, s (longest) | bit-exact |",
            "|---|---|---|---|---|---|---|---|---|---|---|---|---|---|---|---|",
        ]
        for f in figs["counts"]:
            if not f["ok"]:
                lines.append(f"| {f['n_tensors']:,} | {_size(f['size'])} | {f['why']} |" + " |" * 13)
                continue
            marg = f"{f['load_marginal_us']:.1f}, {f['save_marginal_us']:.1f}" if "load_marginal_us" in f else "-"
            lines.append(
                f"| {f['n_tensors']:,} | {_size(f['size'])} | {_s(f['blocking'])} ({_x(f['blocking_x'])}) | "
                f"{_s(f['memcpy'])} | {f['save_fixed_us']:.1f} | {_prep(f)} | "
                f"{_s(f['durable'])} ({_x(f['durable_x'])}) | "
                f"{_s(f['load_cold'])} ({_x(f['load_cold_x'])}) | {_s(f['read_cold'])} | {f['load_us']:.1f} "
                f"({f['load_above_us']:.1f}) | {marg} | {f['save_bytes_per_tensor']:,.0f} | "
                f"{f['load_bytes_per_tensor']:,.0f} | {f['gc_save_passes']:.0f}, {f['gc_save_s']:.3f} "
                f"({f['gc_save_max_s']:.3f}) | {f['gc_load_passes']:.0f}, {f['gc_load_s']:.3f} "
                f"({f['gc_load_max_s']:.3f}) | {'yes' if f['bit_exact'] else 'NO'} |"
            )
        lines.append("")
    nz = figs.get("noise")
    if nz:
        lines += [
            f"## Noise: {nz['state']} run again at the end",
            "",
            "| figure | first | again | change |",
            "|---|---|---|---|",
        ]
        for k, v in nz["figures"].items():
            fmt = _x if k.endswith("_x") else _s
            lines.append(f"| {k} | {fmt(v['first'])} | {fmt(v['again'])} | {v['change'] * 100:+.0f}% |")
        spread = nz["within_run_spread"]
        if spread:
            worst = sorted(spread.items(), key=lambda kv: -kv[1])[:6]
            lines += [
                "",
                "Largest (max - min) / median within one case's repeats: "
                + ", ".join(f"{k} {v * 100:.0f}%" for k, v in worst)
                + ".",
            ]
        lines.append("")
    soak = data.get("soak")
    if soak and soak.get("status") == "ok":
        lines += [
            f"## Soak: {soak.get('saves')} saves per variant (`s3_soak.py`, {soak.get('date')})",
            "",
            f"From `{soak.get('from')}`.",
            "",
            "| variant | time/save first → last 100, ms | requests/save first → last | noise |",
            "|---|---|---|---|",
        ]
        for name, v in soak["variants"].items():
            s = v["summary"]
            per = s.get("period_s", {})
            req = s.get("requests")
            lines.append(
                f"| {name} | {per.get('first', 0) * 1e3:.0f} → {per.get('last', 0) * 1e3:.0f} | "
                + (f"{req['first']:.1f} → {req['last']:.1f}" if req else "-")
                + f" | {per.get('noise', 0) * 100:.0f}% |"
            )
        lines.append("")
    elif soak:
        lines += [f"Soak: {soak.get('status')}: {soak.get('reason')}", ""]
    skipped = [r for r in [*data.get("results", []), *(data.get("noise") or [])] if r.get("status") != "ok"]
    if skipped:
        lines += ["## Not measured", ""]
        lines += [f"- {r['state']}: {r['status']}: {r.get('reason', '')}" for r in skipped]
        lines.append("")
    return "\n".join(lines)


# ---------------------------------------------------------------------- plot
def plot(data: dict[str, Any], path: str) -> str | None:
    """One panel per figure against its limit and the issue's target; returns why not, or None."""
    try:
        import matplotlib

        matplotlib.use("Agg")
        import matplotlib.pyplot as plt
    except ImportError:
        return "matplotlib is not installed (pip install -e '.[bench]'): no growth.png"
    figs = data.get("figures") or evaluate(data)[0]
    sizes = [f for f in figs["sizes"] if f["ok"]]
    counts = sorted((f for f in figs["counts"] if f["ok"]), key=lambda f: f["n_tensors"])
    soak = data.get("soak") if (data.get("soak") or {}).get("status") == "ok" else None
    panels: list[Any] = []
    if sizes:
        panels += [_p_blocking, _p_durable, _p_load, _p_memory]
    if counts:
        panels += [_p_fixed, _p_count_durable, _p_load_tensor, _p_tensor_memory, _p_gc]
    if soak:
        panels += [_p_soak_time, _p_soak_requests]
    if not panels:
        return "nothing measured: no growth.png"
    cols = 3
    rows = -(-len(panels) // cols)
    fig, axes = plt.subplots(rows, cols, figsize=(6 * cols, 4.3 * rows), squeeze=False)
    for ax, draw in zip(axes.flat, panels, strict=False):
        draw(ax, sizes, counts, soak)
        ax.grid(True, which="both", alpha=0.3)
        ax.legend(fontsize=7)
    for ax in list(axes.flat)[len(panels) :]:
        ax.axis("off")
    meta = data.get("meta", {})
    fig.suptitle(
        f"asyncckpt growth run ({meta.get('date', '')}, {meta.get('cpus', '?')} CPUs, "
        f"asyncckpt {meta.get('asyncckpt_commit', '?')}): each figure against its limit (dashed) and "
        f"issue 32's target (dotted)",
        fontsize=10,
    )
    fig.tight_layout(rect=(0, 0, 1, 0.97))
    fig.savefig(path, dpi=100)
    plt.close(fig)
    return None


def _gib(fs: list[dict[str, Any]]) -> list[float]:
    return [f["size"] / (1 << 30) for f in fs]


def _null_locator() -> Any:
    from matplotlib.ticker import NullLocator

    return NullLocator()


def _size_axes(ax: Any, title: str, ylabel: str, xs: list[float]) -> None:
    ax.set_xscale("log", base=2)
    ax.set_yscale("log")
    ax.set_xticks(xs, [_size(x * (1 << 30)) for x in xs])
    ax.xaxis.set_minor_locator(_null_locator())
    ax.set_xlabel("state size")
    ax.set_ylabel(ylabel)
    ax.set_title(title, fontsize=9)


def _count_axes(ax: Any, title: str, ylabel: str, xs: list[int], logy: bool = True) -> None:
    ax.set_xscale("log")
    if logy:
        ax.set_yscale("log")
    ax.set_xticks(xs, [_count(int(x)) for x in xs])
    ax.xaxis.set_minor_locator(_null_locator())
    ax.set_xlabel("tensors (the same bytes in all)")
    ax.set_ylabel(ylabel)
    ax.set_title(title, fontsize=9)


def _p_blocking(ax: Any, sizes: list[dict[str, Any]], *_: Any) -> None:
    x = _gib(sizes)
    ax.plot(x, [f["blocking"] for f in sizes], "o-", label="save() blocking")
    ax.plot(x, [f["memcpy"] for f in sizes], "kx--", label="limit: memcpy")
    _size_axes(ax, "save() blocking against the memcpy of the same bytes", "seconds", x)


def _p_durable(ax: Any, sizes: list[dict[str, Any]], *_: Any) -> None:
    x = _gib(sizes)
    ax.plot(x, [f["durable"] for f in sizes], "o-", label="durable")
    ax.plot(x, [f["raw_direct"] for f in sizes], "kx--", label="limit: raw O_DIRECT write + fsync")
    ax.plot(x, [1.2 * f["raw_direct"] for f in sizes], "r:", label="target: 1.2× raw")
    _size_axes(ax, "time to durable against the raw O_DIRECT write", "seconds", x)


def _p_load(ax: Any, sizes: list[dict[str, Any]], *_: Any) -> None:
    x = _gib(sizes)
    ax.plot(x, [f["load_cold"] for f in sizes], "o-", color="C0", label="load(into=) cold")
    ax.plot(x, [f["read_cold"] for f in sizes], "x--", color="C0", label="limit: raw cold read")
    ax.plot(x, [f["load_warm"] for f in sizes], "s-", color="C1", label="load(into=) warm")
    ax.plot(x, [f["read_warm"] for f in sizes], "x--", color="C1", label="limit: raw warm read")
    _size_axes(ax, "load(into=) against the raw read", "seconds", x)


def _p_memory(ax: Any, sizes: list[dict[str, Any]], *_: Any) -> None:
    x = _gib(sizes)
    ax.plot(x, [f["save_rss"] / MiB for f in sizes], "o-", label="save: peak extra RSS")
    ax.plot(x, [f["staging_bytes"] / MiB for f in sizes], "kx--", label="limit: the staging buffer")
    ax.plot(x, [max(f["load_rss"], 1) / MiB for f in sizes], "s-", label="load(into=): peak extra RSS")
    _size_axes(ax, "peak extra memory", "MiB", x)


def _p_fixed(ax: Any, _s: Any, counts: list[dict[str, Any]], *_: Any) -> None:
    x = [f["n_tensors"] for f in counts]
    ax.plot(x, [f["save_fixed_us"] for f in counts], "o-", label="save() fixed work (blocking - memcpy) / tensors")
    ax.plot(x, [f["gc_save_s"] / f["n_tensors"] * 1e6 for f in counts], "^-", label="of it: GC passes / tensors")
    if all(f.get("save_prepare_us") is not None for f in counts):
        ax.plot(x, [f["save_prepare_us"] for f in counts], "s-", label="walk + plan + tree JSON, timed in save()")
    ax.axhline(5, color="r", ls=":", label="target: 5 µs")
    _count_axes(ax, "save(): fixed work per tensor (limit 0: the memcpy is taken out)", "µs per tensor", x, logy=False)
    ax.set_ylim(bottom=0)


def _p_count_durable(ax: Any, _s: Any, counts: list[dict[str, Any]], *_: Any) -> None:
    x = [f["n_tensors"] for f in counts]
    ax.plot(x, [f["blocking"] for f in counts], "o-", color="C0", label="save() blocking")
    ax.plot(x, [f["memcpy"] for f in counts], "x--", color="C0", label="limit: memcpy (per-tensor copy_)")
    ax.plot(x, [f["durable"] for f in counts], "s-", color="C1", label="durable")
    ax.plot(x, [f["raw_direct"] for f in counts], "x--", color="C1", label="limit: raw O_DIRECT write")
    ax.plot(x, [1.2 * f["raw_direct"] for f in counts], ":", color="r", label="1.2× raw")
    _count_axes(ax, "save: blocking and durable against their limits", "seconds", x)


def _p_load_tensor(ax: Any, _s: Any, counts: list[dict[str, Any]], *_: Any) -> None:
    x = [f["n_tensors"] for f in counts]
    ax.plot(x, [f["load_above_us"] for f in counts], "o-", label="cold load(into=) - raw cold read, per tensor")
    marg = [f for f in counts if "load_marginal_us" in f]
    ax.plot(
        [f["n_tensors"] for f in marg],
        [f["load_marginal_us"] for f in marg],
        "s-",
        label="marginal: per extra tensor since the previous count",
    )
    ax.plot(x, [f["gc_load_s"] / f["n_tensors"] * 1e6 for f in counts], "^-", label="of it: GC passes / tensors")
    ax.axhline(20, color="r", ls=":", label="target: 20 µs")
    _count_axes(ax, "load(into=): time per tensor above the raw read (limit 0)", "µs per tensor", x, logy=False)
    ax.set_ylim(bottom=0)


def _p_tensor_memory(ax: Any, _s: Any, counts: list[dict[str, Any]], *_: Any) -> None:
    x = [f["n_tensors"] for f in counts]
    ax.plot(x, [f["save_bytes_per_tensor"] for f in counts], "o-", label="save: peak extra above the staging buffer")
    ax.plot(x, [f["load_bytes_per_tensor"] for f in counts], "s-", label="load(into=): peak extra")
    ax.axhline(KiB, color="r", ls=":", label="target: 1 KiB")
    _count_axes(ax, "peak extra memory per tensor (limit 0)", "bytes per tensor", x, logy=False)
    ax.set_ylim(bottom=0)


def _p_gc(ax: Any, _s: Any, counts: list[dict[str, Any]], *_: Any) -> None:
    x = [f["n_tensors"] for f in counts]
    ax.plot(x, [f["gc_save_s"] * 1e3 for f in counts], "o-", label="in save(): GC time")
    ax.plot(x, [f["gc_save_passes"] for f in counts], "o:", color="C0", label="in save(): passes")
    ax.plot(x, [f["gc_load_s"] * 1e3 for f in counts], "s-", color="C1", label="in cold load: GC time")
    ax.plot(x, [f["gc_load_passes"] for f in counts], "s:", color="C1", label="in cold load: passes")
    _count_axes(ax, "cyclic GC on the caller's path (target 0 in save())", "ms, or passes", x, logy=False)
    ax.set_ylim(bottom=0)


def _running(xs: list[float], k: int = 25) -> list[float]:
    return [statistics.median(xs[max(0, i - k + 1) : i + 1]) for i in range(len(xs))]


def _p_soak_time(ax: Any, _s: Any, _c: Any, soak: dict[str, Any]) -> None:
    for i, (name, v) in enumerate(soak["variants"].items()):
        if v["period_s"]:
            ax.plot(v["save"], [y * 1e3 for y in _running(v["period_s"])], lw=1, color=f"C{i}", label=name)
    ax.set_yscale("log")
    ax.set_xlabel("save number")
    ax.set_ylabel("ms per save (running median of 25)")
    ax.set_title("soak: time per save against the run's length (limit: control)", fontsize=9)


def _p_soak_requests(ax: Any, _s: Any, _c: Any, soak: dict[str, Any]) -> None:
    for i, (name, v) in enumerate(soak["variants"].items()):
        if v["requests"]:
            ax.plot(v["save"], _running(v["requests"]), lw=1, color=f"C{i}", label=name)
    ax.set_yscale("log")
    ax.set_xlabel("save number")
    ax.set_ylabel("requests per save (running median of 25)")
    ax.set_title("soak: store requests per save (target: constant)", fontsize=9)
