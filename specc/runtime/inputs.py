"""The one validation of what a caller gives a built model, shared by Session.run, Session.generate,
`specc run`, `specc generate` and `specc serve`:

    check_feeds(graph, feeds, limits)      named arrays against a graph's IO signature and the
                                           build's limits (Session.run, `specc run`, each request
                                           `specc serve` answers)
    check_generation(limits, ...)          prompts and options of a generation, before anything
                                           is allocated (Session.generate, `specc generate`)
    read_inputs(path, graph, limits)       an --input file (JSON or NPZ), its size or its arrays'
                                           shapes checked before it is read into memory

Limits are the build's facts (BuildInfo and the recorded spec): vocabularies, serving.batch.max,
serving.length.max and the learned-position table. Every refusal is a RunError of one line that
names the input and the offending value or shape; nothing here runs a graph.
"""
from __future__ import annotations

import json
import math
import zipfile
from dataclasses import dataclass
from pathlib import Path
from typing import Any, Mapping

import numpy as np

from specc.decoding.draft import DRAFTERS
from specc.fileio import NotARegularFile, read_bounded, regular_size
from specc.runtime.errors import RunError
from specc.runtime.graph import shape_of
from specc.spec.io import (
    ATTENTION_MASK,
    BATCH,
    ENC_SEQ,
    ENCODER_ATTENTION_MASK,
    INPUT_IDS,
    PAST,
    POSITION_IDS,
    SEQ,
    TOKEN_TYPE_IDS,
    TOTAL,
    is_growing,
    is_past,
    numpy_dtype,
    parse_window,
)
from specc.spec.manifest import BuildInfo, GraphInfo, TensorInfo

DECODER_INPUT_IDS = "decoder_input_ids"  # run()'s name for an encoder-decoder's decoder tokens
MASKS = (ATTENTION_MASK, ENCODER_ATTENTION_MASK)
LENGTH_DIMS = (SEQ, TOTAL, ENC_SEQ, PAST)  # dims bounded by serving.length.max
JSON_BYTES_PER_ELEMENT = 32  # a JSON number with its separator, generously


@dataclass(frozen=True)
class Limits:
    """What a build takes as input: token ids below `vocab` (input_ids of the model or encoder) and
    `target_vocab` (an encoder-decoder's decoder ids), token types below `type_vocab` (0: none),
    at most `batch` rows (serving.batch.max) and `length` positions (serving.length.max), and
    position ids below `positions` where positions are a learned table (else None)."""

    vocab: int
    target_vocab: int
    type_vocab: int
    batch: int
    length: int
    positions: int | None

    @classmethod
    def of(cls, info: BuildInfo) -> Limits:
        """The limits of a build, from its typed manifest."""
        return cls(vocab=info.vocab_size, target_vocab=info.target_vocab_size, type_vocab=info.type_vocab_size,
                   batch=info.batch.max, length=info.length.max, positions=info.learned_positions)

    @property
    def context(self) -> int:
        """The most positions one sequence may hold: serving.length.max, or fewer learned positions."""
        return min(self.length, self.positions) if self.positions is not None else self.length

    def context_source(self) -> str:
        if self.positions is not None and self.positions < self.length:
            return "its learned positions"
        return "serving.length.max"


# --- named inputs against a graph's signature ------------------------------------------------------


