"""A checkpoint's config as a spec, and its tensors in specc's parameter names.

Contracts:

- `config_to_spec(config, tensors, name)` is the spec as plain data, read through the family's
  table (specc.importers.hf.families); a config value specc cannot compute exactly raises CheckpointError
  naming the field and its value, never a spec that computes something else.
- `convert_tensors(family, config, tensors, resolved)` fills every parameter of the resolved spec
  (the names of specc.spec.costs.parameter_shapes, docs/weights.md) from the checkpoint, and uses
  every checkpoint tensor: a tied alias must equal its table, a tensor in the family's `zero` list
  must be zero, a stored sinusoid table must be the formula's, a buffer must match the family's
  `ignore` list. Anything left over raises CheckpointError.

Torch is imported where tensors are compared, not at module import.
"""
from __future__ import annotations

import copy
import json
import re

from specc.importers.hf.checkpoint import CheckpointError
from specc.importers.hf.families import BY_TYPE
from specc.importers.hf.table import MISSING, Family, set_key
from specc.spec.costs import parameter_shapes


# --- config -> spec ----------------------------------------------------------------------------


def _merge(into: dict, data: dict) -> None:
    for k, v in data.items():
        if isinstance(v, dict) and isinstance(into.get(k), dict):
            _merge(into[k], v)
        else:
            into[k] = copy.deepcopy(v)


def family_of(config: dict, where: str = "config.json") -> tuple[Family, str]:
    mt = config.get("model_type")
    fam = BY_TYPE.get(mt)
    if fam is None:
        raise CheckpointError(f"{where}: model_type {mt!r} has no importer; specc imports "
                              + ", ".join(sorted(BY_TYPE)))
    archs = config.get("architectures") or [next(iter(fam.heads))]
    arch = archs[0]
    if arch not in fam.heads:
        raise CheckpointError(f"{where}: architectures {arch!r} is not imported for model_type {mt!r}; "
                              f"specc imports " + ", ".join(fam.heads))
    return fam, arch


def config_to_spec(config: dict, tensors: dict, name: str, where: str = "config.json") -> dict:
    """The spec (plain data) for a checkpoint's config; refuses what specc cannot express."""
    fam, arch = family_of(config, where)
    for r in fam.refuse:
        value = config.get(r.name, r.default)
        if value not in r.allowed:
            why = f" ({r.why})" if r.why else ""
            raise CheckpointError(f"{where}: {r.name} = {json.dumps(value)}: specc cannot express this{why}; "
                                  f"it imports {' or '.join(json.dumps(a) for a in r.allowed)}")
    spec: dict = {"specc": 1, "name": name}
    _merge(spec, fam.fixed)
    for f in fam.fields:
        value = config.get(f.name, f.default)
        if value is MISSING:
            raise CheckpointError(f"{where}: {f.name} is missing (specc's {f.key} comes from it)")
        try:
            value = f.convert(value)
        except ValueError as exc:
            raise CheckpointError(f"{where}: {f.name}: {exc}") from None
        set_key(spec, f.key, value)
    if fam.extra is not None:
        try:
            fam.extra(spec, config)
        except ValueError as exc:
            raise CheckpointError(f"{where}: {exc}") from None
        except KeyError as exc:
            raise CheckpointError(f"{where}: {exc.args[0]} is missing") from None
    spec["outputs"] = fam.heads[arch](config, tensors)
    if not any(o["kind"] in ("lm", "mlm") for o in spec["outputs"]):
        spec["vocab"].pop("tie_output", None)  # nothing to tie (BertModel, classifiers)
    _check_tokens(spec, config, where)
    length = spec.get("position", {}).get("max_length", 512)
    spec["serving"] = {"length": {"min": 1, "opt": min(128, length), "max": min(512, length)}}
    return spec


def _check_tokens(spec: dict, config: dict, where: str) -> None:
    size = spec["vocab"]["size"]
    target = spec["vocab"].get("target_size") or size
    fields = {"bos": "bos_token_id", "eos": "eos_token_id", "pad": "pad_token_id", "decoder_start": "decoder_start_token_id"}
    for key, value in list(spec.get("tokens", {}).items()):
        if value is None:
            del spec["tokens"][key]
            continue
        if isinstance(value, list):  # several EOS ids (LLaMA 3): specc stops on one
            raise CheckpointError(f"{where}: {fields[key]} = {json.dumps(value)}: specc takes one id per special token")
        limit = target if key == "decoder_start" or spec["architecture"] != "encoder-decoder" else size
        if not 0 <= value < limit:
            raise CheckpointError(f"{where}: {fields[key]} = {value} is outside the vocabulary (0..{limit - 1})")


# --- tensors -> specc's names -------------------------------------------------------------------


def _transform(t, how: str, where: str):
    if how == "copy":
        return t
    if how == "transpose":  # GPT-2's Conv1D stores [in, out]
        return t.t()
    if how.startswith("qkv"):
        part = int(how[3:])
        if t.dim() == 2:  # Conv1D [D, 3D] -> q, k, v as [D, D] Linear weights
            if t.shape[1] % 3:
                raise CheckpointError(f"{where}: shape {tuple(t.shape)} does not split into q, k, v")
            return t.t().chunk(3, dim=0)[part]
        return t.chunk(3, dim=0)[part]
    if how == "offset2":  # BART's learned positions: position p is row p + 2
        return t[2:]
    raise AssertionError(how)


