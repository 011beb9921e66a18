"""The growth run: how asyncckpt's costs grow with state size and tensor count (issue 32).

    python benchmarks/growth.py                                     # 256M..8G, 1k..300k tensors
    python benchmarks/growth.py --sizes 256M,1G --counts 1000,10000 # a first, short run
    python benchmarks/growth.py --report-only DIR/results.json      # re-render results.md/png
    python benchmarks/growth.py --soak --soak-args="--saves 300"    # + benchmarks/s3_soak.py
    python benchmarks/growth.py --quick                             # smoke run, tiny states, ~10 s
    python benchmarks/growth.py --sizes none --asyncckpt /base/checkout   # another checkout's asyncckpt (A/B)

Two sweeps, each point next to its limit measured in the same run:

* sizes (``--sizes``, the transformer-shaped state of ``states.py``): ``save()`` blocking
  against the memcpy of the same tensors, durable against the raw O_DIRECT write + fsync of
  the same bytes, cold and warm ``load(into=)`` against the raw cold and warm read, and the
  peak extra RSS of save and of load;
* tensor counts (``--counts``, ``--count-size`` bytes in that many tensors, the ``small``
  state of ``states.py``): the same figures per tensor: the fixed work of ``save()`` (its
  blocking time less the memcpy of the same tensors), the load's time above the raw read,
  the peak memory per tensor, and the cyclic garbage collector's passes during ``save()``
  and ``load()``.

Every state runs in its own process (``growth_cases.py``), asyncckpt and the limits of the
same bytes round-robin (a noisy neighbour slows both alike); every figure is a median of
``--repeats`` after a warm-up. A state that would not fit in the memory or the disk there is
(checked before each) is skipped with the reason. ``--noise STATE`` runs that state once
more at the end and reports how far the second run's figures are from the first's: the
noise of the machine during the run. With ``--soak`` the long-run soak (``s3_soak.py``, local and on
SeaweedFS, requests counted per save) runs too, into ``OUT/soak/``; ``--soak-json`` folds in
the results of an earlier soak. Writes ``results.json``, ``results.md`` and (with
matplotlib, ``pip install -e '.[bench]'``) ``growth.png`` into ``--out``.
"""

from __future__ import annotations

import argparse
import json
import os
import shutil
import subprocess
import sys
import tempfile
import time
from typing import Any

HERE = os.path.dirname(os.path.abspath(__file__))
REPO = os.path.dirname(HERE)
if HERE not in sys.path:
    sys.path.insert(0, HERE)
if REPO not in sys.path:
    sys.path.insert(1, REPO)  # the checkout's asyncckpt even when it is not installed

from states import StateSpec, format_size, parse_size  # noqa: E402

GiB = 1 << 30
MiB = 1 << 20
DEFAULT_SIZES = "256M,512M,1G,2G,4G,8G"
DEFAULT_COUNTS = "1000,10000,100000,300000"


def log(msg: str) -> None:
    print(f"[{time.strftime('%H:%M:%S')}] {msg}", file=sys.stderr, flush=True)