def check_feeds(graph: GraphInfo, feeds: Mapping[str, Any], limits: Limits, *, what: str = "the model",
                hint: str = "", rename: Mapping[str, str] | None = None) -> dict[str, Any]:
    """Validate named inputs for one call of `graph` and return them as contiguous arrays in the
    signature's dtypes. `feeds` maps input names to arrays or nested lists (OrtValues, which the
    runtime makes itself, are checked by shape only); inputs the caller leaves out are not
    required here (Session fills their defaults, Graph.run refuses what is still missing).

    Checked, in order: every name is an input of the graph (`what` names the graph and `hint` ends
    the message); rectangular values; integer inputs hold integers (any int or uint dtype, no
    floats or bools) and float inputs floats; the rank and every fixed dim (a cache's heads and
    head_dim); the symbolic dims agree across inputs (batch; sequence; total = past + sequence;
    encoder_sequence; the growing cache given whole or not at all); batch in 1..serving.batch.max,
    sequence and encoder_sequence in 1..serving.length.max, past + sequence at most
    serving.length.max; input_ids in 0..vocab-1 (the decoder graph's: the target vocabulary),
    attention masks 0 or 1, position_ids >= 0 (and below a learned table's size), token_type_ids
    in 0..type_vocab-1. A 1-D input_ids is one row (and so are the other 1-D inputs given with it).

    Raises RunError with one line naming the input (as `rename` maps it, e.g. the decoder's
    input_ids to decoder_input_ids) and the offending value or shape."""
    rename = rename or {}
    sig = {t.name: t for t in graph.inputs}
    unknown = sorted(set(feeds) - set(sig))
    if unknown:
        shown = ", ".join(rename.get(n, n) for n in unknown)
        raise RunError(f"unknown input(s) {shown}; {what} takes {', '.join(sig)}{hint}")
    arrays = {name: _as_array(rename.get(name, name), value) for name, value in feeds.items()}
    arrays = _promote_rows(arrays, sig)
    check_signature(graph, {n: (shape_of(v), getattr(v, "dtype", None) if isinstance(v, np.ndarray) else None)
                            for n, v in arrays.items()}, limits, rename=rename)
    out = {}
    for name, value in arrays.items():
        if not isinstance(value, np.ndarray):  # an OrtValue of the runtime's own
            out[name] = value
            continue
        _check_values(graph, sig[name], rename.get(name, name), value, limits)
        out[name] = np.ascontiguousarray(value, dtype=numpy_dtype(sig[name].dtype))
    return out


def check_signature(graph: GraphInfo, shapes: Mapping[str, tuple[tuple[int, ...], Any]], limits: Limits,
                    *, rename: Mapping[str, str] | None = None) -> None:
    """The shape half of check_feeds, on (shape, dtype or None) per input name: what an NPZ's
    array headers say before the arrays are read. Names must be inputs of the graph."""
    rename = rename or {}
    sig = {t.name: t for t in graph.inputs}
    unknown = sorted(set(shapes) - set(sig))
    if unknown:
        raise RunError(f"unknown input(s) {', '.join(rename.get(n, n) for n in unknown)}; "
                       f"the graph takes {', '.join(sig)}")
    sizes: dict[str, tuple[int, str]] = {}  # symbolic dim -> (size, the input it was read from)
    for name, (shape, dtype) in shapes.items():
        t, shown = sig[name], rename.get(name, name)
        if dtype is not None:
            _check_dtype(t, shown, np.dtype(dtype))
        shape = tuple(int(d) for d in shape)
        if len(shape) != len(t.dims):
            raise RunError(f"{shown}: expected {len(t.dims)} dims {_dims(t.dims)}, got shape {list(shape)}")
        for dim, size in zip(t.dims, shape):
            if isinstance(dim, int):
                if size != dim:
                    raise RunError(f"{shown}: expected shape {_dims(t.dims)}, got {list(shape)}")
                continue
            _check_size(shown, dim, size, shape, limits)
            seen = sizes.get(dim)
            if seen is not None and seen[0] != size:
                raise RunError(f"{shown}: {dim} is {size} (shape {list(shape)}), but {seen[0]} in {seen[1]}")
            sizes.setdefault(dim, (size, shown))
    growing = [n for n in sig if is_past(n) and is_growing(n)]
    given = [n for n in growing if n in shapes]
    if given and len(given) != len(growing):
        missing = [rename.get(n, n) for n in growing if n not in shapes]
        raise RunError(f"{given[0]}: the cache comes whole or not at all; missing {', '.join(missing[:4])}"
                       f"{', ...' if len(missing) > 4 else ''}")
    past = sizes.get(PAST, (0, ""))[0]
    windows = [(dim, parsed[1]) for dim in sizes if (parsed := parse_window(dim)) and parsed[0] == PAST]
    if windows and PAST not in sizes:
        # every layer keeps a window cache: the mask says how long the sequence is
        past = sizes[TOTAL][0] - sizes[SEQ][0] if TOTAL in sizes and SEQ in sizes else min(sizes[d][0] for d, _ in windows)
    for dim, window in windows:
        size, size_from = sizes[dim]
        if size != min(window, past):
            raise RunError(f"{size_from}: a window cache of {size} positions, but it keeps the last "
                           f"min({window}, {past}) = {min(window, past)} of the {past} before this call")
    if SEQ in sizes:
        seq, seq_from = sizes[SEQ]
        if past + seq > limits.length:
            raise RunError(f"{seq_from}: {past} cached + {seq} new positions, more than the build's "
                           f"serving.length.max {limits.length}")
        if TOTAL in sizes and sizes[TOTAL][0] != past + seq:
            total, total_from = sizes[TOTAL]
            raise RunError(f"{total_from}: covers {total} positions, but the cache holds {past} and {seq_from} "
                           f"adds {seq} (expected {past + seq})")


