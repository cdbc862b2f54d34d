"""The IO contract of specc's graphs: the names, symbolic dims and dtypes of a graph's inputs and
outputs, and the rules that connect one call to the next.

    input_ids, attention_mask, [position_ids], [token_type_ids], past_key_values.N[.part].key/.value
        -> graph ->  outputs (lm, hidden, ...), present.N[.part].key/.value
    present.N[.part].*  becomes the next call's  past_key_values.N[.part].*

`part` is "" in a decoder-only model, "decoder" for an encoder-decoder's own (growing) cache and
"encoder" for its cross-attention K/V, which the encoder graph computes once.

A layer of latent attention (DeepSeek's multi-head latent attention) caches, in place of key and
value, its compressed latent and its rotary key, each one per position and shared by every head:
past_key_values.N.latent [batch, 1, past_sequence, kv_rank] and past_key_values.N.rope_key
[batch, 1, past_sequence, rope_dims] (present.N.* alike). `cache_pair` names the two tensors of
an attention kind; every function below that takes a `pair` speaks of either alike.

A decoder-only model's layer whose self-attention slides a window W over the past (pattern
`local`: query t sees keys t-W .. t) keeps a window cache: its past holds the last min(W, P) of
the P positions before the call, its present the last min(W, P + T) after it. Its cache dims are
the windowed forms of past_sequence / total_sequence (`windowed`: "past_sequence_window4" for
W = 4), whose sizes follow from those two (`dim_size`); the attention_mask stays [batch,
total_sequence] over the whole sequence, and such a layer reads its last columns. spec/resolve.py
builds every GraphSig from these names; nn/, export/, runtime/, serving and the benchmarks read
them here and spell none of it themselves.

Torch-free and numpy-free (`specc validate` loads neither). The array helpers take numpy arrays
or torch tensors alike: they use only methods both have.
"""
from __future__ import annotations

from dataclasses import dataclass
from typing import Any, Iterable, Mapping

# symbolic dims; total_sequence = past_sequence + sequence
BATCH, SEQ, PAST, TOTAL, ENC_SEQ = "batch", "sequence", "past_sequence", "total_sequence", "encoder_sequence"

# input names
INPUT_IDS = "input_ids"
ATTENTION_MASK = "attention_mask"
POSITION_IDS = "position_ids"
TOKEN_TYPE_IDS = "token_type_ids"
ENCODER_ATTENTION_MASK = "encoder_attention_mask"
INPUT_NAMES = (INPUT_IDS, ATTENTION_MASK, POSITION_IDS, TOKEN_TYPE_IDS, ENCODER_ATTENTION_MASK)  # no output may take one
# the encoder graph's hidden output, read by nothing but the encoder-decoder's own plumbing
LAST_HIDDEN_STATE = "last_hidden_state"

PAST_PREFIX, PRESENT_PREFIX = "past_key_values", "present"
SELF, OWN, CROSS = "", "decoder", "encoder"  # the cache parts
KEY, VALUE = "key", "value"
LATENT, ROPE_KEY = "latent", "rope_key"  # latent attention's two cache tensors
WHICH = (KEY, VALUE, LATENT, ROPE_KEY)

# the dtype names a signature uses that numpy has under the same name
NUMPY_DTYPES = ("int64", "int32", "float32", "float16")


def main_graph(graphs: Iterable[str]) -> str:
    """The graph a build's outputs come from: an encoder-decoder's decoder, else its model."""
    return "decoder" if "decoder" in graphs else "model"


def lm_output(outputs: Iterable[tuple[str, str]], main_outputs: Iterable[str]) -> str | None:
    """The output generation reads: the first of `outputs` ((name, kind) pairs, as the spec lists
    them) of kind lm that the main graph has (`main_outputs`, its output names); None where none is."""
    names = set(main_outputs)
    return next((name for name, kind in outputs if kind == "lm" and name in names), None)


def float_dtype(precision: str) -> str:
    """The dtype of a graph's float inputs and outputs at a build precision (integer builds keep
    float32 at their edges)."""
    return {"fp16": "float16", "bf16": "bfloat16"}.get(precision, "float32")


def numpy_dtype(name: str) -> str:
    """The numpy dtype name for a signature dtype name (numpy has no bfloat16: float32, as for an
    unknown name). numpy takes the name wherever it takes a dtype; np.dtype(name) is the object."""
    return name if name in NUMPY_DTYPES else "float32"


