"""A sentence-transformers folder's pipeline as the spec's `sentence_embedding` output.

Contract: `sentence_embedding(src)` reads the folder's modules.json (sentence-transformers'
list of the modules a text passes through after the Transformer) and each Pooling module's
config.json, and returns (outputs, note): `outputs` is `[{kind: pooled, name:
sentence_embedding, pool: ...}]` where the pipeline is one the spec language computes exactly
(a Transformer, then a Pooling of one mode: `cls` -> pool first, `mean` -> pool mean over the
attention mask, `lasttoken` -> pool last, `max` -> pool max; then optionally a Normalize ->
normalize: true), else []; `note` says, where the folder has a pipeline
but no output is written, which module or mode the language has no key for (the importer puts it
in the spec's description). A folder without modules.json gives ([], "").

Not computed, so not imported (the rest of the checkpoint still is): pooling by the mean over
the square root of the length, weighted mean, or several modes at once (concatenated); Dense,
LayerNorm or any other module after the pooling but Normalize. The files are read as the checkpoint's other small files (regular files inside the
folder, JSON_LIMIT); a modules.json or Pooling config of the wrong shape is refused, naming it
and the key.
"""
from __future__ import annotations

import json
from pathlib import Path
from typing import Any

from specc.importers.errors import CheckpointError
from specc.importers.hf.checkpoint import JSON_LIMIT, read_optional

MODULES = "modules.json"
OUTPUT = "sentence_embedding"
# sentence-transformers' pooling modes (Pooling's config keys pooling_mode_<mode>[_token(s)], or
# its newer `pooling_mode`) -> the pooled output's `pool`, None where the language has none
POOLS = {"cls": "first", "mean": "mean", "lasttoken": "last", "max": "max", "mean_sqrt_len": None,
         "weightedmean": None}
_MODE_KEYS = {"pooling_mode_cls_token": "cls", "pooling_mode_mean_tokens": "mean", "pooling_mode_max_tokens": "max",
              "pooling_mode_mean_sqrt_len_tokens": "mean_sqrt_len", "pooling_mode_weightedmean_tokens": "weightedmean",
              "pooling_mode_lasttoken": "lasttoken"}


def _json(src: Path, name: str) -> Any:
    data = read_optional(src, name, JSON_LIMIT)
    if data is None:
        return None
    try:
        return json.loads(data.decode("utf-8"))
    except (ValueError, RecursionError) as exc:
        raise CheckpointError(f"{src / name}: cannot read it ({str(exc)[:200]})") from None


def _modules(src: Path) -> list[tuple[str, str]] | None:
    """(type, path) of each module in modules.json's order; None where the folder has none."""
    got = _json(src, MODULES)
    if got is None:
        return None
    where = src / MODULES
    if not isinstance(got, list) or not got:
        raise CheckpointError(f"{where}: expected a non-empty list of modules, got {type(got).__name__}")
    out = []
    for i, m in enumerate(got):
        if not isinstance(m, dict) or not isinstance(m.get("type"), str) or not isinstance(m.get("path", ""), str):
            raise CheckpointError(f"{where}: [{i}]: expected {{\"type\": string, \"path\": string}}, got {str(m)[:80]}")
        if ".." in Path(m.get("path", "")).parts or Path(m.get("path", "")).is_absolute():
            raise CheckpointError(f"{where}: [{i}].path: {m['path']!r} leads outside the folder; refused")
        out.append((m["type"], m.get("path", "")))
    return out


def _modes(src: Path, path: str) -> list[str]:
    """The pooling modes a Pooling module's config.json turns on."""
    name = f"{path}/config.json" if path else "config.json"
    config = _json(src, name)
    if not isinstance(config, dict):
        raise CheckpointError(f"{src / name}: a Pooling module's config (a JSON object) is missing")
    mode = config.get("pooling_mode")
    if mode is not None:  # sentence-transformers 6: a mode or a list of them
        modes = mode if isinstance(mode, list) else [mode]
        if not modes or any(m not in POOLS for m in modes):
            raise CheckpointError(f"{src / name}: pooling_mode: {str(mode)[:40]!r} is not one of {', '.join(POOLS)} "
                                  "(or a list of them)")
        return modes
    for key in _MODE_KEYS:
        if not isinstance(config.get(key, False), bool):
            raise CheckpointError(f"{src / name}: {key}: expected true or false, got {str(config[key])[:40]}")
    return [mode for key, mode in _MODE_KEYS.items() if config.get(key)]


def sentence_embedding(src: Path) -> tuple[list[dict], str]:
    """The folder's sentence_embedding output and, where none is written, why (the module's doc)."""
    modules = _modules(src)
    if modules is None:
        return [], ""
    kinds = [t.rsplit(".", 1)[-1] for t, _ in modules]  # sentence_transformers.models.Pooling, or 6's own path
    if kinds[0] != "Transformer":
        return [], f"{OUTPUT} not imported: {MODULES} begins with {kinds[0]}, not a Transformer"
    if len(kinds) < 2 or kinds[1] != "Pooling":
        return [], f"{OUTPUT} not imported: {MODULES} has no Pooling after the Transformer"
    normalize = kinds[2:] == ["Normalize"]
    if len(kinds) > 2 and not normalize:
        return [], f"{OUTPUT} not imported: no spec key computes {MODULES}'s {', '.join(kinds[2:])} after the pooling"
    modes = _modes(src, modules[1][1])
    if len(modes) != 1:
        said = " + ".join(modes) or "none"
        return [], f"{OUTPUT} not imported: the Pooling's modes ({said}) are not one mode"
    pool = POOLS[modes[0]]
    if pool is None:
        return [], f"{OUTPUT} not imported: the output's pool has no {modes[0]} pooling"
    return [{"kind": "pooled", "name": OUTPUT, "pool": pool, **({"normalize": True} if normalize else {})}], ""
