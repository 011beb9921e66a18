"""Demo: SIGKILL a training run in the middle of a checkpoint save, resume it, and check
that the resumed run's losses match an uninterrupted run exactly.

    python examples/demo_kill_resume.py            (what `make demo` runs)

1. runs ``train_resume.py`` uninterrupted for ``--steps`` steps: the reference losses;
2. starts it again on a fresh checkpoint root, watches the root, and sends SIGKILL while a
   save is being written (a ``step_*.tmp-*`` directory with a partly written shard in it);
3. starts it once more: it resumes from the newest *complete* checkpoint;
4. compares the resumed run's loss at every step after the resume point with the
   reference, and prints PASS (exit code 0) only if every one is bit-for-bit equal.
"""

from __future__ import annotations

import argparse
import os
import re
import shutil
import signal
import subprocess
import sys
import tempfile
import threading
import time
from dataclasses import dataclass, field
from pathlib import Path

HERE = Path(__file__).resolve().parent
REPO = HERE.parent
TRAIN = HERE / "train_resume.py"

try:
    from asyncckpt import find_latest
except ModuleNotFoundError:  # a source checkout without `pip install -e .`
    sys.path.insert(0, str(REPO))
    from asyncckpt import find_latest

TMP_DIR = re.compile(r"^step_(\d+)\.tmp-[0-9a-f]+$")
SHARD = "rank00000.safetensors"


def child_env() -> dict[str, str]:
    env = dict(os.environ, PYTHONUNBUFFERED="1")
    env["PYTHONPATH"] = os.pathsep.join(p for p in (str(REPO), env.get("PYTHONPATH")) if p)
    return env


def read_losses(path: Path) -> dict[int, float]:
    losses: dict[int, float] = {}
    if path.exists():
        for line in path.read_text().splitlines():
            parts = line.split()
            if len(parts) == 2:  # a run killed mid-write may leave a torn last line
                losses[int(parts[0])] = float(parts[1])
    return losses


@dataclass
class Run:
    """A training subprocess whose output is echoed with a prefix and kept."""

    cmd: list[str]
    prefix: str
    lines: list[str] = field(default_factory=list)

    def start(self) -> None:
        self.proc = subprocess.Popen(
            self.cmd, stdout=subprocess.PIPE, stderr=subprocess.STDOUT, text=True, env=child_env()
        )
        self._reader = threading.Thread(target=self._echo, daemon=True)
        self._reader.start()

    def _echo(self) -> None:
        assert self.proc.stdout is not None
        for line in self.proc.stdout:
            self.lines.append(line.rstrip("\n"))
            print(f"{self.prefix} | {line}", end="", flush=True)

    def wait(self, timeout: float) -> int:
        try:
            rc = self.proc.wait(timeout)
        except subprocess.TimeoutExpired:
            self.proc.kill()
            self.proc.wait()
            raise
        finally:
            self._reader.join(10)
            if self.proc.stdout is not None:
                self.proc.stdout.close()
        return rc


def saves_in_progress(root: Path, from_step: int) -> list[tuple[int, Path]]:
    """(step, directory) of in-progress saves of steps >= ``from_step`` with a partly written shard."""
    try:
        names = os.listdir(root)
    except FileNotFoundError:
        return []
    out = []
    for name in names:
        m = TMP_DIR.match(name)
        if m and int(m.group(1)) >= from_step:
            try:
                written = (root / name / SHARD).stat().st_size
            except FileNotFoundError:
                continue
            if written > 0:
                out.append((int(m.group(1)), root / name))
    return out


def describe_dir(path: Path) -> str:
    try:
        files = sorted(path.iterdir())
    except FileNotFoundError:
        return "(gone)"
    return ", ".join(f"{f.name} {f.stat().st_size / 1e6:.1f} MB" for f in files) or "(empty)"