def _as_array(shown: str, value: Any):
    if hasattr(value, "shape") and callable(value.shape):  # an OrtValue
        return value
    try:
        arr = np.asarray(value)
    except ValueError:
        raise RunError(f"{shown}: rows of different lengths; pad them to one length "
                       "(or use generate(), which pads)") from None
    if arr.dtype == object:
        raise RunError(f"{shown}: not a rectangular array of numbers")
    return arr


def _promote_rows(arrays: dict[str, Any], sig: Mapping[str, TensorInfo]) -> dict[str, Any]:
    """A 1-D input_ids is one row: it and the other 1-D two-dim inputs get a batch dim of 1."""
    ids = arrays.get(INPUT_IDS)
    if not isinstance(ids, np.ndarray) or ids.ndim != 1:
        return arrays
    return {n: (v[None, :] if isinstance(v, np.ndarray) and v.ndim == 1 and len(sig[n].dims) == 2 else v)
            for n, v in arrays.items()}


def _dims(dims) -> str:
    return "[" + ", ".join(str(d) for d in dims) + "]"


def _check_dtype(t: TensorInfo, shown: str, dtype: np.dtype) -> None:
    want = np.dtype(numpy_dtype(t.dtype))
    if want.kind in "iu" and dtype.kind not in "iu":
        raise RunError(f"{shown}: expected integers ({t.dtype}), got {dtype}")
    if want.kind == "f" and dtype.kind != "f":
        raise RunError(f"{shown}: expected floats ({t.dtype}), got {dtype}")


def _check_size(shown: str, dim: str, size: int, shape: tuple[int, ...], limits: Limits) -> None:
    if dim == BATCH:
        if size < 1:
            raise RunError(f"{shown}: empty batch (shape {list(shape)})")
        if size > limits.batch:
            raise RunError(f"{shown}: batch of {size}, more than the build's serving.batch.max {limits.batch}")
    elif dim in LENGTH_DIMS or parse_window(dim):
        if size < 1 and dim != PAST and parse_window(dim) is None:
            raise RunError(f"{shown}: empty {dim} (shape {list(shape)}); give at least one token")
        if size > limits.length:
            raise RunError(f"{shown}: {dim} of {size}, more than the build's serving.length.max {limits.length}")


def _check_values(graph: GraphInfo, t: TensorInfo, shown: str, value: np.ndarray, limits: Limits) -> None:
    if value.dtype.kind not in "iu":
        return  # floats: a cache; nothing to range-check
    if t.name == INPUT_IDS:
        vocab = limits.target_vocab if graph.name == "decoder" else limits.vocab
        _in_range(shown, value, 0, vocab, f"outside the vocabulary (0..{vocab - 1})", "token id(s)")
    elif t.name in MASKS:
        bad = np.unique(value[(value != 0) & (value != 1)]).tolist()
        if bad:
            raise RunError(f"{shown}: values must be 0 or 1, got {bad[:5]}")
    elif t.name == POSITION_IDS:
        if limits.positions is not None:
            _in_range(shown, value, 0, limits.positions,
                      f"outside the model's {limits.positions} learned positions (0..{limits.positions - 1})",
                      "position(s)")
        else:
            _in_range(shown, value, 0, None, "negative", "position(s)")
    elif t.name == TOKEN_TYPE_IDS:
        _in_range(shown, value, 0, limits.type_vocab,
                  f"outside the type vocabulary (0..{limits.type_vocab - 1})", "type id(s)")
    info = np.iinfo(numpy_dtype(t.dtype))
    if value.size and (value.max() > info.max or value.min() < info.min):
        raise RunError(f"{shown}: values past {t.dtype} ({int(value.min())}..{int(value.max())})")


