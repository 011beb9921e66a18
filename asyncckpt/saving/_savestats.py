"""What a committed save reports of itself: its :class:`SaveStatistics` and its log line.

Every rank builds its own statistics (its phases' times, its writer CPU); the rank that
committed the step logs it once at INFO, with the bytes of every rank, the others at DEBUG.
Sizes and rates are printed with units picked by magnitude (:func:`format_bytes`).
"""

from __future__ import annotations

import logging
import time

from .._info import SaveStatistics
from ..threads._cpumeter import thread_cpu
from ._savejob import SaveJob

log = logging.getLogger("asyncckpt")


def save_statistics(job: SaveJob, nbytes: int, loop_cpu0: float) -> SaveStatistics:
    """This rank's statistics of the committed ``job`` (``nbytes``: of every rank), measured
    now; ``loop_cpu0``: the writer thread's CPU time when the save began."""
    return SaveStatistics(
        wait_s=job.wait_s,
        staging_s=job.progress.staging_s if job.progress is not None else job.staging_s,
        write_s=job.times.get("write", 0.0),
        fsync_s=job.times.get("fsync", 0.0),
        commit_s=job.times.get("commit", 0.0),
        total_s=time.perf_counter() - job.started,
        nbytes=nbytes,
        direct_io=job.direct,
        writer_cpu_s=job.meter.seconds + (thread_cpu() - loop_cpu0),
        device_copy_s=job.times.get("device_copy", 0.0),
        prepare_s=job.prepared[0],
        prepare_cpu_s=job.prepared[1],
    )


def log_committed(job: SaveJob, stats: SaveStatistics, rank: int, world: int) -> None:
    """Log the committed ``job``: once per save at INFO by the rank that committed it (rank 0),
    with the bytes of every rank; at DEBUG on the others."""
    if rank == 0:
        log.info(
            "%scommitted step %d: %s%s in %.3fs (%s; staging %.3fs, write %.3fs, fsync %.3fs, commit %.3fs)",
            f"rank {rank}: " if world > 1 else "",
            job.step,
            format_bytes(stats.nbytes),
            f" from {world} ranks" if world > 1 else "",
            stats.total_s,
            format_rate(stats.nbytes, stats.total_s),
            stats.staging_s,
            stats.write_s,
            stats.fsync_s,
            stats.commit_s,
        )
    else:
        log.debug("rank %d: step %d committed by rank 0 (%s written here)", rank, job.step, format_bytes(job.nbytes))


def format_bytes(n: float) -> str:
    """``n`` bytes in decimal units a person reads at a glance: ``512 B``, ``3.4 MB``, ``1.25 GB``."""
    for unit, scale in (("TB", 1e12), ("GB", 1e9), ("MB", 1e6), ("kB", 1e3)):
        if n >= scale:
            v = n / scale
            return f"{v:.{2 if v < 10 else 1 if v < 100 else 0}f} {unit}"
    return f"{int(n)} B"


def format_rate(nbytes: float, seconds: float) -> str:
    """A transfer rate with its unit picked by size (``812 MB/s``, never ``0.00 GB/s``)."""
    if seconds <= 0:
        return "n/a"
    return format_bytes(nbytes / seconds) + "/s"
