"""A checkpoint's config as a spec, and its tensors in specc's parameter names.

Contracts:

- `config_to_spec(config, tensors, name)` is the spec as plain data, read through the family's
  table (its module in specc.importers.families); a config value specc cannot compute exactly raises CheckpointError
  naming the field and its value, never a spec that computes something else. So does a value of
  the wrong JSON type (config.json is untrusted: `model_type: ["gpt2"]`, `n_embd: null`), checked
  where the field is read.
- `convert_tensors(family, config, tensors, resolved)` fills every parameter of the resolved spec
  (the names of specc.spec.costs.parameter_shapes, docs/weights.md) from the checkpoint, and uses
  every checkpoint tensor: a tied alias must equal its table, a tensor in the family's `zero` list
  must be zero, a stored sinusoid table must be the formula's, a buffer must match the family's
  `ignore` list. Anything left over raises CheckpointError. It returns the parameters lazily
  (Converted): shapes and dtypes are checked from the checkpoint's headers, and each tensor is
  read and converted when it is written, so an import holds one tensor at a time.

Torch is imported where tensors are compared, not at module import.
"""
from __future__ import annotations

import copy
import re
from collections.abc import Mapping

from specc.errors import SpecError
from specc.importers.errors import CheckpointError
from specc.importers.families import BY_TYPE
from specc.importers.table import MISSING, STR_OR_NULL, Family, read, set_key, shown
from specc.spec.costs import parameter_shapes


# --- config -> spec ----------------------------------------------------------------------------


def _merge(into: dict, data: dict) -> None:
    for k, v in data.items():
        if isinstance(v, dict) and isinstance(into.get(k), dict):
            _merge(into[k], v)
        else:
            into[k] = copy.deepcopy(v)


def family_of(config: dict, where: str = "config.json") -> tuple[Family, str]:
    try:
        mt = read(config, "model_type", STR_OR_NULL, None)
    except ValueError as exc:
        raise CheckpointError(f"{where}: {exc}") from None
    fam = BY_TYPE.get(mt)
    if fam is None:
        raise CheckpointError(f"{where}: model_type {mt!r} has no importer; specc imports "
                              + ", ".join(sorted(BY_TYPE)))
    archs = config.get("architectures")
    # A string is refused, not taken as a one-element list: transformers (5.24) declares
    # `architectures: list[str] | None` on PretrainedConfig, keeps a string as it is, and its
    # readers index or iterate it (`config.architectures[0]` is then "G"), so Hugging Face does
    # not read "GPT2LMHeadModel" as ["GPT2LMHeadModel"] either.
    if archs is not None and not (type(archs) is list and all(type(a) is str for a in archs)):
        hint = f" (write [{shown(archs)}])" if type(archs) is str else ""
        raise CheckpointError(f"{where}: architectures: expected a list of strings, got {shown(archs)}{hint}")
    arch = archs[0] if archs else next(iter(fam.heads))
    if arch not in fam.heads:
        raise CheckpointError(f"{where}: architectures {arch!r} is not imported for model_type {mt!r}; "
                              f"specc imports " + ", ".join(fam.heads))
    return fam, arch