def _in_range(shown: str, value: np.ndarray, lo: int, hi: int | None, why: str, what: str) -> None:
    """Refuse values outside lo..hi-1 (hi None: no upper bound), naming up to five of them."""
    outside = value < lo if hi is None else (value < lo) | (value >= hi)
    if outside.any():
        raise RunError(f"{shown}: {what} {np.unique(value[outside])[:5].tolist()} {why}")


# --- generation ---------------------------------------------------------------------------------


def prompt_rows(input_ids, shown: str = INPUT_IDS) -> list[list[int]]:
    """The form of prompts: a list of ids, a list of lists (any lengths) or an int array
    [batch, seq], as rows of ints, each non-empty."""
    if isinstance(input_ids, np.ndarray):
        if input_ids.ndim == 1:
            input_ids = input_ids[None, :]
        if input_ids.ndim != 2 or input_ids.dtype.kind not in "iu":
            raise RunError(f"{shown}: expected an integer array [batch, sequence], got {input_ids.dtype} "
                           f"{list(input_ids.shape)}")
        rows = input_ids.tolist()
    elif isinstance(input_ids, (list, tuple)) and input_ids and all(_is_int(x) for x in input_ids):
        rows = [list(input_ids)]
    elif isinstance(input_ids, (list, tuple)) and input_ids and all(isinstance(r, (list, tuple, np.ndarray))
                                                                    for r in input_ids):
        rows = [list(r) for r in input_ids]
    else:
        raise RunError(f"{shown}: expected a list of ids, a list of lists of ids, or an int array [batch, seq]")
    if any(len(r) == 0 for r in rows):
        raise RunError(f"{shown}: every prompt needs at least one token")
    bad = next((x for r in rows for x in r if not _is_int(x)), None)
    if bad is not None:
        raise RunError(f"{shown}: token ids must be integers, got {bad!r}")
    return [[int(x) for x in r] for r in rows]


def check_prompts(input_ids, limits: Limits, shown: str = INPUT_IDS) -> list[list[int]]:
    """Prompts (prompt_rows' forms) as rows of ints: at most serving.batch.max rows, each of
    1..serving.length.max tokens, every id in the vocabulary."""
    rows = prompt_rows(input_ids, shown)
    if len(rows) > limits.batch:
        raise RunError(f"{shown}: {len(rows)} prompts, more than the build's serving.batch.max {limits.batch}")
    longest = max(len(r) for r in rows)
    if longest > limits.length:
        raise RunError(f"{shown}: a prompt of {longest} tokens, more than the build's serving.length.max {limits.length}")
    bad = sorted({x for r in rows for x in r if not 0 <= x < limits.vocab})
    if bad:
        raise RunError(f"{shown}: token id(s) {bad[:5]} outside the vocabulary (0..{limits.vocab - 1})")
    return rows


