"""Benchmark asyncckpt against torch.save and PyTorch DCP on this machine.

    python benchmarks/run.py --quick                      # smoke run, < 1 minute
    python benchmarks/run.py --sizes 256M,1G --repeats 5  # plus the 10k-tensor 1G case
    python benchmarks/run.py --help

Writes ``results.json``, ``results.md`` and ``results.png`` (if matplotlib is installed)
into ``--out``. Each (method, state) case runs in its own subprocess so peak-memory figures
and leftover threads/processes of one method cannot leak into the next (``--quick`` runs
everything in this process). See benchmarks/README.md for what every figure means.
"""

from __future__ import annotations

import argparse
import json
import os
import platform
import shutil
import subprocess
import sys
import tempfile
import time
import warnings
from typing import Any

HERE = os.path.dirname(os.path.abspath(__file__))
REPO = os.path.dirname(HERE)
if HERE not in sys.path:
    sys.path.insert(0, HERE)
if REPO not in sys.path:
    sys.path.insert(1, REPO)  # use the checkout's asyncckpt even when it is not installed

from cases import Config, log, run_case  # noqa: E402
from measure import raise_fd_limit  # noqa: E402
from methods import all_methods, method_names  # noqa: E402
from report import evaluate_targets, markdown, plot  # noqa: E402
from states import StateSpec, format_size, parse_size  # noqa: E402

GiB = 1 << 30
#: Left out of --quick (unless named in --methods) to keep the smoke run under a minute: DCP has a large
#: fixed cost per save, and starting its checkpoint daemon alone takes ~10 s. The full run has them all.
QUICK_SKIP = {
    "dcp.save[t2]": "left out of --quick (same code path as dcp.save[t1])",
    "dcp.async_save[writer-t2]": "left out of --quick (same code path as dcp.async_save[default])",
    "dcp.async_save[stager-cached]": "left out of --quick (same code path as dcp.async_save[stager-bg])",
    "dcp.async_save[process-gloo]": "left out of --quick: its daemon process takes ~10 s to start",
}


def _quiet_warnings() -> None:
    # DCP warns on every single-process call; pinned-memory flags warn without CUDA
    warnings.filterwarnings("ignore", message=".*torch.distributed is disabled.*")
    warnings.filterwarnings("ignore", message=".*pin_memory.*")
    warnings.filterwarnings("ignore", message=".*pinning memory.*")
    warnings.filterwarnings("ignore", category=FutureWarning)


def parse_args(argv: list[str] | None = None) -> argparse.Namespace:
    p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--sizes", default="256M,1G,4G", help="transformer state sizes (default: 256M,1G,4G)")
    p.add_argument(
        "--small",
        default="1G:10000",
        help="SIZE:TENSORS for the many-small-tensors state (default 1G:10000; 'none' to skip)",
    )
    p.add_argument("--repeats", type=int, default=5, help="repeats per figure after a warm-up (default 5, min 5)")
    p.add_argument("--interference-repeats", type=int, default=None, help="default: --repeats")
    p.add_argument("--threads", default="1,2", help="torch thread counts for the interference loop (default 1,2)")
    p.add_argument("--methods", default=None, help=f"comma list to run (default all): {','.join(method_names())}")
    p.add_argument(
        "--out", default=os.path.join(REPO, "bench-results"), help="output directory (default bench-results/)"
    )
    p.add_argument("--scratch", default=None, help="where checkpoints are written (default: a new dir under $TMPDIR)")
    p.add_argument("--keep-scratch", action="store_true", help="do not delete the scratch directory at the end")
    p.add_argument("--no-gpu", action="store_true", help="skip the CUDA cases even if CUDA is available")
    p.add_argument("--quick", action="store_true", help="smoke run: 8M states, 2 repeats, in one process (< 1 min)")
    p.add_argument("--in-process", action="store_true", help="run all cases in this process (default with --quick)")
    p.add_argument("--case-timeout", type=float, default=3600.0, help="seconds per (method, state) subprocess")
    p.add_argument(
        "--restore",
        action="store_true",
        help="also run benchmarks/restore.py (largest transformer size, same repeats) and fold its targets in",
    )
    p.add_argument(
        "--restore-json", default=None, metavar="JSON", help="fold the targets of an earlier restore.py results.json"
    )
    p.add_argument("--worker", default=None, help=argparse.SUPPRESS)
    p.add_argument("--report-only", default=None, metavar="JSON", help="re-render results.md/png from a results.json")
    args = p.parse_args(argv)
    if args.repeats < 5 and not args.quick:
        p.error("--repeats must be >= 5 (every figure is a median over >= 5 repeats); use --quick for a smoke run")
    return args


