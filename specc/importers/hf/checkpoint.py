"""Reading a Hugging Face checkpoint folder: config.json and its tensors, nothing interpreted.

Contract: `read_checkpoint(folder)` returns (config, {name: tensor}) or raises CheckpointError
naming the file. Tensors come from model.safetensors (or the shards a model.safetensors.index.json
names), else from pytorch_model.bin (or its index) through torch.load(weights_only=True): tensors
and plain containers only, never pickled code. Nothing is downloaded. The only rewrite is of old
BERT names (LayerNorm `gamma` / `beta` -> `weight` / `bias`).
"""
from __future__ import annotations

import json
import os
import re
from pathlib import Path
from typing import Any

from specc.errors import SpeccError, WeightsError


class CheckpointError(SpeccError):
    """A checkpoint folder that cannot be imported, or a config specc cannot express."""


def read_checkpoint(src: str | os.PathLike) -> tuple[dict, dict]:
    """(config, {name: tensor}) from a folder: config.json plus model.safetensors (or a sharded
    model.safetensors.index.json), else pytorch_model.bin (weights_only=True, or its index)."""
    # torch (and specc.weights.io, which imports it) only when tensors are read: the rest of
    # specc.importers.hf (the tables, describe(), config -> spec) works without it
    import torch

    from specc.weights.io import read_safetensors

    src = Path(src)
    if not src.is_dir():
        raise CheckpointError(f"{src}: not a checkpoint folder")
    cfg_path = src / "config.json"
    try:
        config = json.loads(cfg_path.read_text())
    except FileNotFoundError:
        raise CheckpointError(f"{src}: no config.json") from None
    except (OSError, ValueError) as exc:
        raise CheckpointError(f"{cfg_path}: cannot read it ({exc})") from None
    if not isinstance(config, dict):
        raise CheckpointError(f"{cfg_path}: not a JSON object")

    def shards(index: Path) -> list[Path]:
        try:
            files = sorted(set(json.loads(index.read_text())["weight_map"].values()))
        except (OSError, ValueError, KeyError, TypeError) as exc:
            raise CheckpointError(f"{index}: not a weights index ({exc})") from None
        return [src / f for f in files]

    if (src / "model.safetensors").is_file():
        files, kind = [src / "model.safetensors"], "safetensors"
    elif (src / "model.safetensors.index.json").is_file():
        files, kind = shards(src / "model.safetensors.index.json"), "safetensors"
    elif (src / "pytorch_model.bin").is_file():
        files, kind = [src / "pytorch_model.bin"], "bin"
    elif (src / "pytorch_model.bin.index.json").is_file():
        files, kind = shards(src / "pytorch_model.bin.index.json"), "bin"
    else:
        raise CheckpointError(f"{src}: no model.safetensors or pytorch_model.bin (nor a sharded index)")
    tensors: dict[str, Any] = {}
    for f in files:
        if kind == "safetensors":
            try:
                tensors.update(read_safetensors(f))
            except WeightsError as exc:
                raise CheckpointError(str(exc)) from None
        else:
            try:
                # weights_only: tensors and plain containers only; never runs pickled code
                state = torch.load(f, map_location="cpu", weights_only=True)
            except FileNotFoundError:
                raise CheckpointError(f"{f}: missing (named by the index)") from None
            except Exception as exc:  # torch raises UnpicklingError, RuntimeError, ...
                first = str(exc).strip().splitlines()[0] if str(exc).strip() else type(exc).__name__
                raise CheckpointError(f"{f}: cannot load it with torch.load(weights_only=True): {first}") from None
            if not isinstance(state, dict) or not all(isinstance(v, torch.Tensor) for v in state.values()):
                raise CheckpointError(f"{f}: not a state dict of tensors")
            tensors.update(state)
    # old BERT checkpoints name LayerNorm parameters gamma / beta
    return config, {re.sub(r"\.gamma$", ".weight", re.sub(r"\.beta$", ".bias", k)): v for k, v in tensors.items()}
