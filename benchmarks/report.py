"""Turn the results JSON into a markdown report, the target verdicts and a PNG plot."""

from __future__ import annotations

from typing import Any

from states import format_size

# (key, description, threshold, direction): a ratio must be <= threshold ("max") or >= it ("min")
TARGETS = [
    ("blocking", "blocking <= 1.15x memcpy into preallocated buffers", 1.15, "max"),
    ("durable", "durable <= 1.1x raw O_DIRECT write+fsync", 1.1, "max"),
    ("lost", "training time lost (1 thread) <= 0.5x best dcp.async_save", 0.5, "max"),
    ("lost2", "training time lost (2 threads) <= 0.5x best dcp.async_save", 0.5, "max"),
    ("cpu", "writer CPU <= 0.1 s per GiB (O_DIRECT)", 1.0, "max"),
    ("blocking_10k", "10k-tensor blocking <= 1.5x memcpy", 1.5, "max"),
    ("durable_10k", "10k-tensor durable <= 1.2x raw write+fsync", 1.2, "max"),
    ("restore_raw", "restore (cold) >= 0.8x raw cold read throughput", 0.8, "min"),
    ("restore_torch", "restore (cold) >= 1.5x torch.load throughput", 1.5, "min"),
    ("rss", "peak extra RSS per pending save <= 1.05x state size", 1.05, "max"),
    # from benchmarks/restore.py (run.py --restore), its own side-by-side run
    ("restore_cold_raw", "restore.py: cold verified load(into=) >= 0.9x raw cold read", 0.9, "min"),
    ("restore_cold_torch", "restore.py: cold verified load(into=) >= 2x torch.load + copy", 2.0, "min"),
    ("restore_warm_raw", "restore.py: warm verified load(into=) >= 0.8x raw warm read", 0.8, "min"),
    ("restore_rss", "restore.py: peak extra RSS of load(into=) <= 64 MiB", 1.0, "max"),
]


def _med(d: Any) -> float | None:
    if isinstance(d, dict) and d.get("median") is not None:
        return float(d["median"])
    return None


def _ratio(a: float | None, b: float | None) -> float | None:
    if a is None or b is None or b <= 0:
        return None
    return a / b


def _fmt_s(v: float | None) -> str:
    if v is None:
        return "-"
    if v >= 100:
        return f"{v:.0f}"
    if v >= 10:
        return f"{v:.1f}"
    if v >= 1:
        return f"{v:.2f}"
    if v >= 0.01:
        return f"{v:.3f}"
    return f"{v * 1e3:.2f}ms"


def _cell(d: Any, limit: float | None = None, unit: str = "s") -> str:
    """``median [min-max] (ratio x)`` of a summary dict."""
    m = _med(d)
    if m is None:
        return "-"
    if unit == "s":
        body = f"{_fmt_s(m)} [{_fmt_s(d['min'])}–{_fmt_s(d['max'])}]"
    else:
        body = f"{m:.2f} [{d['min']:.2f}–{d['max']:.2f}]"
    r = _ratio(m, limit)
    return body if r is None else f"{body} ({r:.2f}×)"


def limits_for(data: dict[str, Any], state: str) -> dict[str, Any]:
    for r in data["results"]:
        if r["method"] == "limits" and r["state"] == state and r.get("status") == "ok":
            return r
    return {}


def direct_write_limit(lim: dict[str, Any]) -> tuple[float | None, str]:
    """The raw O_DIRECT write+fsync (issue 11's durable limit): the faster of the writes from
    a 4 KiB-page and a huge-page buffer; the faster raw write where O_DIRECT was not measured."""
    cands = [(v, k) for k in ("write_direct", "write_direct_huge") if (v := _med(lim.get(k))) is not None]
    if not cands:
        return write_limit(lim)
    v, k = min(cands)
    return v, _WRITE_NAMES[k]


_WRITE_NAMES = {
    "write": "raw write+fsync",
    "write_direct": "raw O_DIRECT write+fsync",
    "write_direct_huge": "raw O_DIRECT write+fsync (huge pages)",
}