# ---------------------------------------------------------------------- environment
def _read(path: str) -> str:
    try:
        with open(path) as f:
            return f.read()
    except OSError:
        return ""


def _mem_available() -> int:
    for line in _read("/proc/meminfo").splitlines():
        if line.startswith("MemAvailable:"):
            return int(line.split()[1]) * 1024
    return 0


def _fs_of(path: str) -> str:
    best, fs = "", "?"
    real = os.path.realpath(path)
    for line in _read("/proc/mounts").splitlines():
        parts = line.split()
        if (
            len(parts) >= 3
            and (real == parts[1] or real.startswith(parts[1].rstrip("/") + "/"))
            and len(parts[1]) > len(best)
        ):
            best, fs = parts[1], f"{parts[2]} ({parts[0]} at {parts[1]})"
    return fs


def _git(*args: str) -> str:
    try:
        return subprocess.run(["git", *args], cwd=REPO, capture_output=True, text=True, timeout=10).stdout.strip()
    except (OSError, subprocess.SubprocessError):
        return ""


def environment(scratch: str) -> dict[str, Any]:
    import torch

    cpu = next(
        (ln.split(":", 1)[1].strip() for ln in _read("/proc/cpuinfo").splitlines() if ln.startswith("model name")),
        platform.processor(),
    )
    commit = _git("rev-parse", "--short", "HEAD")
    dirty = bool(_git("status", "--porcelain", "--", "asyncckpt"))
    meminfo = _read("/proc/meminfo").split()
    return {
        "date": time.strftime("%Y-%m-%d %H:%M:%S %Z"),
        "host": platform.node(),
        "cpu": cpu,
        "cpus": os.cpu_count(),
        "affinity": len(os.sched_getaffinity(0)) if hasattr(os, "sched_getaffinity") else None,
        "mem_bytes": int(meminfo[1]) * 1024 if len(meminfo) > 1 else 0,
        "loadavg": _read("/proc/loadavg").strip(),
        "python": sys.version.split()[0],
        "torch": torch.__version__,
        "torch_threads": torch.get_num_threads(),
        "cuda": torch.cuda.is_available(),
        "gpu": torch.cuda.get_device_name(0) if torch.cuda.is_available() else None,
        "kernel": platform.release(),
        "scratch": scratch,
        "scratch_fs": _fs_of(scratch),
        "asyncckpt_commit": commit + ("+dirty" if dirty else ""),
        "argv": sys.argv,
    }


# ---------------------------------------------------------------------- plan
def plan_states(args: argparse.Namespace, cuda: bool) -> list[StateSpec]:
    if args.quick:
        sizes = [8 << 20]
        small = (4 << 20, 500)
    else:
        sizes = [parse_size(s) for s in args.sizes.split(",") if s.strip()]
        small = None
        if args.small and args.small.lower() != "none":
            sz, _, n = args.small.partition(":")
            small = (parse_size(sz), int(n or 10000))
    specs = [StateSpec("transformer", n) for n in sizes]
    if small:
        specs.append(StateSpec("small", small[0], small[1]))
    if cuda and not args.no_gpu:
        specs += [StateSpec("transformer", n, device="cuda") for n in sizes]
    return specs


