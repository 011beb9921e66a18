"""What the kernel said when a pytest-xdist worker died (a crash leaves no Python traceback
when the process is SIGKILLed: the OOM killer, or a signal that reached the wrong pid)."""

from __future__ import annotations

import re
import subprocess

#: Kernel log lines that say why a process died.
CAUSES = re.compile(r"Out of memory|oom[-_ ]kill|Killed process|segfault|traps:|general protection|SIGBUS", re.I)


def mem_available_mib() -> int | None:
    try:
        with open("/proc/meminfo") as f:
            for line in f:
                if line.startswith("MemAvailable:"):
                    return int(line.split()[1]) // 1024
    except OSError:
        pass
    return None


def kernel_notes(limit: int = 6) -> str:
    """One line: the last ``limit`` kernel log lines naming a death (or that there are none),
    and the memory available now. Never raises (a diagnostic must not hide the failure)."""
    try:
        out = subprocess.run(["dmesg"], capture_output=True, text=True, timeout=10).stdout
        lines = [ln.strip() for ln in out.splitlines() if CAUSES.search(ln)][-limit:]
        said = " | ".join(lines) if lines else "no OOM kill, segfault or trap in the kernel log"
    except (OSError, subprocess.SubprocessError) as e:
        said = f"kernel log unreadable ({e})"
    return f"kernel: {said}; MemAvailable now {mem_available_mib()} MiB"