@dataclass(frozen=True)
class CacheSlot:
    """One cache tensor: layer N, part ("" | "decoder" | "encoder"), key or value (or a latent
    attention's latent or rotary key)."""

    layer: int
    part: str
    which: str

    @property
    def cross(self) -> bool:
        """An encoder-decoder's cross-attention K/V: computed once, never grown."""
        return self.part == CROSS

    def name(self, prefix: str) -> str:
        return f"{prefix}.{self.layer}{'.' + self.part if self.part else ''}.{self.which}"

    @property
    def past(self) -> str:
        return self.name(PAST_PREFIX)

    @property
    def present(self) -> str:
        return self.name(PRESENT_PREFIX)


def cache_pair(attention_kind: str) -> tuple[str, str]:
    """The two cache tensors a layer of this attention kind keeps: key and value, or a latent
    attention's latent and rotary key."""
    return (LATENT, ROPE_KEY) if attention_kind == "latent" else (KEY, VALUE)


def cache_slots(layers: int, part: str = SELF, pair: tuple[str, str] = (KEY, VALUE)) -> list[CacheSlot]:
    """The cache tensors of `layers` layers, in signature order (layer by layer, key then value,
    or latent then rotary key)."""
    return [CacheSlot(i, part, which) for i in range(layers) for which in pair]


def parse_cache(name: str) -> tuple[str, CacheSlot] | None:
    """(prefix, slot) of a past_key_values.* or present.* name; None for any other name."""
    prefix, _, rest = name.partition(".")
    if prefix not in (PAST_PREFIX, PRESENT_PREFIX):
        return None
    fields = rest.split(".")
    if len(fields) not in (2, 3) or not fields[0].isdigit() or fields[-1] not in WHICH:
        return None
    part = fields[1] if len(fields) == 3 else SELF
    if part not in (SELF, OWN, CROSS) or (len(fields) == 3 and part == SELF):
        return None
    return prefix, CacheSlot(int(fields[0]), part, fields[-1])


def is_past(name: str) -> bool:
    parsed = parse_cache(name)
    return parsed is not None and parsed[0] == PAST_PREFIX


def is_present(name: str) -> bool:
    parsed = parse_cache(name)
    return parsed is not None and parsed[0] == PRESENT_PREFIX


def is_growing(name: str) -> bool:
    """A past or present of a cache that grows by one position a step (not cross-attention K/V)."""
    parsed = parse_cache(name)
    return parsed is not None and not parsed[1].cross


def present_to_past(outputs: Mapping[str, Any]) -> dict[str, Any]:
    """A graph's present.* outputs as the next call's past_key_values.* inputs (a decoder's own
    cache, or the encoder's cross-attention K/V for the decoder); other outputs are left out."""
    out = {}
    for name, value in outputs.items():
        parsed = parse_cache(name)
        if parsed is not None and parsed[0] == PRESENT_PREFIX:
            out[parsed[1].past] = value
    return out


def layer_pasts(inputs: Mapping[str, Any], layers: int, part: str = SELF,
                pair: tuple[str, str] = (KEY, VALUE)) -> list[tuple[Any, Any]] | None:
    """Per layer (key, value) from past_key_values.N[.part].* (or the `pair` a latent attention
    keeps), or None where none is given."""
    slots = cache_slots(layers, part, pair)
    if slots[0].past not in inputs:
        return None
    return [(inputs[k.past], inputs[v.past]) for k, v in zip(slots[::2], slots[1::2])]


def layer_presents(pairs: Iterable[tuple[Any, Any]], part: str = SELF,
                   pair: tuple[str, str] = (KEY, VALUE)) -> dict[str, Any]:
    """present.N[.part].key/.value (or the `pair` a latent attention keeps) of per-layer pairs, in
    signature order (the inverse of layer_pasts, on the output side)."""
    pairs = list(pairs)
    slots = cache_slots(len(pairs), part, pair)
    out = {}
    for (key, value), k, v in zip(pairs, slots[::2], slots[1::2]):
        out[k.present], out[v.present] = key, value
    return out


WINDOW_INFIX = "_window"


def windowed(dim: str, window: int) -> str:
    """The cache length dim of a layer that keeps the last `window` positions of `dim` (PAST or
    TOTAL): its size is min(window, size of dim)."""
    return f"{dim}{WINDOW_INFIX}{window}"


