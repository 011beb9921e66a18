"""A griffe extension for the API reference: Sphinx roles in docstrings become code spans.

The docstrings cross-reference with Sphinx roles (``:func:`find_latest```,
``:class:`~asyncckpt.CheckpointCorruptError```), which Markdown would print as written.
This turns each into a code span of the name (``~`` keeps the last component, as Sphinx
does). Loaded by ``mkdocs.yml``; the site does not include this folder.
"""

from __future__ import annotations

import re
from typing import Any

import griffe

_ROLE = re.compile(r":(?:py:)?(?:func|class|meth|mod|attr|data|exc|obj|const):`(~?)([^`]+)`")


def _name(match: re.Match[str]) -> str:
    target = match.group(2).strip()
    if match.group(1):
        target = target.rsplit(".", 1)[-1]
    return f"`{target}`"


class SphinxRoles(griffe.Extension):
    """Rewrites Sphinx roles in every docstring griffe loads."""

    def on_object(self, *, obj: griffe.Object, **kwargs: Any) -> None:
        if obj.docstring is not None:
            obj.docstring.value = _ROLE.sub(_name, obj.docstring.value)