def check_generation(limits: Limits, architecture: str, input_ids, max_new_tokens, *, beams=1, temperature=None,
                     top_k=None, top_p=None, seed=None, do_sample=False, length_penalty=0.6, eos_id=None,
                     pad_id=None, speculative=None) -> list[list[int]]:
    """Validate a generation before anything is allocated; returns the prompts as rows of ints.

    Options: max_new_tokens and beams integers >= 1; sampling (temperature finite > 0, top_k >= 1,
    top_p in (0, 1], seed >= 0) or beam search, not both; length_penalty finite; eos_id an integer
    (one outside the vocabulary, e.g. -1, never stops a row); pad_id in the vocabulary. Prompts: check_prompts. Lengths: a decoder's longest prompt plus
    max_new_tokens, an encoder-decoder's decoder start token plus max_new_tokens, within the
    context (serving.length.max, or the learned positions if fewer). Beams: prompts x beams rows
    of those positions within serving.batch.max x serving.length.max. speculative: one of
    decoding/draft.py's DRAFTERS or a draft build's Session, for one prompt of a
    decoder."""
    if not _is_int(max_new_tokens) or max_new_tokens < 1:
        raise RunError(f"max_new_tokens must be at least 1, got {max_new_tokens!r}")
    if not _is_int(beams) or beams < 1:
        raise RunError(f"beams must be at least 1, got {beams!r}")
    sampling = do_sample or temperature is not None or top_k is not None or top_p is not None
    if sampling and beams > 1:
        raise RunError("choose sampling or beam search, not both")
    if temperature is not None and not (_is_number(temperature) and math.isfinite(temperature) and temperature > 0):
        raise RunError(f"temperature must be a finite number > 0 (use greedy decoding for temperature 0), got {temperature!r}")
    if top_p is not None and not (_is_number(top_p) and 0 < top_p <= 1):
        raise RunError(f"top_p must be in (0, 1], got {top_p!r}")
    if top_k is not None and (not _is_int(top_k) or top_k < 1):
        raise RunError(f"top_k must be at least 1, got {top_k!r}")
    if seed is not None and (not _is_int(seed) or seed < 0):
        raise RunError(f"seed must be an integer >= 0, got {seed!r}")
    if not (_is_number(length_penalty) and math.isfinite(length_penalty)):
        raise RunError(f"length_penalty must be a finite number, got {length_penalty!r}")
    out_vocab = limits.target_vocab if architecture == "encoder-decoder" else limits.vocab
    if eos_id is not None and not _is_int(eos_id):  # outside the vocabulary (e.g. -1): no row stops early
        raise RunError(f"eos_id must be an integer, got {eos_id!r}")
    pad_vocab = min(limits.vocab, out_vocab)
    if pad_id is not None and (not _is_int(pad_id) or not 0 <= pad_id < pad_vocab):
        raise RunError(f"pad_id {pad_id!r} outside the vocabulary (0..{pad_vocab - 1})")
    rows = check_prompts(input_ids, limits)
    if speculative is not None:
        _check_speculative(speculative, architecture, len(rows), beams)
    longest = max(len(r) for r in rows)
    context = limits.context
    if architecture == "encoder-decoder":
        if 1 + max_new_tokens > context:
            raise RunError(f"max_new_tokens ({max_new_tokens}) is past the {context} decoder positions the model "
                           f"takes ({limits.context_source()}): at most {context - 1}, after the start token")
        positions = max(longest, 1 + max_new_tokens)
    else:
        if longest + max_new_tokens > context:
            raise RunError(f"prompt ({longest} tokens) + max_new_tokens ({max_new_tokens}) is past the {context} "
                           f"positions the model takes ({limits.context_source()}): at most "
                           f"{max(context - longest, 0)} new tokens")
        positions = longest + max_new_tokens
    budget = limits.batch * limits.length
    if len(rows) * beams * positions > budget:
        raise RunError(f"beams ({beams}): {len(rows)} prompt(s) x {beams} beams x {positions} positions is more "
                       f"than the build's serving.batch.max x serving.length.max ({limits.batch} x "
                       f"{limits.length} = {budget}) positions; use fewer beams")
    return rows


def _check_speculative(speculative, architecture: str, prompts: int, beams) -> None:
    what = f"speculative={speculative!r}"
    model = hasattr(speculative, "graphs") and hasattr(speculative, "info")  # a draft build's Session
    if not model and (not isinstance(speculative, str) or speculative not in DRAFTERS):
        raise RunError(f"{what}: the drafters are {', '.join(DRAFTERS)}, or a draft build's Session")
    if architecture != "decoder":
        raise RunError(f"{what}: speculative decoding runs decoder builds only, this one is an {architecture}")
    if beams != 1:
        raise RunError(f"{what}: speculative decoding does not combine with beam search (beams={beams}); "
                       "drop one of them")
    if prompts != 1:
        raise RunError(f"{what}: speculative decoding takes one prompt at a time, got {prompts}")


