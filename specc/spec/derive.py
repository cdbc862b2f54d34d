"""Derived quantities, computed in one place (used by the rules and by resolution)."""
from __future__ import annotations

from specc.spec.schema import AttentionKind, HiddenOutput, LMOutput, ModelSpec


def head_dims(att: AttentionKind, d_model: int) -> tuple[int, int, int]:
    """(d_k, d_v, kv_heads) of an attention spec: d_k defaults to d_model / heads, d_v to d_k,
    kv_heads to heads (latent attention: its keys and values are made for every head). Call only
    where d_model % heads == 0 or d_k is given."""
    d_k = att.d_k if att.d_k is not None else d_model // att.heads
    d_v = att.d_v if att.d_v is not None else d_k
    kv_heads = getattr(att, "kv_heads", None) or att.heads
    return d_k, d_v, kv_heads


def attention_rotary_dims(att: AttentionKind, d_model: int, fraction: float) -> int:
    """The dims of each query / key head that rotate under rotary positions: latent attention's
    `rope_dims` (its last ones), else the first floor(d_k * fraction)."""
    if att.kind == "latent":
        return att.rope_dims
    return rotary_dims(head_dims(att, d_model)[0], fraction)


def rotary_dims(d_k: int, fraction: float) -> int:
    """How many of each head's query/key dims rotate (the first ones): floor(d_k * fraction), the
    product taken to within 1e-9 (a fraction written as r / d_k, GPT-J's rotary_dim over its head
    size, gives back r where binary rounding would land just below it)."""
    return int(d_k * fraction + 1e-9)


def stacks(spec: ModelSpec) -> tuple[str, ...]:
    """The stacks the architecture has, in order."""
    return {"encoder": ("encoder",), "decoder": ("decoder",), "encoder-decoder": ("encoder", "decoder")}[
        spec.architecture
    ]


def tied_kinds() -> tuple[str, ...]:
    """Output kinds whose vocabulary projection can reuse the embedding matrix."""
    return ("lm", "mlm")


def effective_outputs(spec: ModelSpec) -> list:
    """The outputs list, with the language's default where none is given: an lm head for
    anything with a decoder, the last hidden state for encoders."""
    if spec.outputs is not None:
        return list(spec.outputs)
    return [HiddenOutput()] if spec.architecture == "encoder" else [LMOutput()]


def effective_tie(spec: ModelSpec) -> bool:
    """tie_output as it acts: true only where an lm / mlm output exists to tie."""
    has = any(o.kind in tied_kinds() for o in effective_outputs(spec))
    return spec.vocab.tie_output and has


def override_aspects(ov) -> tuple[str, ...]:
    """What a LayerOverride configures: "attention" (its pattern, rotary base or scaling) and / or
    "ffn". Two overrides may choose one layer only for different aspects."""
    att = ov.pattern is not None or ov.rotary_base is not None or ov.rotary_scaling is not None
    return (("attention",) if att else ()) + (("ffn",) if ov.ffn is not None else ())