def parse_window(dim: int | str) -> tuple[str, int] | None:
    """(the dim it windows, the window) of a `windowed` dim; None for any other dim."""
    if not isinstance(dim, str):
        return None
    base, _, w = dim.rpartition(WINDOW_INFIX)
    if base not in (PAST, TOTAL) or not w.isdigit() or int(w) < 1:
        return None
    return base, int(w)


def cache_window(dims: Iterable[int | str]) -> int | None:
    """The window of a cache tensor with these dims ([batch, heads, length, head_dim]); None for a
    cache that holds the whole sequence."""
    dims = list(dims)
    parsed = parse_window(dims[2]) if len(dims) == 4 else None
    return parsed[1] if parsed else None


def cache_length(dims: Iterable[int | str], total: int) -> int:
    """Positions a present.* with these dims holds after `total` positions in all."""
    window = cache_window(dims)
    return total if window is None else min(window, total)


def past_from_caches(caches: Iterable[tuple[int, int | None]]) -> int | None:
    """Positions before a call, from its growing caches alone, each given as (its length, its
    window or None): a whole-sequence cache's length, or a window cache's while it is shorter than
    its window; None where every cache is at its window (then only the attention_mask says it)."""
    caches = list(caches)
    if not caches:
        return 0
    whole = next((n for n, w in caches if w is None), None)
    if whole is not None:
        return whole
    n, w = caches[0]
    return n if n < w else None


def spare(caches: Iterable[Iterable[int | str]]) -> int:
    """Positions past the sequence's that cache buffers with these dims (a graph's caches) hold:
    1 for an in-place graph with a spare position (SPARE_SEQUENCE), else 0."""
    return int(any(len(d) == 4 and d[2] == SPARE_SEQUENCE for d in map(list, caches)))


def dim_size(dim: str, sizes: Mapping[str, int]) -> int:
    """The size of a symbolic dim: from `sizes`, a windowed dim from the dim it windows where
    `sizes` has no entry of its own (KeyError if neither is there)."""
    if dim in sizes:
        return sizes[dim]
    if dim == SPARE_SEQUENCE and MAX_SEQUENCE in sizes:
        return sizes[MAX_SEQUENCE] + 1
    parsed = parse_window(dim)
    if parsed is None:
        raise KeyError(dim)
    return min(parsed[1], sizes[parsed[0]])


def concrete_dims(dims: Iterable[int | str], sizes: Mapping[str, int]) -> list[int]:
    """A signature's dims with the symbolic ones replaced from `sizes` (KeyError if one is missing;
    windowed dims follow from past_sequence / total_sequence)."""
    return [d if isinstance(d, int) else dim_size(d, sizes) for d in dims]


def empty_cache_dims(dims: Iterable[int | str], batch: int) -> list[int]:
    """The shape of a zero-length growing cache ([batch, heads, 0, head_dim]) for a prompt."""
    return concrete_dims(dims, {BATCH: batch, PAST: 0})


# the in-place cache graph's own inputs (specc/export/inplace.py): per row, the positions in the cache
# after the call minus one; the positions after the call (a scalar); the cache buffers' length dim
SEQLENS_K, TOTAL_SEQUENCE_LENGTH, MAX_SEQUENCE = "seqlens_k", "total_sequence_length", "max_sequence"
# the buffers' length dim of an in-place graph whose attention runs a spare position after each
# call's own (specc/export/inplace.py's `spare`): a buffer for MAX_SEQUENCE positions has one more,
# which each call writes past its own and the next call writes over (dim_size: MAX_SEQUENCE + 1)
SPARE_SEQUENCE = "max_sequence_and_spare"
# its LM output holds each row's last min(sequence, LM_POSITIONS) positions, [batch, LM_POSITIONS_DIM,
# vocab]: a decode step's one, a prompt's last few, and a speculative step's check of up to
# LM_POSITIONS - 1 drafted tokens after the cache (specc/runtime/speculative.py)
LM_POSITIONS, LM_POSITIONS_DIM = 9, "lm_positions"


def positions_from_mask(mask, length: int):
    """Position ids of the last `length` tokens from a [batch, total] 0/1 attention mask: each
    token's count of attended tokens before it, so left padding does not shift positions (padding
    itself gets 0)."""
    return (mask.cumsum(-1) - 1).clip(min=0)[:, -length:]