def parse_args(argv: list[str] | None = None) -> argparse.Namespace:
    p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--sizes", default=DEFAULT_SIZES, help=f"transformer state sizes (default {DEFAULT_SIZES}; 'none')")
    p.add_argument("--counts", default=DEFAULT_COUNTS, help=f"tensor counts (default {DEFAULT_COUNTS}; 'none')")
    p.add_argument("--count-size", default="1G", help="bytes of the tensor-count states (default 1G)")
    p.add_argument("--repeats", type=int, default=3, help="repeats per figure after a warm-up (default 3, min 3)")
    p.add_argument("--noise", default="transformer-1G", help="state whose cases run twice to measure noise ('none')")
    p.add_argument("--image", default="256M", help="the raw write's file image (a multiple of 16M; default 256M)")
    p.add_argument("--copy", default="512M", help="the memcpy limit's target buffer (default 512M)")
    p.add_argument("--out", default=os.path.join(REPO, "bench-results", "growth"), help="output directory")
    p.add_argument("--scratch", default=None, help="where files are written (default: a new dir under $TMPDIR)")
    p.add_argument("--wait-for-memory", type=float, default=300.0, help="seconds to wait for room (default 300)")
    p.add_argument("--case-timeout", type=float, default=3600.0, help="seconds per state's process (default 3600)")
    p.add_argument("--soak", action="store_true", help="also run benchmarks/s3_soak.py into OUT/soak/")
    p.add_argument("--soak-args", default="", help="arguments for s3_soak.py (e.g. '--saves 300')")
    p.add_argument("--soak-json", default=None, metavar="JSON", help="fold in an earlier s3_soak.py results.json")
    p.add_argument("--asyncckpt", default=None, metavar="CHECKOUT",
                   help="import asyncckpt from this checkout (default: this one); run twice for an A/B")  # fmt: skip
    p.add_argument("--report-only", default=None, metavar="JSON", help="re-render results.md/png from a results.json")
    p.add_argument(
        "--quick",
        action="store_true",
        help="smoke run: 8M, 200/800 tensors of 4M, 16M limit buffers, no noise run, one process",
    )
    p.add_argument("--worker", default=None, help=argparse.SUPPRESS)
    args = p.parse_args(argv)
    if args.quick:  # explicit flags still win over the quick defaults
        given = set(argv if argv is not None else sys.argv[1:])
        quick = {"--sizes": "8M", "--counts": "200,800", "--count-size": "4M", "--image": "16M", "--copy": "16M",
                 "--noise": "none", "--wait-for-memory": 0.0}  # fmt: skip
        for flag, value in quick.items():
            if not any(g == flag or g.startswith(flag + "=") for g in given):
                setattr(args, flag[2:].replace("-", "_"), value)
    if args.repeats < 3:
        p.error("--repeats must be >= 3 (every figure is a median of >= 3 repeats)")
    return args


def plan_states(args: argparse.Namespace) -> list[StateSpec]:
    specs = []
    if args.sizes.lower() != "none":
        specs += [StateSpec("transformer", parse_size(s)) for s in args.sizes.split(",") if s.strip()]
    if args.counts.lower() != "none":
        size = parse_size(args.count_size)
        specs += [StateSpec("small", size, int(n)) for n in args.counts.split(",") if n.strip()]
    return specs


# ---------------------------------------------------------------------- room
def mem_available() -> int:
    with open("/proc/meminfo") as f:
        for line in f:
            if line.startswith("MemAvailable:"):
                return int(line.split()[1]) * 1024
    return 0


def need(spec: StateSpec, image: int, copy: int) -> tuple[int, int]:
    """(memory, disk) a state's case needs: the state, the staging buffer, the limits' file image
    and read buffer and memcpy targets, ~4 KB of Python objects per tensor, and 0.5 GiB; on disk the
    state three times (the kept step, the raw file, a step being written)."""
    tensors = max(spec.n_tensors, 400)
    return 2 * spec.nbytes + 2 * image + min(copy, spec.nbytes) + 4096 * tensors + GiB // 2, 3 * spec.nbytes + GiB


def why_not(spec: StateSpec, image: int, copy: int, scratch: str) -> str | None:
    mem, disk = need(spec, image, copy)
    avail = mem_available()
    if avail < mem:
        return f"needs ~{format_size(mem)} of free memory, {format_size(avail)} available"
    free = shutil.disk_usage(scratch).free
    if free < disk:
        return f"needs ~{format_size(disk)} of free disk in {scratch}, {format_size(free)} free"
    return None