def config_to_spec(config: dict, tensors: dict, name: str, where: str = "config.json",
                   max_length: int | None = None) -> dict:
    """The spec (plain data) for a checkpoint's config; refuses what specc cannot express. Its
    serving.length.max is the checkpoint's context (position.max_length, from the family's field),
    or `max_length` where given (at most that context)."""
    fam, arch = family_of(config, where)
    for r in fam.refuse:
        value = config.get(r.name, r.default)
        # the type too: 0 == False in Python, but `is_decoder: 0` is not the false it allows
        if not any(type(a) is type(value) and a == value for a in r.allowed):
            why = f" ({r.why})" if r.why else ""
            raise CheckpointError(f"{where}: {r.name} = {shown(value)}: specc cannot express this{why}; "
                                  f"it imports {' or '.join(shown(a) for a in r.allowed)}")
    spec: dict = {"specc": 1, "name": name}
    _merge(spec, fam.fixed)
    for f in fam.fields:
        name = field_name(f, config, where)
        value = config.get(name, f.default)
        if value is MISSING:
            raise CheckpointError(f"{where}: {f.name} is missing (specc's {f.key} comes from it)")
        try:
            if name in config:
                read(config, name, f.kind)  # the type first: "n_embd: expected an integer, got null"
        except ValueError as exc:
            raise CheckpointError(f"{where}: {exc}") from None
        try:
            value = f.convert(value)
        except ValueError as exc:
            raise CheckpointError(f"{where}: {name}: {exc}") from None
        set_key(spec, f.key, value)
    try:
        if fam.extra is not None:
            fam.extra(spec, config)
        spec["outputs"] = fam.heads[arch](config, tensors)
    except ValueError as exc:
        raise CheckpointError(f"{where}: {exc}") from None
    except KeyError as exc:
        raise CheckpointError(f"{where}: {exc.args[0]} is missing") from None
    _check_layers(fam, spec, tensors, where)
    if not any(o["kind"] in ("lm", "mlm") for o in spec["outputs"]):
        spec["vocab"].pop("tie_output", None)  # nothing to tie (BertModel, classifiers)
    _check_tokens(spec, config, where)
    # a max_length below 1 is the spec's to refuse (naming the field, see spec_error); the serving
    # range stays valid so that it is the one complaint
    context = max(spec.get("position", {}).get("max_length", 512), 1)
    if max_length is not None and max_length > context:
        field = ({f.key: f.name for f in fam.fields} | fam.sources).get("position.max_length", "its context")
        raise CheckpointError(f"{where}: --max-length {max_length} is past the checkpoint's context "
                              f"({field} = {context}); at most {context}")
    length = context if max_length is None else max_length
    spec["serving"] = {"length": {"min": 1, "opt": min(128, length), "max": length}}
    return spec


def field_name(f, config: dict, where: str = "config.json") -> str:
    """The name CONFIG gives the field F: its own, or the first of its aliases present (names
    transformers' config class reads as the same attribute); refused where two of them disagree."""
    present = [n for n in (f.name, *f.aliases) if n in config]
    if len({shown(config[n]) for n in present}) > 1:
        a, b = present[:2]
        raise CheckpointError(f"{where}: {a} = {shown(config[a])} and {b} = {shown(config[b])}: transformers reads "
                              "both as one field")
    return present[0] if present else f.name


def _check_layers(fam: Family, spec: dict, tensors: dict, where: str) -> None:
    """Every layer of a family holds several checkpoint tensors, so a layer count above the number
    of tensors is refused here: resolving a spec makes one object per layer, and a hostile
    `n_layer: 1000000000` would fill the memory before any tensor is compared."""
    for f in fam.fields:
        stack, _, last = f.key.partition(".")
        n = spec[stack][last] if last == "layers" else None
        if isinstance(n, int) and n > len(tensors):
            raise CheckpointError(f"{where}: {f.name} = {n}: the checkpoint holds {len(tensors)} tensor(s), "
                                  "fewer than one per layer")


def spec_error(exc: SpecError, fam: Family, config: dict, where: str) -> CheckpointError:
    """The spec the importer made from a config, refused by specc's validation (d_model -4,
    eps NaN, heads that do not divide d_model), as one line against config.json naming the
    config field the refused spec key came from (fam.fields, fam.sources)."""
    sources = {f.key: field_name(f, config, where) for f in fam.fields} | fam.sources
    issues = exc.issues
    first = issues[0]
    for issue in issues:  # prefer an issue that names a config field
        parts = issue.key.split(".") if issue.key else []
        hit = next((".".join(parts[:n]) for n in range(len(parts), 0, -1) if ".".join(parts[:n]) in sources), None)
        hit = hit or (parts[-1] if parts and parts[-1] in sources else None)
        if hit:
            first, field = issue, sources[hit]
            value = f" = {shown(config[field])}" if field in config else ""
            head = f"{field}{value} (specc's {issue.key})"
            break
    else:
        head = f"the spec made from it: {first.key}" if first.key else "the spec made from it"
    more = f" (and {len(issues) - 1} more issue(s))" if len(issues) > 1 else ""
    return CheckpointError(f"{where}: {head}: {first.message}{more}")


def _check_tokens(spec: dict, config: dict, where: str) -> None:
    size = spec["vocab"]["size"]
    target = spec["vocab"].get("target_size") or size
    fields = {"bos": "bos_token_id", "eos": "eos_token_id", "pad": "pad_token_id", "decoder_start": "decoder_start_token_id"}
    for key, value in list(spec.get("tokens", {}).items()):
        if value is None:
            del spec["tokens"][key]
            continue
        if isinstance(value, list):  # several EOS ids (LLaMA 3): specc stops on one
            raise CheckpointError(f"{where}: {fields[key]} = {shown(value)}: specc takes one id per special token")
        limit = target if key == "decoder_start" or spec["architecture"] != "encoder-decoder" else size
        if limit < 1:
            continue  # the spec's validation refuses the size, naming vocab_size
        if not 0 <= value < limit:
            raise CheckpointError(f"{where}: {fields[key]} = {value} is outside the vocabulary (0..{limit - 1})")


