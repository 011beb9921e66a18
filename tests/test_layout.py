"""The tests' own layout: test files in tests/, what they run in tests/support/, and every
worker a test starts by path is there (a path that names no file fails only when that test
runs, and then as a rank that never started)."""

from __future__ import annotations

import re
from pathlib import Path

TESTS = Path(__file__).resolve().parent
SUPPORT = TESTS / "support"
SUPPORT_FILE = re.compile(r"[\"']support[\"']\s*[/,]\s*[\"'](\w+\.py)[\"']")  # "support" / NAME.py


def test_only_test_files_and_conftest_sit_in_tests() -> None:
    stray = [p.name for p in TESTS.glob("*.py") if p.name != "conftest.py" and not p.name.startswith("test_")]
    assert stray == [], f"helper modules belong in tests/support/ (and its __init__'s list): {stray}"


def test_support_docstring_names_every_module() -> None:
    doc = (SUPPORT / "__init__.py").read_text()
    missing = [p.stem for p in SUPPORT.glob("*.py") if p.name != "__init__.py" and p.stem not in doc]
    assert missing == [], f"say what these are for in tests/support/__init__.py: {missing}"


def test_every_helper_a_test_names_by_file_exists_in_support() -> None:
    named = {(p.name, m) for p in TESTS.glob("test_*.py") for m in re.findall(SUPPORT_FILE, p.read_text())}
    missing = sorted((f, m) for f, m in named if not (SUPPORT / m).is_file())
    assert missing == [], f"not in tests/support/: {missing}"
    beside = sorted(
        p.name for p in TESTS.glob("test_*.py") if re.search(r"with_name\([\"']_\w+\.py[\"']\)", p.read_text())
    )
    assert beside == [], f"start workers as Path(__file__).parent / 'support' / NAME, not beside the test: {beside}"