def expand(fam: Family, resolved, heads: list[str]) -> dict[str, tuple[tuple[str, ...], str]]:
    """specc name -> (checkpoint name candidates, transform), every template expanded."""
    counts = {"encoder": len(resolved.encoder.layers) if resolved.encoder else 0,
              "decoder": len(resolved.decoder.layers) if resolved.decoder else 0}
    out = {}
    for row in fam.names:
        layers = range(counts[row.stack]) if row.stack else [None]
        for i in layers:
            for head in heads if "{head}" in row.specc else [None]:
                key = row.specc.format(i=i, head=head)
                out.setdefault(key, (tuple(c.format(i=i) for c in row.hf), row.transform))
    return out


def convert_tensors(fam: Family, config: dict, tensors: dict, resolved, where: str) -> dict:
    """specc's parameters from the checkpoint's tensors; every parameter filled, every tensor used."""
    shapes = parameter_shapes(resolved)
    table = expand(fam, resolved, [o.name for o in resolved.outputs])
    used: set[str] = set()

    def find(candidates: tuple[str, ...]) -> str | None:
        for c in candidates:
            for p in fam.prefixes:
                if p + c in tensors:
                    return p + c
        return None

    out = {}
    for name, shape in shapes.items():
        if name not in table:
            raise CheckpointError(f"{where}: no checkpoint tensor maps to specc's {name} (an importer gap)")
        candidates, how = table[name]
        src = find(candidates)
        if src is None:
            raise CheckpointError(f"{where}: the checkpoint has none of {', '.join(candidates)} (for specc's {name})")
        t = _transform(tensors[src], how, src)
        if tuple(t.shape) != tuple(shape):
            raise CheckpointError(f"{where}: {src} has shape {tuple(tensors[src].shape)}; specc's {name} "
                                  f"needs {tuple(shape)} from this config")
        used.add(src)
        out[name] = t.contiguous() if how == "copy" else t.contiguous().clone()  # views would share storage
    _check_leftovers(fam, resolved, table, tensors, out, used, find, where)
    return out


def _check_leftovers(fam, resolved, table, tensors, out, used, find, where) -> None:
    import torch

    # tied copies some checkpoints keep (pytorch_model.bin stores every alias) must equal the table
    tied_aliases = {}
    for name, (candidates, how) in table.items():
        if name in out:
            for c in candidates:
                for p in fam.prefixes:
                    if p + c in tensors and p + c not in used:
                        tied_aliases[p + c] = name
    for head in ("lm_head.weight", "cls.predictions.decoder.weight"):
        src = find((head,))
        if src and src not in used and "embeddings.tokens.weight" in out:
            role = "embeddings.target_tokens.weight" if "embeddings.target_tokens.weight" in out else "embeddings.tokens.weight"
            tied_aliases[src] = role
    for src, name in tied_aliases.items():
        t = tensors[src]
        if tuple(t.shape) == tuple(out[name].shape) and torch.equal(t.to(out[name].dtype), out[name]):
            used.add(src)
        elif src.endswith(("lm_head.weight", "decoder.weight")):
            raise CheckpointError(f"{where}: {src} differs from the embedding table, but the config ties "
                                  "them (tie_word_embeddings); specc would compute with the table")
    for z in fam.zero:
        src = find((z,))
        if src is not None:
            if torch.count_nonzero(tensors[src]):
                raise CheckpointError(f"{where}: {src} is not zero; specc's lm output has no bias on the logits")
            used.add(src)
    for src in tensors:
        if src not in used and any(re.search(p, src) for p in fam.ignore):
            used.add(src)
    if resolved.position.kind == "sinusoidal":
        _check_sinusoids(tensors, used, find, resolved, where)
    left = sorted(set(tensors) - used)
    if left:
        shown = ", ".join(left[:6]) + (f", ... ({len(left)} in all)" if len(left) > 6 else "")
        raise CheckpointError(f"{where}: checkpoint tensor(s) with no place in the spec: {shown}; "
                              "specc refuses rather than compute without them")


def _check_sinusoids(tensors, used, find, resolved, where) -> None:
    """Marian and Pegasus store their fixed sinusoid tables: they must be the formula's."""
    import torch

    from specc.nn.positions import sinusoidal  # imports torch

    pos = resolved.position
    for stack in ("encoder", "decoder"):
        src = find((f"{stack}.embed_positions.weight",))
        if src is None:
            continue
        t = tensors[src].to(torch.float32)
        want = sinusoidal(torch.arange(t.shape[0])[None], t.shape[1], pos.base, pos.layout)[0]
        if t.shape[1] != resolved.d_model or float((t - want).abs().max()) > 1e-4:
            raise CheckpointError(f"{where}: {src} is not the sinusoid table of d_model {resolved.d_model} "
                                  f"(layout {pos.layout}); specc computes that table and would differ")
        used.add(src)
