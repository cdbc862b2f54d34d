"""A build's manifest.json: its name, its version, and what makes a file one.

Torch-free and standard library only: the build directory's guard (specc/export/outdir.py) and the
runtime both read it. A specc manifest is a JSON object with an integer `specc_manifest` and an
`artifacts` list of {path, bytes, sha256} whose paths are relative and stay inside the build
folder. Anything else named manifest.json (a web app's, another tool's) is not a build.
"""
from __future__ import annotations

import json
from pathlib import Path, PurePosixPath
from typing import Any

MANIFEST = "manifest.json"
MANIFEST_VERSION = 1
MAX_MANIFEST_BYTES = 64 << 20  # a manifest lists graphs and hashes; a larger file is not one


class NotAManifest(ValueError):
    """The file is not a specc manifest; the message says why (without the path)."""


def read_manifest(path: str | Path) -> dict[str, Any]:
    """The parsed manifest at `path`. Raises NotAManifest if it is not a regular file of specc's
    manifest shape, OSError if it cannot be read."""
    path = Path(path)
    if not path.is_file():
        raise NotAManifest("not a regular file")
    if path.stat().st_size > MAX_MANIFEST_BYTES:
        raise NotAManifest(f"larger than {MAX_MANIFEST_BYTES >> 20} MiB")
    try:
        data = json.loads(path.read_bytes())
    except ValueError as exc:
        raise NotAManifest(f"not JSON ({exc})") from None
    if not isinstance(data, dict) or not isinstance(data.get("specc_manifest"), int):
        raise NotAManifest("not a specc manifest (no integer 'specc_manifest')")
    artifact_paths(data)
    return data


def artifact_paths(manifest: dict[str, Any]) -> list[str]:
    """The relative paths of the files a build wrote, as its manifest lists them (itself apart).
    Raises NotAManifest for a list that is malformed or names a path outside the folder."""
    artifacts = manifest.get("artifacts")
    if not isinstance(artifacts, list):
        raise NotAManifest("'artifacts' is not a list")
    paths = []
    for entry in artifacts:
        path = entry.get("path") if isinstance(entry, dict) else None
        if not isinstance(path, str) or not _inside(path):
            raise NotAManifest(f"artifact entry {entry!r} does not name a path inside the build")
        paths.append(path)
    return paths


def _inside(path: str) -> bool:
    p = PurePosixPath(path)
    return bool(path) and "\\" not in path and "\0" not in path and not p.is_absolute() \
        and ".." not in p.parts and p.as_posix() not in (".", MANIFEST)