def write_limit(lim: dict[str, Any]) -> tuple[float | None, str]:
    """The physical write+fsync limit: the fastest of the buffered and O_DIRECT raw writes
    (O_DIRECT from a 4 KiB-page and from a huge-page buffer)."""
    cands = [(v, k) for k in _WRITE_NAMES if (v := _med(lim.get(k))) is not None]
    if not cands:
        return None, "-"
    v, k = min(cands)
    return v, _WRITE_NAMES[k]


def _states(data: dict[str, Any]) -> list[str]:
    seen: list[str] = []
    for r in data["results"]:
        if r["state"] not in seen:
            seen.append(r["state"])
    return seen


def _rows(data: dict[str, Any], state: str) -> list[dict[str, Any]]:
    return [r for r in data["results"] if r["state"] == state and r["method"] != "limits"]


def _find(data: dict[str, Any], state: str, method: str) -> dict[str, Any] | None:
    for r in data["results"]:
        if r["state"] == state and r["method"] == method and r.get("status") == "ok":
            return r
    return None


def _lost(r: dict[str, Any], threads: str) -> float | None:
    return _med(r.get("interference", {}).get(threads, {}).get("lost_s"))


def pick_target_states(data: dict[str, Any]) -> tuple[str | None, str | None]:
    """The transformer state the targets are judged on (1 GiB if present) and the 10k-tensor one."""
    states = [(r["spec"], r["state"]) for r in data["results"] if r["method"] == "limits"]
    tf = [(s["nbytes"], n) for s, n in states if s["kind"] == "transformer" and s.get("device", "cpu") == "cpu"]
    sm = [(s["nbytes"], n) for s, n in states if s["kind"] == "small" and s.get("device", "cpu") == "cpu"]
    gib = 1 << 30
    main = next((n for b, n in tf if b == gib), max(tf)[1] if tf else None)
    small = next((n for b, n in sm if b == gib), max(sm)[1] if sm else None)
    return main, small


def evaluate_targets(data: dict[str, Any]) -> list[dict[str, Any]]:
    """Every target with its verdict; ``None`` verdicts where a figure was not measured."""
    main, small = pick_target_states(data)
    out: list[dict[str, Any]] = []

    def add(
        key: str, state: str | None, value: float | None, limit: float | None, against: str, note: str = ""
    ) -> None:
        desc, thr, direction = next((d, t, dr) for k, d, t, dr in TARGETS if k == key)
        ratio = _ratio(value, limit) if direction == "max" else _ratio(limit, value)
        met = None if ratio is None else (ratio <= thr if direction == "max" else ratio >= thr)
        out.append(
            {
                "key": key,
                "target": desc,
                "state": state,
                "value": value,
                "against": against,
                "against_value": limit,
                "ratio": ratio,
                "threshold": thr,
                "direction": direction,
                "met": met,
                "note": note,
            }
        )

    if main is not None:
        lim = limits_for(data, main)
        a = _find(data, main, "asyncckpt") or {}
        add("blocking", main, _med(a.get("blocking")), _med(lim.get("memcpy")), "memcpy")
        wl, wname = direct_write_limit(lim)
        add("durable", main, _med(a.get("durable")), wl, wname)
        for key, threads in (("lost", "1"), ("lost2", "2")):
            dcp_lost = [
                (_lost(r, threads), r["method"])
                for r in data["results"]
                if r["state"] == main and r["method"].startswith("dcp.async_save") and r.get("status") == "ok"
            ]
            dcp_lost = [(v, n) for v, n in dcp_lost if v is not None]
            best = min(dcp_lost) if dcp_lost else (None, "-")
            add(key, main, _lost(a, threads), best[0], f"{best[1]} (best DCP async at {threads} thread(s))")
        ls = a.get("library_stats") or {}
        cpu = _med(ls.get("writer_cpu_s_per_gib"))
        add("cpu", main, cpu, 0.1, "budget", note="O_DIRECT" if ls.get("direct_io") else "buffered")
        restore = a.get("restore", {}).get("asyncckpt.load", {})
        add("restore_raw", main, _med(restore.get("cold")), _med(lim.get("read_cold")), "raw cold read")
        t = _find(data, main, "torch.save") or {}
        tl = t.get("restore", {}).get("torch.load", {})
        add("restore_torch", main, _med(restore.get("cold")), _med(tl.get("cold")), "torch.load (cold)")
        nbytes = (a.get("state_info") or {}).get("nbytes")
        add("rss", main, (a.get("memory") or {}).get("extra_bytes"), nbytes, "state size")
    if small is not None:
        lim = limits_for(data, small)
        a = _find(data, small, "asyncckpt") or {}
        add("blocking_10k", small, _med(a.get("blocking")), _med(lim.get("memcpy")), "memcpy")
        wl, wname = write_limit(lim)
        add("durable_10k", small, _med(a.get("durable")), wl, wname)
    r = data.get("restore")
    if r and r.get("times"):
        t = r["times"]

        def med(name: str, mode: str) -> float | None:
            return _med(t.get(name, {}).get(mode))

        state = r.get("state", {}).get("name")
        for key, mode in (("restore_cold_raw", "cold"), ("restore_warm_raw", "warm")):
            raws = [v for v in (med("raw read", mode), med("raw read x4", mode)) if v is not None]
            add(key, state, med("asyncckpt.load(into=)", mode), min(raws) if raws else None, f"raw {mode} read")
        add(
            "restore_cold_torch",
            state,
            med("asyncckpt.load(into=)", "cold"),
            med("torch.load + copy", "cold"),
            "torch.load + copy (cold)",
        )
        rss = (r.get("peak_extra_rss") or {}).get("asyncckpt.load(into=)", {}).get("extra_bytes")
        add("restore_rss", state, rss, 64.0 * 2**20, "budget")
    return out


