"""The ``asyncckpt`` command line: list, inspect, verify, clean up and export checkpoints.

Run as ``asyncckpt COMMAND ...`` or ``python -m asyncckpt COMMAND ...``. Every command reads
the disk through :mod:`asyncckpt.reading` (the library's own discovery), so what the CLI
calls complete is exactly what :func:`asyncckpt.find_latest` would resume from. ``ls``,
``info``, ``verify`` and ``gc`` never import torch; only ``export`` and ``import`` do.

Exit status (:data:`EXIT_OK` ...): 0 success, 1 a data problem (missing, incomplete or
corrupt checkpoint, a bad file, an I/O error), 2 a usage error, 130 interrupted, 141 the
output pipe was closed, 70 an internal error (a bug: one line, the traceback only with
``ASYNCCKPT_DEBUG=1``). Errors are one line on stderr, never a traceback.
"""

from __future__ import annotations

import argparse
import os
import sys
import traceback
from collections.abc import Callable
from types import ModuleType

from .._errors import CheckpointError
from . import export, gc, import_dcp, info, ls, pull, push, verify
from ._args import DataError, Formatter, UsageError
from ._print import PROG, safe

__all__ = ["EXIT_DATA", "EXIT_INTERNAL", "EXIT_OK", "EXIT_USAGE", "build_parser", "main"]

EXIT_OK = 0
EXIT_DATA = 1
EXIT_USAGE = 2
EXIT_INTERNAL = 70
EXIT_INTERRUPTED = 130
EXIT_PIPE = 141

_COMMANDS: tuple[ModuleType, ...] = (ls, info, verify, gc, export, push, pull, import_dcp)


def build_parser() -> argparse.ArgumentParser:
    """The argument parser of the ``asyncckpt`` command (each subcommand sets ``func``)."""
    from .. import __version__

    parser = argparse.ArgumentParser(
        prog=PROG,
        formatter_class=Formatter,
        description="Inspect, verify, clean up and export asyncckpt checkpoints.",
        epilog=(
            "exit status: 0 ok, 1 missing/incomplete/corrupt data or I/O error, 2 usage error,\n"
            "130 interrupted, 70 internal error\n\n"
            "examples:\n"
            "  asyncckpt ls ckpt/\n"
            "  asyncckpt verify ckpt/ --all\n"
            "  asyncckpt export ckpt/ --key model --to model.safetensors\n\n"
            "every command takes --json; run 'asyncckpt COMMAND --help' for its options"
        ),
    )
    parser.add_argument("--version", action="version", version=f"%(prog)s {__version__}")
    sub = parser.add_subparsers(dest="command", required=True, metavar="COMMAND")
    for module in _COMMANDS:
        p = module.add_parser(sub)
        p.add_argument("--json", action="store_true", help="print JSON on stdout instead of text")
        p.set_defaults(func=module.run)
    return parser


def _error(command: str | None, message: str) -> None:
    print(safe(f"{PROG}{' ' + command if command else ''}: error: {message}"), file=sys.stderr)


def _oserror_text(e: OSError) -> str:
    if e.strerror and e.filename is not None:
        return f"{e.strerror}: {e.filename}"
    return str(e) or type(e).__name__


def _exit_status(e: SystemExit) -> int:
    if e.code is None:
        return EXIT_OK
    return e.code if isinstance(e.code, int) else EXIT_USAGE


def main(argv: list[str] | None = None) -> int:
    """Run the command line with ``argv`` (default ``sys.argv[1:]``) and return the exit status.

    Never raises for expected failures: each becomes one line on stderr and an exit status
    (see the module docstring).
    """
    parser = build_parser()
    try:
        args = parser.parse_args(argv)
    except SystemExit as e:  # --help, --version, or a usage error argparse already printed
        return _exit_status(e)
    command: str = args.command
    func: Callable[[argparse.Namespace], int] = args.func
    try:
        return func(args)
    except UsageError as e:
        _error(command, str(e))
        return EXIT_USAGE
    except (CheckpointError, DataError) as e:
        _error(command, str(e))
        return EXIT_DATA
    except BrokenPipeError:
        # the reader went away (``asyncckpt ls | head``): stop quietly
        try:
            devnull = os.open(os.devnull, os.O_WRONLY)
            os.dup2(devnull, sys.stdout.fileno())
        except (OSError, ValueError, AttributeError):
            pass
        return EXIT_PIPE
    except OSError as e:
        _error(command, _oserror_text(e))
        return EXIT_DATA
    except MemoryError:
        _error(command, "out of memory")
        return EXIT_DATA
    except KeyboardInterrupt:
        _error(command, "interrupted")
        return EXIT_INTERRUPTED
    except Exception as e:  # noqa: BLE001  # a bug of ours: still one line, the traceback on request
        if os.environ.get("ASYNCCKPT_DEBUG"):
            traceback.print_exc()
        _error(command, f"internal error ({type(e).__name__}: {e}); set ASYNCCKPT_DEBUG=1 for the traceback")
        return EXIT_INTERNAL
