"""Shared fixtures. Add new fixtures below; keep existing ones as they are."""
from __future__ import annotations

import textwrap
from pathlib import Path
from typing import Callable

import pytest


@pytest.fixture
def spec_file(tmp_path: Path) -> Callable[..., Path]:
    """Write YAML text (dedented) to a file under tmp_path and return its path.

    ``spec_file(text, name="spec.yaml")``; ``name`` may contain sub-folders. Bytes are written as is.
    """

    def write(text: str | bytes, name: str = "spec.yaml") -> Path:
        path = tmp_path / name
        path.parent.mkdir(parents=True, exist_ok=True)
        if isinstance(text, bytes):
            path.write_bytes(text)
        else:
            path.write_text(textwrap.dedent(text), encoding="utf-8")
        return path

    return write


def text_position(text: str, needle: str, occurrence: int = 1) -> tuple[int, int]:
    """1-based (line, column) of the ``occurrence``-th ``needle`` in ``text`` (dedented first).

    A ``^`` in needle marks the spot within it (``"size: ^0"`` is the 0); without one, the start."""
    text = textwrap.dedent(text)
    offset = max(needle.find("^"), 0)
    needle = needle.replace("^", "", 1)
    at = -1
    for _ in range(occurrence):
        at = text.index(needle, at + 1)
    at += offset
    line = text.count("\n", 0, at) + 1
    column = at - (text.rfind("\n", 0, at) + 1) + 1
    return line, column


@pytest.fixture
def position_of() -> Callable[..., tuple[int, int]]:
    """``position_of(text, needle, occurrence=1)`` -> 1-based (line, column) of needle in text;
    a ``^`` in needle marks the spot."""
    return text_position