def _verdict(t: dict[str, Any]) -> str:
    if t["met"] is None:
        return "n/a"
    return "**met**" if t["met"] else "**missed**"


def _fmt_val(v: float | None, key: str) -> str:
    if v is None:
        return "-"
    if key in ("rss", "restore_rss"):
        return format_size(v)
    if key == "cpu":
        return f"{v:.3f} s/GiB"
    return _fmt_s(v)


def markdown(data: dict[str, Any]) -> str:
    meta = data.get("meta", {})
    lines: list[str] = ["# asyncckpt benchmark", ""]
    lines.append(
        f"{meta.get('date', '')} · {meta.get('cpu', '?')} ({meta.get('cpus', '?')} CPUs) · "
        f"{format_size(meta.get('mem_bytes', 0))} RAM · torch {meta.get('torch', '?')} · "
        f"scratch on {meta.get('scratch_fs', '?')} · asyncckpt {meta.get('asyncckpt_commit', '?')}"
    )
    cfg = data.get("config", {})
    lines.append(
        f"Figures: median [min–max] of {cfg.get('repeats')} repeats after a warm-up "
        f"(interference: {cfg.get('interference_repeats')} repeats); (n×) = ratio to the limit named "
        "in the column header, measured in the same run."
    )
    if cfg.get("quick"):
        lines += ["", "> **Quick smoke run**: tiny states and few repeats; the figures are not meaningful."]
    lines.append("")

    targets = data.get("targets") or evaluate_targets(data)
    if targets:
        lines += [
            "## Targets",
            "",
            "| target | state | asyncckpt | against | ratio | verdict |",
            "|---|---|---|---|---|---|",
        ]
        for t in targets:
            ratio = (
                "-"
                if t["ratio"] is None
                else f"{t['ratio']:.2f}× (need {'≤' if t['direction'] == 'max' else '≥'} {t['threshold']})"
            )
            lines.append(
                f"| {t['target']} | {t['state']} | {_fmt_val(t['value'], t['key'])} | {t['against']}: "
                f"{_fmt_val(t['against_value'], t['key'])} | {ratio} | {_verdict(t)} |"
            )
        lines += [
            "",
            "Throughput targets (restore) compare times inverted: ratio = reference time / asyncckpt time.",
            "",
        ]

    bad = [
        f"{r['method']} on {r['state']}"
        for r in data["results"]
        if r.get("consistency") and not r["consistency"].get("ok")
    ]
    lines.append(
        "**Consistency** (mutate right after save() returns, load must equal the call-time values): "
        + ("all methods that ran passed." if not bad else "FAILED: " + ", ".join(bad))
    )
    lines.append("")

    for state in _states(data):
        lim = limits_for(data, state)
        info = lim.get("state_info") or next((r.get("state_info") for r in _rows(data, state)), {}) or {}
        nbytes = info.get("nbytes")
        memcpy = _med(lim.get("memcpy"))
        wl, wname = write_limit(lim)
        lines += [f"## {state}", ""]
        if info:
            lines.append(
                f"{format_size(info['nbytes'])} in {info['n_tensors']} tensors "
                f"(largest {format_size(info['largest_tensor_bytes'])}, "
                f"median {format_size(info['median_tensor_bytes'])})."
            )
            lines.append("")
        if lim:
            mc = lim.get("memcpy") or {}
            by = lim.get("memcpy_by_threads") or {}
            others = ", ".join(f"{k} thread(s) {_fmt_s(_med(v))}" for k, v in by.items())
            lines.append(
                f"Limits: memcpy (best of {others}) "
                + _cell(mc)
                + " · raw write+fsync "
                + _cell(lim.get("write"))
                + " · raw O_DIRECT write+fsync "
                + (_cell(lim.get("write_direct")) if "error" not in (lim.get("write_direct") or {}) else "unsupported")
                + (" · from huge pages " + _cell(lim["write_direct_huge"])
                   if "error" not in (lim.get("write_direct_huge") or {"error": 1}) else "")
                + " · cold read "
                + _cell(lim.get("read_cold"))
                + " · warm read "
                + _cell(lim.get("read_warm"))
            )
            lines.append("")
        lines += [
            f"| method | blocking s (× memcpy) | durable s (× {wname}) | CPU s/save | peak extra RSS (× state) | "
            "lost @1T s (× memcpy) | slowdown @1T | lost @2T s (× memcpy) | slowdown @2T | consistent |",
            "|---|---|---|---|---|---|---|---|---|---|",
        ]
        for r in _rows(data, state):
            if r.get("status") != "ok":
                lines.append(
                    f"| {r['method']} | {r.get('status')}: {_md_escape(r.get('reason', ''))} | | | | | | | | |"
                )
                continue
            rss = (r.get("memory") or {}).get("extra_bytes")
            rss_cell = "-" if rss is None else f"{format_size(rss)}" + (f" ({rss / nbytes:.2f}×)" if nbytes else "")
            inter = r.get("interference", {})
            c = r.get("consistency") or {}
            cons = "yes" if c.get("ok") else f"**NO** ({c.get('mismatched_tensors')}/{c.get('n_tensors')} differ)"
            if "mutating_before_staging_completion_mismatched_tensors" in c:
                torn = c["mutating_before_staging_completion_mismatched_tensors"]
                cons += f"; {torn} tensors torn if mutated before staging_completion"
            i1, i2 = inter.get("1", {}), inter.get("2", {})
            cells = [
                r["method"],
                _cell(r.get("blocking"), memcpy),
                _cell(r.get("durable"), wl),
                _fmt_s(_med(r.get("cpu_s"))),
                rss_cell,
                _cell(i1.get("lost_s"), memcpy),
                _cell(i1.get("slowdown"), unit="x"),
                _cell(i2.get("lost_s"), memcpy),
                _cell(i2.get("slowdown"), unit="x"),
                cons,
            ]
            lines.append("| " + " | ".join(cells) + " |")
        restores = [
            (r["method"], v, d)
            for r in _rows(data, state)
            if r.get("status") == "ok"
            for v, d in (r.get("restore") or {}).items()
        ]
        if restores:
            lines += [
                "",
                "| restore into preallocated tensors | cold s (× raw cold read) | warm s (× raw warm read) "
                "| GB/s cold | verified |",
                "|---|---|---|---|---|",
            ]
            for _, variant, d in restores:
                cold = _med(d.get("cold"))
                gbs = f"{nbytes / cold / 1e9:.2f}" if cold and nbytes else "-"
                verified = "yes" if d.get("verified") else "**NO**"
                lines.append(
                    f"| {variant} | {_cell(d.get('cold'), _med(lim.get('read_cold')))} | "
                    f"{_cell(d.get('warm'), _med(lim.get('read_warm')))} | {gbs} | {verified} |"
                )
        notes = [f"{r['method']}: {n}" for r in _rows(data, state) for n in r.get("notes", [])]
        a = _find(data, state, "asyncckpt")
        if a and a.get("library_stats"):
            ls = a["library_stats"]
            parts = [f"{k} {_fmt_s(_med(v))}" for k, v in ls.items() if isinstance(v, dict)]
            notes.append(
                "asyncckpt's own statistics (median): " + ", ".join(parts) + f", direct_io={ls.get('direct_io')}"
            )
        if a and a.get("first_save"):
            fs = a["first_save"]
            notes.append(
                f"asyncckpt first save (allocates the staging arena): blocking {_fmt_s(fs['blocking_s'])}, "
                f"durable {_fmt_s(fs['durable_s'])}"
            )
        if notes:
            lines += [""] + [f"- {n}" for n in dict.fromkeys(notes)]
        lines.append("")
    lines += [
        "Columns: *blocking* = until save() returns (for stager-bg: until staging_completion); *durable* = until "
        "committed with file data and directory entries fsynced (an fsync is added for methods that do not do it); "
        "*CPU s/save* = CPU time of the process (all threads) from the call until durable; "
        "*peak extra RSS* = peak over the RSS before the first save (this process's VmHWM + children's PSS), "
        "persistent staging buffers included; *lost* = blocking + extra step time of a 1- or 2-thread matmul loop "
        "while the save is in flight; *slowdown* = mean step time in flight / step time before the save.",
        "",
    ]
    return "\n".join(lines)