# --- tensors -> specc's names -------------------------------------------------------------------


def _transform(t, how: str, where: str, rows: int):
    """Checkpoint tensor T made into a specc parameter by HOW (table.Name.transform); ROWS: the
    parameter's first dimension (where a fused tensor splits unevenly, the part's size). T is a
    list of tensors for a joined candidate (A+B)."""
    if how == "copy":
        return t
    if how == "heads_cat":  # per head, A's rows then B's (DeepSeek's kv_b from a GGUF file's k_b, v_b)
        import torch

        if any(p.dim() != 3 or p.shape[0] != t[0].shape[0] or p.shape[2] != t[0].shape[2] for p in t):
            raise CheckpointError(f"{where}: shapes {[tuple(p.shape) for p in t]} do not join per head")
        return torch.cat(t, dim=1).reshape(-1, t[0].shape[2])
    if how.startswith("mxfp4"):  # gpt-oss's experts as MXFP4 blocks and scales: [E, out, in]
        out = _mxfp4(*t, where)
        return out[:, int(how[10]):: 2] if how.startswith("mxfp4_rows") else out
    if how.startswith("experts_halves"):  # stacked experts' gate and up: [E, 2F, D]
        return t.chunk(2, dim=1)[int(how[14:])]
    if how.startswith("alternate"):  # gpt-oss: gate and up in alternate entries of the last dimension
        part = t[..., int(how[9]):: 2]
        return part.transpose(-1, -2) if how.endswith("_t") else part
    if how == "transpose_last":
        return t.transpose(-1, -2)
    if how == "transpose":  # GPT-2's Conv1D stores [in, out]
        return t.t()
    if how.startswith("qkv"):
        part = int(how[3:])
        if t.dim() == 2:  # Conv1D [D, 3D] -> q, k, v as [D, D] Linear weights
            if t.shape[1] % 3:
                raise CheckpointError(f"{where}: shape {tuple(t.shape)} does not split into q, k, v")
            return t.t().chunk(3, dim=0)[part]
        return t.chunk(3, dim=0)[part]
    if how.startswith("rows_"):  # q, k, v stacked by rows, k and v alike (Phi-3, Falcon): [q; k; v]
        kv = rows if how != "rows_q" else (t.shape[0] - rows) // 2
        start = {"rows_q": 0, "rows_k": t.shape[0] - 2 * kv, "rows_v": t.shape[0] - kv}[how]
        return t[start:start + rows]
    if how.startswith("halves"):  # two matrices stacked by rows (Phi-3's gate_up_proj: gate, then up)
        return t.chunk(2, dim=0)[int(how[6:])]
    if how.startswith("groups_qkv"):
        # q, k, v rows by key-value group: each group's H / Hkv query heads, then its key head and
        # its value head, [Hkv, H / Hkv + 2, d_k, ...] (Falcon; with Hkv = H, q, k, v per head:
        # BLOOM, GPT-NeoX)
        part, heads, kv = (int(v) for v in how[10:].split(":"))
        per = heads // kv + 2
        if heads % kv or t.shape[0] % (kv * per):
            raise CheckpointError(f"{where}: shape {tuple(t.shape)} does not split into {kv} groups of "
                                  f"{heads // kv} query heads, a key head and a value head")
        g = t.reshape(kv, per, t.shape[0] // (kv * per), *t.shape[1:])
        picked = g[:, : per - 2] if part == 0 else g[:, per - 3 + part]
        return picked.reshape(-1, *t.shape[1:])
    if how == "offset2":  # BART's learned positions: position p is row p + 2
        return t[2:]
    raise AssertionError(how)


# a candidate, expanded: its checkpoint names, how they combine (one | stack: one per expert,
# stacked | join: handed to the transform together) and the transform
Candidate = tuple[tuple[str, ...], str, str]


def _candidate(template: str, how: str, i, experts: int) -> Candidate:
    if "{e}" in template:
        return tuple(template.format(i=i, e=e) for e in range(experts)), "stack", how
    parts = tuple(p.format(i=i) for p in template.split("+"))
    return parts, "join" if len(parts) > 1 else "one", how


# the values of an FP4 (E2M1) code, its low nibble first in each byte (the OCP microscaling format)
FP4 = (0.0, 0.5, 1.0, 1.5, 2.0, 3.0, 4.0, 6.0, -0.0, -0.5, -1.0, -1.5, -2.0, -3.0, -4.0, -6.0)


def _mxfp4(blocks, scales, where: str):
    """MXFP4 weights as bfloat16 (exactly: an FP4 value times a power of two has 3 significant
    bits): BLOCKS uint8 [E, R, G, 16], two FP4 codes a byte, SCALES uint8 [E, R, G], each group of
    32 values times 2^(scale - 127); the result [E, R, 32 G]. One expert at a time."""
    import torch

    if blocks.dtype != torch.uint8 or scales.dtype != torch.uint8 or blocks.dim() != 4 or blocks.shape[-1] != 16 \
            or tuple(blocks.shape[:-1]) != tuple(scales.shape):
        raise CheckpointError(f"{where}: MXFP4 blocks {tuple(blocks.shape)} ({blocks.dtype}) and scales "
                              f"{tuple(scales.shape)} ({scales.dtype}) do not go together")
    e, r, g, _ = blocks.shape
    if blocks.device.type == "meta":
        return torch.empty(e, r, g * 32, dtype=torch.bfloat16, device="meta")
    lut = torch.tensor(FP4, dtype=torch.float32)
    out = torch.empty(e, r, g * 32, dtype=torch.bfloat16)
    for x in range(e):
        codes = blocks[x].to(torch.int32)
        values = torch.stack([lut[codes & 15], lut[codes >> 4]], dim=-1).reshape(r, g, 32)
        out[x] = torch.ldexp(values, (scales[x].to(torch.int32) - 127)[..., None]).reshape(r, g * 32)
    return out


def expand(fam: Family, resolved, heads: list[str]) -> dict[str, tuple[Candidate, ...]]:
    """specc name -> its candidates (checkpoint names, how they combine, transform), every
    template expanded ({e}: the layer's routed experts)."""
    stacks = {"encoder": resolved.encoder, "decoder": resolved.decoder}
    counts = {s: len(stack.layers) if stack else 0 for s, stack in stacks.items()}
    heads_of = {s: {"heads": stack.layers[0].attention.heads, "kv_heads": stack.layers[0].attention.kv_heads}
                for s, stack in stacks.items() if stack and hasattr(stack.layers[0].attention, "kv_heads")}

    def experts(stack: str, i) -> int:
        layer = stacks[stack].layers[i] if stack and i is not None else None
        return getattr(layer.ffn, "experts", 0) if layer is not None else 0

    out = {}
    for row in fam.names:
        layers = range(counts[row.stack]) if row.stack else [None]
        for i in layers:
            for head in heads if "{head}" in row.specc else [None]:
                key = row.specc.format(i=i, head=head)
                n = experts(row.stack, i)
                fill = heads_of.get(row.stack, {})
                options = ((c, row.transform) for c in row.hf)
                out.setdefault(key, tuple(_candidate(c, how.format(**fill) if row.stack else how, i, n)
                                          for c, how in (*options, *row.alt)))
    return out


def _gather(get, parts: tuple[str, ...], combine: str):
    """The tensor(s) a candidate names, GET(name) each: one, the experts' stacked, or a list."""
    if combine == "one":
        return get(parts[0])
    if combine == "join":
        return [get(p) for p in parts]
    import torch

    return torch.stack([get(p) for p in parts])


class Converted(Mapping):
    """specc's parameters, each made from its checkpoint tensor(s) when asked for (read, stacked,
    split or transposed), so that they can be written one at a time. `entries`: name -> its dtype
    and shape as a meta tensor, checked before any tensor is read."""

    def __init__(self, tensors, plan: dict[str, Candidate], entries: dict):
        self._tensors, self._plan, self.entries = tensors, plan, entries

    def __getitem__(self, name: str):
        parts, combine, how = self._plan[name]
        t = _gather(self._tensors.__getitem__, parts, combine)
        return _transform(t, how, parts[0], self.entries[name].shape[0]).contiguous()

    def __iter__(self):
        return iter(self._plan)

    def __len__(self) -> int:
        return len(self._plan)


def _meta(tensors, name: str):
    return tensors.meta(name) if hasattr(tensors, "meta") else tensors[name].to("meta")


def convert_tensors(fam: Family, config: dict, tensors, resolved, where: str) -> Converted:
    """specc's parameters from the checkpoint's tensors; every parameter filled, every tensor used.
    Shapes and dtypes are checked from the checkpoint's headers before a tensor is read."""
    shapes = parameter_shapes(resolved)
    table = expand(fam, resolved, [o.name for o in resolved.outputs])
    used: set[str] = set()

    def find(candidates) -> str | None:
        """The first single-tensor candidate present, with its prefix (a tied alias, a head)."""
        for c in candidates:
            for p in fam.prefixes:
                if p + c in tensors:
                    return p + c
        return None

    def locate(candidates: tuple[Candidate, ...]) -> Candidate | None:
        """The first candidate whose first tensor is present (under one of the prefixes); refused,
        naming it, where a later tensor it needs (another expert's, B of A+B) is missing."""
        for parts, combine, how in candidates:
            for p in fam.prefixes:
                if p + parts[0] in tensors:
                    missing = next((p + q for q in parts if p + q not in tensors), None)
                    if missing is not None:
                        raise CheckpointError(f"{where}: the checkpoint has {p + parts[0]} but not {missing}")
                    return tuple(p + q for q in parts), combine, how
        return None

    plan, entries = {}, {}
    for name, shape in shapes.items():
        if name not in table:
            raise CheckpointError(f"{where}: no checkpoint tensor maps to specc's {name} (an importer gap)")
        found = locate(table[name])
        if found is None:
            shown_ = ", ".join("+".join(parts) if combine == "join" else
                               f"{parts[0]} .. {parts[-1]}" if combine == "stack" else parts[0]
                               for parts, combine, _ in table[name])
            raise CheckpointError(f"{where}: the checkpoint has none of {shown_} (for specc's {name})")
        parts, combine, how = found
        metas = [_meta(tensors, q) for q in parts]
        for q, meta in zip(parts, metas):
            if not meta.is_floating_point() and not how.startswith("mxfp4"):  # MXFP4: bytes, checked there
                raise CheckpointError(f"{where}: {q} holds {str(meta.dtype).removeprefix('torch.')}; "
                                      f"specc's {name} is a floating-point parameter")
        src = parts[0]
        try:
            t = _transform(_gather(dict(zip(parts, metas)).__getitem__, parts, combine), how, src,
                           shape[0] if shape else 0)
        except (RuntimeError, IndexError):  # a 0-d or 3-d tensor where a matrix is split or transposed
            t = None
        if t is None or tuple(t.shape) != tuple(shape):
            got = tuple(metas[0].shape) if combine != "join" else [tuple(m.shape) for m in metas]
            many = f" (and {len(parts) - 1} more, one per expert)" if combine == "stack" else ""
            raise CheckpointError(f"{where}: {src}{many} has shape {got}; specc's {name} "
                                  f"needs {tuple(shape)} from this config")
        used.update(parts)
        plan[name], entries[name] = found, t
    out = Converted(tensors, plan, entries)
    _check_leftovers(fam, resolved, table, tensors, out, used, find, where)
    return out


def _check_leftovers(fam, resolved, table, tensors, out, used, find, where) -> None:
    import torch

    # tied copies some checkpoints keep (pytorch_model.bin stores every alias) must equal the table
    tied_aliases = {}
    for name, candidates in table.items():
        if name in out:
            for parts, combine, _ in candidates:
                for p in fam.prefixes:
                    if combine == "one" and p + parts[0] in tensors and p + parts[0] not in used:
                        tied_aliases[p + parts[0]] = name
    for head in ("lm_head.weight", "cls.predictions.decoder.weight"):
        src = find((head,))
        if src and src not in used and "embeddings.tokens.weight" in out:
            role = "embeddings.target_tokens.weight" if "embeddings.target_tokens.weight" in out else "embeddings.tokens.weight"
            tied_aliases[src] = role
    for src, name in tied_aliases.items():
        t, made = tensors[src], out[name]  # each read once: an embedding table can be a GB
        if tuple(t.shape) == tuple(made.shape) and torch.equal(t.to(made.dtype), made):
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
        if t.dim() != 2:
            raise CheckpointError(f"{where}: {src} has shape {tuple(t.shape)}; a sinusoid table is [positions, d_model]")
        want = sinusoidal(torch.arange(t.shape[0])[None], t.shape[1], pos.base, pos.layout)[0]
        if t.shape[1] != resolved.d_model or float((t - want).abs().max()) > 1e-4:
            raise CheckpointError(f"{where}: {src} is not the sinusoid table of d_model {resolved.d_model} "
                                  f"(layout {pos.layout}); specc computes that table and would differ")
        used.add(src)