def _is_int(x) -> bool:
    return isinstance(x, (int, np.integer)) and not isinstance(x, (bool, np.bool_))


def _is_number(x) -> bool:
    return isinstance(x, (int, float, np.integer, np.floating)) and not isinstance(x, (bool, np.bool_))


# --- input files --------------------------------------------------------------------------------


def max_elements(graph: GraphInfo, limits: Limits) -> int:
    """The most numbers the graph's inputs hold within the build's limits (each dim at its max)."""
    total = 0
    for t in graph.inputs:
        total += math.prod(d if isinstance(d, int) else (limits.batch if d == BATCH else limits.length)
                           for d in t.dims)
    return total


def read_inputs(path: str | Path, graph: GraphInfo, limits: Limits,
                decoder: GraphInfo | None = None) -> list | dict[str, np.ndarray]:
    """An --input file: a JSON list of lists of ids, a JSON object of named inputs, or an NPZ of
    named arrays, for `graph` (an encoder-decoder's encoder, with its `decoder`, whose input_ids
    the file names decoder_input_ids). Nothing larger than the build's limits is read into
    memory: a JSON file may not be longer than max_elements numbers could take, and an NPZ's array
    headers (names, dtypes, shapes) pass check_signature before any array is unpacked. The values
    are checked later, by check_feeds or check_prompts."""
    path = str(path)
    try:
        size = regular_size(path)  # a device or FIFO would be read without end
        if path.endswith(".npz"):
            return _read_npz(path, graph, limits, decoder)
        elements = max_elements(graph, limits) + (limits.batch * limits.length if decoder is not None else 0)
        cap = elements * JSON_BYTES_PER_ELEMENT + 4096
        if size > cap:
            raise RunError(f"{path}: {size} bytes, more than inputs within the build's serving limits take "
                           f"({cap} bytes); refused")
        data = json.loads(read_bounded(path, cap))
    except NotARegularFile as exc:
        raise RunError(str(exc)) from None
    except (OSError, ValueError, zipfile.BadZipFile) as exc:
        raise RunError(f"{path}: cannot read inputs ({exc})") from None
    if isinstance(data, list):
        return data  # rows of ids, padded by the caller
    if isinstance(data, dict) and INPUT_IDS in data:
        return data
    raise RunError(f"{path}: expected a list of lists of token ids or an object with input_ids")


def _read_npz(path: str, graph: GraphInfo, limits: Limits, decoder: GraphInfo | None) -> dict[str, np.ndarray]:
    headers = {}
    with zipfile.ZipFile(path) as z:
        for member in z.infolist():
            if not member.filename.endswith(".npy"):
                raise RunError(f"{path}: {member.filename} is not an array (.npy) in the NPZ")
            name = member.filename[: -len(".npy")]
            with z.open(member) as f:
                version = np.lib.format.read_magic(f)
                read = {(1, 0): np.lib.format.read_array_header_1_0,
                        (2, 0): np.lib.format.read_array_header_2_0}.get(version)
                if read is None:
                    raise RunError(f"{path}: {name}: NPY format version {version} is not supported")
                shape, _, dtype = read(f)
            headers[name] = (shape, dtype)
    if INPUT_IDS not in headers:
        raise RunError(f"{path}: expected an array named input_ids")
    shapes = dict(headers)
    if len(shapes[INPUT_IDS][0]) == 1:  # a 1-D input_ids is one row (as Session.run reads it)
        shapes = {n: ((1, *s), d) if len(s) == 1 else (s, d) for n, (s, d) in shapes.items()}
    for name, (_, dtype) in shapes.items():
        if dtype.hasobject:
            raise RunError(f"{path}: {name}: object arrays are not inputs")
    try:
        if decoder is not None and DECODER_INPUT_IDS in shapes:
            check_signature(decoder, {INPUT_IDS: shapes.pop(DECODER_INPUT_IDS)}, limits,
                            rename={INPUT_IDS: DECODER_INPUT_IDS})
        check_signature(graph, shapes, limits)
    except RunError as exc:
        raise RunError(f"{path}: {exc}") from None
    with np.load(path, allow_pickle=False) as data:
        return {k: data[k] for k in data.files}