def plan_cases(args: argparse.Namespace, specs: list[StateSpec], method_major: bool) -> list[tuple[str, StateSpec]]:
    wanted = set(args.methods.split(",")) if args.methods else None
    if wanted:
        unknown = wanted - set(method_names())
        if unknown:
            raise SystemExit(f"unknown method(s): {', '.join(sorted(unknown))}; known: {', '.join(method_names())}")
    cases: list[tuple[str, StateSpec]] = []
    for spec in specs:
        names = ["limits", *(m.name for m in all_methods(cuda_state=spec.device != "cpu"))]
        cases += [(n, spec) for n in names if wanted is None or n in wanted or n == "limits"]
    if method_major:
        # one process: run method by method, so the process-based DCP variant without a group runs
        # before the one that leaves a checkpoint daemon behind
        order = {n: i for i, n in enumerate(method_names())}
        cases.sort(key=lambda c: order[c[0]])
    return cases


def _quick_skip(method: str, spec: StateSpec) -> str | None:
    if method in QUICK_SKIP:
        return QUICK_SKIP[method]
    if spec.kind == "small" and method.startswith("dcp.async_save"):
        return "left out of --quick on the small-tensor state (run without --quick)"
    return None


def _fits(spec: StateSpec, scratch: str) -> str | None:
    """Why a case cannot run now (memory/disk), or None."""
    need_mem = int(3.5 * spec.nbytes) + GiB
    avail = _mem_available()
    if avail and avail < need_mem:
        return f"needs ~{format_size(need_mem)} of free memory, {format_size(avail)} available"
    free = shutil.disk_usage(scratch).free
    if free < 3 * spec.nbytes + GiB:
        return f"needs ~{format_size(3 * spec.nbytes + GiB)} of free disk in {scratch}, {format_size(free)} free"
    return None


# ---------------------------------------------------------------------- execution
def run_subprocess(method: str, spec: StateSpec, cfg: Config, timeout: float) -> dict[str, Any]:
    with tempfile.TemporaryDirectory(prefix="bench-case-") as tmp:
        job = os.path.join(tmp, "job.json")
        res = os.path.join(tmp, "result.json")
        with open(job, "w") as f:
            json.dump({"method": method, "spec": spec.to_json(), "config": cfg.to_json(), "result": res}, f)
        cmd = [sys.executable, os.path.abspath(__file__), "--worker", job]
        try:
            proc = subprocess.run(cmd, timeout=timeout, stdout=sys.stderr)
            rc: int | str = proc.returncode
        except subprocess.TimeoutExpired:
            rc = "timeout"
        if os.path.exists(res):
            with open(res) as f:
                result: dict[str, Any] = json.load(f)
            if rc != 0:
                result.setdefault("worker_exit", rc)
            return result
        return {
            "method": method,
            "state": spec.name,
            "spec": spec.to_json(),
            "status": "error",
            "reason": f"worker process ended without a result (exit {rc}; killed for memory?)",
        }


def worker_main(job_path: str) -> int:
    _quiet_warnings()
    raise_fd_limit()
    with open(job_path) as f:
        job = json.load(f)
    cfg = Config.from_json(job["config"])
    res = run_case(job["method"], StateSpec.from_json(job["spec"]), cfg)
    tmp = job["result"] + ".tmp"
    with open(tmp, "w") as f:
        json.dump(res, f)
    os.replace(tmp, job["result"])
    return 0


def run_restore(specs: list[StateSpec], repeats: int, scratch: str, out_dir: str) -> dict[str, Any]:
    """benchmarks/restore.py in a subprocess (its own side-by-side run) on the largest CPU
    transformer state; its results.json goes to ``out_dir/restore/``."""
    sizes = [s.nbytes for s in specs if s.kind == "transformer" and s.device == "cpu"]
    size = format_size(max(sizes)) if sizes else "1G"
    out = os.path.join(out_dir, "restore")
    cmd = [sys.executable, os.path.join(HERE, "restore.py"), "--size", size, "--repeats", str(max(5, repeats))]
    cmd += ["--out", out, "--scratch", os.path.join(scratch, "restore")]
    os.makedirs(os.path.join(scratch, "restore"), exist_ok=True)
    log("restore: " + " ".join(cmd[1:]))
    p = subprocess.run(cmd, capture_output=True, text=True, timeout=7200)
    if p.returncode != 0:
        return {"status": "error", "reason": p.stderr[-2000:]}
    with open(os.path.join(out, "results.json")) as f:
        got: dict[str, Any] = json.load(f)
    return got