# ---------------------------------------------------------------------- cases
def run_subprocess(spec: StateSpec, args: argparse.Namespace, scratch: str) -> dict[str, Any]:
    """One state's case in a fresh process; its stdout goes to our stderr (the log)."""
    with tempfile.TemporaryDirectory(prefix="growth-case-") as tmp:
        job, res = os.path.join(tmp, "job.json"), os.path.join(tmp, "result.json")
        with open(job, "w") as f:
            sizes = {"image": parse_size(args.image), "copy": parse_size(args.copy)}
            json.dump({"spec": spec.to_json(), "scratch": scratch, "repeats": args.repeats, **sizes, "result": res,
                       "asyncckpt": args.asyncckpt}, f)  # fmt: skip
        rc: int | str
        try:
            cmd = [sys.executable, os.path.abspath(__file__), "--worker", job]
            rc = subprocess.run(cmd, timeout=args.case_timeout, stdout=sys.stderr).returncode
        except subprocess.TimeoutExpired:
            rc = "timeout"
        if os.path.exists(res):
            with open(res) as f:
                out: dict[str, Any] = json.load(f)
            return out
        why = f"the case's process ended without a result (exit {rc}; killed for memory?)"
        return {"state": spec.name, "spec": spec.to_json(), "status": "error", "reason": why}


def worker_main(job_path: str) -> int:
    import traceback

    from growth_cases import run_case
    from measure import raise_fd_limit

    raise_fd_limit()
    try:  # on a shared machine, if memory runs out, the kernel is to kill this process, not a neighbour's
        with open("/proc/self/oom_score_adj", "w") as f:
            f.write("1000")
    except OSError:
        pass
    with open(job_path) as f:
        job = json.load(f)
    if job.get("asyncckpt"):  # before anything imports asyncckpt
        sys.path.insert(0, os.path.abspath(job["asyncckpt"]))
    spec = StateSpec.from_json(job["spec"])
    try:
        res = run_case(spec, job["scratch"], job["repeats"], job["image"], job["copy"])
    except Exception as e:  # noqa: BLE001 - a failing case is a result, not a crash of the run
        res = {"state": spec.name, "spec": spec.to_json(), "status": "error", "reason": f"{type(e).__name__}: {e}",
               "traceback": traceback.format_exc()[-4000:]}  # fmt: skip
    with open(job["result"] + ".tmp", "w") as f:
        json.dump(res, f)
    os.replace(job["result"] + ".tmp", job["result"])
    return 0


def run_one(spec: StateSpec, args: argparse.Namespace, scratch: str) -> dict[str, Any]:
    """One state's case, or a "skipped" record with the reason when it does not fit (after waiting
    up to ``--wait-for-memory`` seconds for the machine's other work to give memory back)."""
    deadline = time.monotonic() + args.wait_for_memory
    while True:
        why = why_not(spec, parse_size(args.image), parse_size(args.copy), scratch)
        if why is None or "memory" not in why or time.monotonic() >= deadline:
            break
        log(f"{spec.name}: {why}; waiting (up to {deadline - time.monotonic():.0f} s more)")
        time.sleep(min(15.0, max(deadline - time.monotonic(), 0.0)))
    if why:
        log(f"skip {spec.name}: {why}")
        return {"state": spec.name, "spec": spec.to_json(), "status": "skipped", "reason": why}
    if args.quick:  # one process: the states are tiny, a fresh interpreter per state would be most of the time
        from growth_cases import run_case

        out = run_case(spec, os.path.join(scratch, spec.name), args.repeats, parse_size(args.image),
                       parse_size(args.copy))  # fmt: skip
    else:
        out = run_subprocess(spec, args, os.path.join(scratch, spec.name))
    log(f"{spec.name}: {out['status']} ({out.get('case_wall_s', 0):.0f} s)")
    return out


# ---------------------------------------------------------------------- soak
def run_soak(args: argparse.Namespace) -> dict[str, Any]:
    """``s3_soak.py`` (issue 32's first problem: store traffic per save) into ``OUT/soak/``."""
    script = os.path.join(HERE, "s3_soak.py")
    if not os.path.exists(script):
        return {"status": "skipped", "reason": "benchmarks/s3_soak.py is not in this checkout"}
    out = os.path.join(args.out, "soak")
    cmd = [sys.executable, script, "--out", out, *args.soak_args.split()]
    log("soak: " + " ".join(cmd[1:]))
    rc = subprocess.run(cmd, stdout=sys.stderr).returncode
    if rc != 0:
        return {"status": "error", "reason": f"s3_soak.py exited {rc}"}
    return load_soak(os.path.join(out, "results.json"))