def _md_escape(s: str) -> str:
    return s.replace("|", "\\|").replace("\n", " ")[:300]


def plot(data: dict[str, Any], path: str) -> str | None:
    """Write the PNG; returns None, or a message when matplotlib is missing."""
    try:
        import matplotlib

        matplotlib.use("Agg")
        import matplotlib.pyplot as plt
    except ImportError:
        return "matplotlib is not installed: skipped the PNG (pip install matplotlib)"
    states = _states(data)
    if not states:
        return "no results to plot"
    fig, axes = plt.subplots(len(states), 1, figsize=(11, max(3.0, 4.2 * len(states))), squeeze=False)
    for ax, state in zip(axes[:, 0], states, strict=True):
        rows = [r for r in _rows(data, state) if r.get("status") == "ok"]
        names = [r["method"] for r in rows]
        ys = list(range(len(rows)))
        for off, key, color in ((-0.2, "blocking", "tab:blue"), (0.2, "durable", "tab:orange")):
            med = [_med(r.get(key)) or 0 for r in rows]
            lo = [m - (r[key]["min"] or 0) for m, r in zip(med, rows, strict=True)]
            hi = [(r[key]["max"] or 0) - m for m, r in zip(med, rows, strict=True)]
            ax.barh([y + off for y in ys], med, height=0.38, color=color, label=key, xerr=[lo, hi], capsize=2)
        lim = limits_for(data, state)
        if _med(lim.get("memcpy")):
            ax.axvline(_med(lim["memcpy"]), color="tab:blue", ls="--", lw=1, label="memcpy")
        wl, wname = write_limit(lim)
        if wl:
            ax.axvline(wl, color="tab:orange", ls="--", lw=1, label=wname)
        ax.set_yticks(ys, names, fontsize=8)
        ax.invert_yaxis()
        ax.set_xscale("log")
        ax.set_xlabel("seconds (median, min–max)")
        ax.set_title(state)
        ax.legend(fontsize=7, loc="lower right")
    fig.tight_layout()
    fig.savefig(path, dpi=110)
    plt.close(fig)
    return None
