"""Each finished bench record as one JSON line, as it is made.

`bik bench NAME --json PATH` writes PATH only when the bench ends; meanwhile every record a
bench passes to :func:`emit` is appended to ``PATH.partial.jsonl`` (removed once PATH is
written). A run cut off by a time limit -- tools/device_check.sh gives each bench a deadline --
so keeps every case that finished. :func:`tags` adds fields an outer loop knows (the backend,
the split mode) to the records emitted inside it.
"""

from __future__ import annotations

import contextlib
import json
from collections.abc import Iterator
from pathlib import Path

_path: Path | None = None
_tags: dict = {}


def partial_path(json_path: str | Path) -> Path:
    return Path(f"{json_path}.partial.jsonl")


@contextlib.contextmanager
def streaming(json_path: str | Path | None) -> Iterator[None]:
    """Within the block, :func:`emit` appends to ``json_path``'s partial file (nothing when
    ``json_path`` is None); the file starts empty."""
    global _path
    if json_path is None:
        yield
        return
    path = partial_path(json_path)
    path.parent.mkdir(parents=True, exist_ok=True)
    path.write_text("")
    _path = path
    try:
        yield
    finally:
        _path = None


@contextlib.contextmanager
def tags(**fields) -> Iterator[None]:
    """Fields added to every record emitted within the block."""
    global _tags
    before = _tags
    _tags = before | fields
    try:
        yield
    finally:
        _tags = before


def emit(record: dict) -> dict:
    """Append ``record`` (with the current tags) to the partial file; returns it unchanged."""
    if _path is not None:
        with _path.open("a") as f:
            f.write(json.dumps(_tags | record, default=str) + "\n")
    return record