def load_soak(path: str) -> dict[str, Any]:
    """The per-variant summaries and per-save series of an ``s3_soak.py`` results.json."""
    with open(path) as f:
        raw = json.load(f)
    variants = {}
    # an s3_soak.py --baseline run carries the earlier run's variants too (named "... (before, N saves)")
    for name, v in [*raw.get("variants", {}).items(), *raw.get("baseline", {}).items()]:
        cols = v.get("columns", {})
        reqs = cols.get("requests", {})
        per_save = [sum(col[i] for col in reqs.values()) for i in range(len(cols.get("save", [])))] if reqs else []
        variants[name] = {
            "meta": v.get("meta", {}),
            "summary": v.get("summary", {}),
            "save": cols.get("save", []),
            "period_s": cols.get("period_s", []),
            "requests": per_save,
        }
    return {
        "status": "ok",
        "from": path,
        "saves": raw.get("saves"),
        "machine": raw.get("machine"),
        "date": raw.get("date"),
        "variants": variants,
    }


# ---------------------------------------------------------------------- main
def write_outputs(data: dict[str, Any], out_dir: str) -> None:
    from growth_report import evaluate, markdown, plot

    os.makedirs(out_dir, exist_ok=True)
    data["figures"], data["targets"] = evaluate(data)
    with open(os.path.join(out_dir, "results.json"), "w") as f:
        json.dump(data, f, indent=1)
    with open(os.path.join(out_dir, "results.md"), "w") as f:
        f.write(markdown(data))
    msg = plot(data, os.path.join(out_dir, "growth.png"))
    log(msg or f"wrote {out_dir}/growth.png")
    log(f"wrote {out_dir}/results.json, results.md")


def main(argv: list[str] | None = None) -> int:
    args = parse_args(argv)
    if args.worker:
        return worker_main(args.worker)
    if args.report_only:
        with open(args.report_only) as f:
            data = json.load(f)
        if args.soak_json:
            data["soak"] = load_soak(args.soak_json)
        write_outputs(data, args.out)
        return 0
    from run import environment

    if args.asyncckpt and args.quick:
        sys.path.insert(0, os.path.abspath(args.asyncckpt))
    own = args.scratch is None
    scratch = (
        tempfile.mkdtemp(prefix="asyncckpt-growth-") if own else os.path.join(args.scratch, f"growth-{os.getpid()}")
    )
    os.makedirs(scratch, exist_ok=True)
    specs = plan_states(args)
    data: dict[str, Any] = {
        "meta": environment(scratch),
        "config": {k: v for k, v in vars(args).items() if k != "worker"},
        "results": [],
        "noise": [],
    }
    data["meta"]["mem_available_bytes"] = mem_available()
    if args.asyncckpt:  # the commit environment() names is this checkout's: name the one measured
        data["meta"]["asyncckpt_checkout"] = os.path.abspath(args.asyncckpt)
    log(f"{len(specs)} states: {', '.join(s.name for s in specs)}; scratch {scratch} ({data['meta']['scratch_fs']})")
    t0 = time.perf_counter()
    try:
        for spec in specs:
            data["results"].append(run_one(spec, args, scratch))
            with open(os.path.join(scratch, "partial.json"), "w") as f:
                json.dump(data, f)
        noisy = [s for s in specs if s.name == args.noise]
        if noisy:
            log(f"noise: {args.noise} once more")
            data["noise"] = [run_one(noisy[0], args, scratch)]
        if args.soak:
            data["soak"] = run_soak(args)
        elif args.soak_json:
            data["soak"] = load_soak(args.soak_json)
    except KeyboardInterrupt:
        log("interrupted: writing what was measured so far")
    finally:
        data["meta"]["wall_s"] = time.perf_counter() - t0
        data["meta"]["loadavg_end"] = open("/proc/loadavg").read().strip()
        write_outputs(data, args.out)
        shutil.rmtree(scratch, ignore_errors=True)
    with open(os.path.join(args.out, "results.md")) as f:
        print(f.read())
    return 0


if __name__ == "__main__":
    sys.exit(main())
