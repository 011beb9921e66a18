"""Run ``asyncckpt export ARGS`` in this process and print its peak extra memory as JSON.

Everything the export imports is imported first; then the peak RSS (``VmHWM``) is reset to
the current RSS (``/proc/self/clear_refs``, Linux >= 4.0) and the export runs. Prints
``{"code": exit status, "base_kib": RSS before, "peak_kib": VmHWM after}``.
"""

from __future__ import annotations

import json
import sys

import torch  # noqa: F401 - imported before the baseline is taken

import asyncckpt.loading._export
import asyncckpt.loading._resume  # noqa: F401
from asyncckpt.cli import main


def status(key: str) -> int:
    with open("/proc/self/status") as f:
        for line in f:
            if line.startswith(key + ":"):
                return int(line.split()[1])
    raise KeyError(key)


if __name__ == "__main__":
    with open("/proc/self/clear_refs", "w") as f:
        f.write("5")
    base = status("VmRSS")
    code = main(["export", *sys.argv[1:]])
    print(json.dumps({"code": code, "base_kib": base, "peak_kib": status("VmHWM")}))