def main() -> int:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--steps", type=int, default=30)
    ap.add_argument("--save-every", type=int, default=5)
    ap.add_argument("--model-mb", type=float, default=24, help="checkpoints are ~3x this (weights + Adam)")
    ap.add_argument("--kill-from-step", type=int, default=15, help="kill during the first save of a step >= this")
    ap.add_argument("--workdir", help="where to put the runs (default: a fresh temp dir, removed afterwards)")
    ap.add_argument("--timeout", type=float, default=300, help="seconds each training run may take")
    args = ap.parse_args()
    if not args.save_every <= args.kill_from_step < args.steps:
        ap.error("need --save-every <= --kill-from-step < --steps (a checkpoint must exist before the kill)")

    work = Path(args.workdir) if args.workdir else Path(tempfile.mkdtemp(prefix="asyncckpt-demo-"))
    work.mkdir(parents=True, exist_ok=True)
    ref_root, root = work / "reference-ckpt", work / "ckpt"
    for p in (ref_root, root):
        shutil.rmtree(p, ignore_errors=True)
    ref_log, killed_log, resumed_log = work / "reference.losses", work / "killed.losses", work / "resumed.losses"
    for p in (ref_log, killed_log, resumed_log):
        p.unlink(missing_ok=True)

    def train(root: Path, log: Path) -> list[str]:
        return [
            sys.executable, str(TRAIN), "--root", str(root), "--steps", str(args.steps),
            "--save-every", str(args.save_every), "--model-mb", str(args.model_mb), "--log-losses", str(log),
        ]  # fmt: skip

    t_demo = time.monotonic()
    problems: list[str] = []

    # 1. the reference: one uninterrupted run (its output goes to a file)
    print(f"[1/4] reference run: {args.steps} steps, uninterrupted (output in {work / 'reference.out'})", flush=True)
    t0 = time.monotonic()
    with open(work / "reference.out", "w") as out:
        rc = subprocess.run(
            train(ref_root, ref_log), stdout=out, stderr=subprocess.STDOUT, env=child_env(), timeout=args.timeout
        ).returncode
    reference = read_losses(ref_log)
    print(f"      done in {time.monotonic() - t0:.1f}s, exit code {rc}, {len(reference)} losses", flush=True)
    if rc != 0 or sorted(reference) != list(range(1, args.steps + 1)):
        print(f"FAIL: the reference run did not complete; see {work / 'reference.out'}")
        return 1

    # 2. the same training on a fresh root, killed with SIGKILL while a save is being written
    print(f"\n[2/4] training again, to be killed with SIGKILL mid-save (a save of step >= {args.kill_from_step})")
    run = Run(train(root, killed_log), "killed ")
    run.start()
    victim: Path | None = None
    victim_step = -1
    deadline = time.monotonic() + args.timeout
    while victim is None and run.proc.poll() is None and time.monotonic() < deadline:
        found = saves_in_progress(root, args.kill_from_step)
        if found:
            victim_step, victim = found[0]
            run.proc.send_signal(signal.SIGKILL)
            break
        time.sleep(0.002)
    if victim is None:
        run.proc.kill()
        run.wait(30)
        print("FAIL: never caught a save in progress (the run ended or timed out first)")
        return 1
    rc = run.wait(30)
    print(f"      SIGKILL sent while {victim.name} was being written; exit code {rc}")
    print(f"      left behind: {victim.name}: {describe_dir(victim)}")
    before = find_latest(root)
    if before is None:
        print("FAIL: no complete checkpoint survived the kill")
        return 1
    print(f"      newest complete checkpoint: step {before.step}; on disk: {sorted(os.listdir(root))}", flush=True)
    if rc != -signal.SIGKILL:
        problems.append(f"the run exited with {rc}, not by SIGKILL")

    # 3. restart: it resumes from the newest complete checkpoint
    print("\n[3/4] restarting: it should resume from the newest complete checkpoint", flush=True)
    run2 = Run(train(root, resumed_log), "resumed")
    run2.start()
    rc = run2.wait(args.timeout)
    resumed_from = next((int(m.group(1)) for ln in run2.lines if (m := re.match(r"resumed from step (\d+)", ln))), None)
    if rc != 0:
        problems.append(f"the resumed run exited with {rc}")
    if resumed_from != before.step:
        problems.append(f"resumed from step {resumed_from}, expected the newest complete checkpoint {before.step}")
    leftovers = [n for n in os.listdir(root) if ".tmp-" in n or ".deleting-" in n]
    if leftovers:
        problems.append(f"leftovers of the killed save are still there: {leftovers}")

    # 4. compare every step after the resume point with the reference
    print("\n[4/4] comparing losses with the uninterrupted run", flush=True)
    start = (resumed_from or 0) + 1
    resumed = read_losses(resumed_log)
    expected_steps = list(range(start, args.steps + 1))
    if sorted(resumed) != expected_steps:
        problems.append(f"the resumed run logged steps {sorted(resumed)[:3]}..., expected {start}..{args.steps}")
    diffs = {s: abs(resumed[s] - reference[s]) for s in expected_steps if s in resumed}
    max_diff = max(diffs.values(), default=float("nan"))
    mismatched = [s for s, d in diffs.items() if d != 0.0]
    if mismatched or not diffs:
        problems.append(f"losses differ at steps {mismatched[:10]}")
    killed = read_losses(killed_log)  # the killed run's own steps must match the reference too
    killed_bad = [s for s, v in killed.items() if reference.get(s) != v]
    if killed_bad:
        problems.append(f"the killed run's losses already differed at steps {killed_bad[:10]}")

    verdict = "FAIL" if problems else "PASS"
    print(f"\n{'=' * 26} {verdict} {'=' * 26}")
    print(f"killed with SIGKILL during the save of step {victim_step}")
    print(f"  (the killed run had logged steps 1..{max(killed, default=0)})")
    print(f"resumed from step:          {resumed_from} (newest complete checkpoint: {before.step})")
    print(f"steps compared:             {len(diffs)} (steps {start}..{args.steps})")
    print(f"max |loss diff|:            {max_diff!r}  (must be exactly 0.0)")
    print(f"leftovers cleaned on start: {'yes' if not leftovers else 'NO'}")
    for p in problems:
        print(f"problem: {p}")
    print(f"total demo time:            {time.monotonic() - t_demo:.1f}s")
    if args.workdir is None and not problems:
        shutil.rmtree(work, ignore_errors=True)
    else:
        print(f"runs kept in {work}")
    return 0 if not problems else 1


if __name__ == "__main__":
    sys.exit(main())