def write_outputs(data: dict[str, Any], out_dir: str) -> None:
    os.makedirs(out_dir, exist_ok=True)
    data["targets"] = evaluate_targets(data)
    with open(os.path.join(out_dir, "results.json"), "w") as f:
        json.dump(data, f, indent=1)
    md = markdown(data)
    with open(os.path.join(out_dir, "results.md"), "w") as f:
        f.write(md)
    msg = plot(data, os.path.join(out_dir, "results.png"))
    if msg:
        log(msg)
    log(f"wrote {out_dir}/results.json, results.md" + ("" if msg else ", results.png"))


def main(argv: list[str] | None = None) -> int:
    args = parse_args(argv)
    if args.worker:
        return worker_main(args.worker)
    if args.report_only:
        with open(args.report_only) as f:
            data = json.load(f)
        write_outputs(data, args.out)
        print(markdown(data))
        return 0
    _quiet_warnings()
    fd_limit = raise_fd_limit()
    own_scratch = args.scratch is None
    scratch = args.scratch or tempfile.mkdtemp(prefix="asyncckpt-bench-")
    scratch = os.path.join(scratch, f"run-{os.getpid()}") if not own_scratch else scratch
    os.makedirs(scratch, exist_ok=True)
    env = environment(scratch)
    env["open_files_limit"] = fd_limit
    repeats = 2 if args.quick else args.repeats
    cfg = Config(
        scratch=scratch,
        repeats=repeats,
        interference_repeats=1 if args.quick else (args.interference_repeats or repeats),
        threads=(1,) if args.quick else tuple(int(t) for t in args.threads.split(",")),
        baseline_steps=8 if args.quick else 30,
        memory_saves=1 if args.quick else 2,
        restore_repeats=1 if args.quick else repeats,
        quick=args.quick,
    )
    specs = plan_states(args, env["cuda"])
    in_process = args.quick or args.in_process
    cases = plan_cases(args, specs, method_major=in_process)
    report_order = {(m, s.name): i for i, (m, s) in enumerate(plan_cases(args, specs, method_major=False))}
    data: dict[str, Any] = {"meta": env, "config": cfg.to_json(), "results": []}
    log(f"{len(cases)} cases on {', '.join(s.name for s in specs)}; scratch {scratch} ({env['scratch_fs']})")
    t0 = time.perf_counter()
    try:
        for method, spec in cases:
            why = _quick_skip(method, spec) if args.quick and not args.methods else None
            why = why or _fits(spec, scratch)
            if why:
                log(f"skip {method} on {spec.name}: {why}")
                data["results"].append(
                    {"method": method, "state": spec.name, "spec": spec.to_json(), "status": "skipped", "reason": why}
                )
                continue
            if in_process:
                res = run_case(method, spec, cfg)
            else:
                res = run_subprocess(method, spec, cfg, args.case_timeout)
            data["results"].append(res)
            # keep partial results on disk while a long run goes on
            with open(os.path.join(scratch, "partial.json"), "w") as f:
                json.dump(data, f)
        if args.restore:
            data["restore"] = run_restore(specs, repeats, scratch, args.out)
        elif args.restore_json:
            with open(args.restore_json) as f:
                data["restore"] = json.load(f)
            data["restore"]["from"] = args.restore_json
    except KeyboardInterrupt:
        log("interrupted: writing what was measured so far")
    finally:
        data["meta"]["wall_s"] = time.perf_counter() - t0
        # report order: state by state, limits first (an in-process run goes method by method)
        data["results"].sort(key=lambda r: report_order.get((r["method"], r["state"]), 1 << 30))
        write_outputs(data, args.out)
        if not args.keep_scratch:
            shutil.rmtree(scratch, ignore_errors=True)
    print(markdown(data))
    return 0


if __name__ == "__main__":
    sys.exit(main())
