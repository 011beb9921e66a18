"""Argument types, errors and the subcommand template shared by the commands."""

from __future__ import annotations

import argparse
import math
from typing import Any


class UsageError(Exception):
    """The command line asks for something that cannot be done as typed (exit status 2)."""


class DataError(Exception):
    """The data on disk does not allow what was asked, though it is not corrupt (exit status 1)."""


class Formatter(argparse.RawDescriptionHelpFormatter):
    def __init__(self, prog: str) -> None:
        super().__init__(prog, max_help_position=32)


def non_negative_int(text: str) -> int:
    try:
        v = int(text, 10)
    except ValueError:
        raise argparse.ArgumentTypeError(f"expected a non-negative integer, got {text!r}") from None
    if v < 0:
        raise argparse.ArgumentTypeError(f"expected a non-negative integer, got {text!r}")
    return v


def positive_int(text: str) -> int:
    v = non_negative_int(text)
    if v < 1:
        raise argparse.ArgumentTypeError(f"expected a positive integer, got {text!r}")
    return v


def seconds(text: str) -> float:
    try:
        v = float(text)
    except ValueError:
        raise argparse.ArgumentTypeError(f"expected a number of seconds, got {text!r}") from None
    if not v >= 0 or math.isinf(v):
        raise argparse.ArgumentTypeError(f"expected a non-negative number of seconds, got {text!r}")
    return v


def command(sub: Any, name: str, summary: str, description: str, examples: str) -> argparse.ArgumentParser:
    """Add subcommand ``name`` taking the ROOT positional."""
    p: argparse.ArgumentParser = sub.add_parser(
        name, help=summary, description=description, epilog="examples:\n" + examples, formatter_class=Formatter
    )
    p.add_argument("root", metavar="ROOT", help="the checkpoint root directory (holds step_NNNNNNNN/)")
    return p


def add_step(p: argparse.ArgumentParser, what: str) -> None:
    """``--step N`` defaulting to the newest complete checkpoint (the same rule everywhere)."""
    p.add_argument("--step", type=non_negative_int, metavar="N", help=f"the step to {what} (default: newest complete)")
