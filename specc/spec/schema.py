"""The v1 spec language as pydantic v2 models.

Pure data: this package never imports torch, onnx or onnxruntime (tests/spec/test_purity.py).
Every model is frozen and forbids unknown keys; choices with their own fields are discriminated
unions on ``kind``. Structural checks (types, ranges, required keys) live here; the rules that
relate several fields live in ``rules.py`` so that every violation in a file is reported at once.
"""
from __future__ import annotations

from typing import Annotated, Any, ClassVar, Literal, Union

from pydantic import (
    BaseModel,
    ConfigDict,
    Field,
    PrivateAttr,
    SerializationInfo,
    SerializerFunctionWrapHandler,
    WithJsonSchema,
    field_validator,
    model_serializer,
    model_validator,
)

from specc.spec.targets import PrecisionName

NAME_PATTERN = r"^[a-z0-9][a-z0-9._-]*$"
# Output names become ONNX output names and file-name parts: no separators, no dots.
OUTPUT_NAME_PATTERN = r"^[A-Za-z_][A-Za-z0-9_]*$"

PosInt = Annotated[int, Field(ge=1)]
# A stack's depth: the deepest published Transformers have a few hundred layers; beyond this a
# number is a typo, and every per-layer structure (the resolved spec, the graph, the cache) would
# grow with it before anything could refuse it.
MAX_LAYERS = 4096
NonNegInt = Annotated[int, Field(ge=0)]


# model_dump(context=EVERY_KEY) writes the keys of QUIET at their defaults too (`specc diff`)
EVERY_KEY = {"every_key": True}


class Node(BaseModel):
    """Base of every spec model: frozen, unknown keys forbidden.

    `quiet`: keys added to the language after specs were written and built, each with the value
    it is left out of a dump at (its default: what every spec written before it means). A spec
    that does not use such a key dumps, resolves (`specc resolve`) and hashes (a build's cache
    key) as it did before the key existed; one that uses it shows it. Loading fills it back in,
    so the round trip is exact."""

    # strict: a string is not a number, `yes` is not true; infinities and NaN are not values
    model_config = ConfigDict(frozen=True, extra="forbid", populate_by_name=True, strict=True, allow_inf_nan=False)
    quiet: ClassVar[dict[str, Any]] = {}

    @model_serializer(mode="wrap")
    def _leave_out_quiet_defaults(self, handler: SerializerFunctionWrapHandler, info: SerializationInfo) -> Any:
        data = handler(self)
        if self.quiet and isinstance(data, dict) and not (info.context or {}).get("every_key"):
            for key, default in self.quiet.items():
                if key in data and getattr(self, key) == default:
                    del data[key]
        return data


class KindNode(Node):
    """A member of a union keyed by ``kind``. A key that belongs to another kind may be written
    with the value null (the language doc's template lists every key); with a value it is an error."""

    @model_validator(mode="before")
    @classmethod
    def _drop_null_foreign_keys(cls, data: Any) -> Any:
        if isinstance(data, dict):
            known = set(cls.model_fields) | {f.alias for f in cls.model_fields.values() if f.alias}
            data = {k: v for k, v in data.items() if k in known or v is not None}
        return data


def _default_kind(value: Any, kind: str) -> Any:
    if isinstance(value, dict) and "kind" not in value:
        return {"kind": kind, **value}
    return value


# --- vocabulary and embeddings ---------------------------------------------------------------


class VocabSpec(Node):
    size: PosInt
    target_size: PosInt | None = None
    type_size: NonNegInt = 0
    share: bool = True
    # Default: tie wherever an lm / mlm output exists. Written explicitly as true without one,
    # it is an error (rules.py).
    tie_output: bool = True
    scale: Literal["none", "sqrt_d_model"] = "none"
    norm: bool = False


# --- positions ------------------------------------------------------------------------------


class _PositionBase(KindNode):
    max_length: PosInt = 512


class SinusoidalPosition(_PositionBase):
    """layout: interleaved = sin on even dims, cos on odd (Vaswani et al.); halves = all sines,
    then all cosines, the same frequencies (tensor2tensor, Marian, Pegasus)."""

    kind: Literal["sinusoidal"] = "sinusoidal"
    base: Annotated[float, Field(gt=1.0)] = 10000.0
    layout: Literal["interleaved", "halves"] = "interleaved"


class LearnedPosition(_PositionBase):
    kind: Literal["learned"] = "learned"


class RelativePosition(_PositionBase):
    """Shaw et al. 2018: clipped relative distance, key (and optionally value) embeddings."""

    kind: Literal["relative"] = "relative"
    clip: PosInt = 16
    values: bool = True


# Rotary scaling: the inverse frequencies f_i = base^(-2i/R) of the R rotated dims changed to reach
# past the length a model was trained at (its `original_max_length`, L). Frequencies are computed
# once in fp32 (specc/nn/positions.py). Reference: transformers' modeling_rope_utils.


class NoScaling(KindNode):
    """The frequencies as the base gives them (RoFormer, Su et al. 2021)."""

    kind: Literal["none"] = "none"


ScalingFactor = Annotated[float, Field(ge=1.0)]


class LinearScaling(KindNode):
    """Position interpolation (Chen et al. 2023, arXiv:2306.15595): every frequency divided by
    `factor`, so position p turns as p / factor did (transformers' rope_type linear; Gemma 3's
    global layers, factor 8)."""

    kind: Literal["linear"] = "linear"
    factor: ScalingFactor


class Llama3Scaling(KindNode):
    """Llama 3.1's frequency-dependent scaling (Meta's model card and reference code; transformers'
    rope_type llama3): with wavelength w = 2 pi / f_i and L = `original_max_length`, frequencies with
    w < L / high_freq_factor are kept, those with w > L / low_freq_factor divided by `factor`, and
    those between blended: (1 - s) f_i / factor + s f_i, s = (L / w - low_freq_factor) /
    (high_freq_factor - low_freq_factor). Llama 3.1: factor 8, 1, 4, L 8192."""

    kind: Literal["llama3"] = "llama3"
    factor: ScalingFactor
    low_freq_factor: Annotated[float, Field(gt=0.0)] = 1.0
    high_freq_factor: Annotated[float, Field(gt=0.0)] = 4.0
    original_max_length: PosInt


class YarnScaling(KindNode):
    """YaRN (Peng et al. 2023, arXiv:2309.00071, sections 3.2 and 3.4): "NTK-by-parts"
    interpolation, pair i's frequency blended from f_i (kept) to f_i / factor (interpolated) by a
    linear ramp over the pair index between d(beta_fast) and d(beta_slow), d(r) = R ln(L / (2 pi r))
    / (2 ln base) the pair that turns r times in L = `original_max_length` (`truncate`: the bounds
    rounded down and up); cos and sin multiplied by `attention_factor` (null: 0.1 ln(factor) + 1, the
    paper's sqrt(1/t)). Qwen2.5's long-context form is factor 4, L 32768."""

    kind: Literal["yarn"] = "yarn"
    factor: ScalingFactor
    original_max_length: PosInt
    beta_fast: Annotated[float, Field(gt=0.0)] = 32.0
    beta_slow: Annotated[float, Field(gt=0.0)] = 1.0
    attention_factor: Annotated[float, Field(gt=0.0)] | None = None
    truncate: bool = True


class LongRopeScaling(KindNode):
    """LongRoPE (Ding et al. 2024, arXiv:2402.13753; Phi-3's rope_scaling longrope): pair i's
    frequency divided by `short_factor[i]` while the sequence (the largest position id + 1, over
    the batch) is at most `original_max_length`, by `long_factor[i]` beyond it: one entry per
    rotated pair (R / 2). Cos and sin are multiplied by `attention_factor` (null: sqrt(1 + ln s /
    ln original_max_length), s = `factor`, or position.max_length / original_max_length where
    null; 1 where s <= 1). The choice is made for each call: keys already cached keep the
    frequencies they were turned with."""

    kind: Literal["longrope"] = "longrope"
    short_factor: Annotated[list[Annotated[float, Field(gt=0.0)]], Field(min_length=1)]
    long_factor: Annotated[list[Annotated[float, Field(gt=0.0)]], Field(min_length=1)]
    original_max_length: PosInt
    factor: ScalingFactor | None = None
    attention_factor: Annotated[float, Field(gt=0.0)] | None = None


RotaryScaling = Annotated[
    Union[NoScaling, LinearScaling, Llama3Scaling, YarnScaling, LongRopeScaling], Field(discriminator="kind")
]


class RotaryPosition(_PositionBase):
    """layout: which dims rotate together: halves = dim i with dim i + R/2 (GPT-NeoX, LLaMA as
    Hugging Face stores it), interleaved = dims 2i and 2i + 1 (RoFormer, GPT-J, llama.cpp).
    scaling: how the frequencies reach past the trained length (the kinds of rotary scaling)."""

    kind: Literal["rotary"] = "rotary"
    base: Annotated[float, Field(gt=1.0)] = 10000.0
    fraction: Annotated[float, Field(gt=0.0, le=1.0)] = 1.0
    layout: Literal["halves", "interleaved"] = "halves"
    scaling: RotaryScaling = NoScaling()


class AlibiPosition(_PositionBase):
    kind: Literal["alibi"] = "alibi"


class BucketedPosition(_PositionBase):
    """Raffel et al. 2020 (T5), section 2.1: a learned scalar per head added to each score, read
    from `buckets` by the key's distance from the query: exact distances below half the buckets,
    then logarithmically wider buckets up to `max_distance`; both directions in an encoder
    (half the buckets each), the past only in a decoder. One table [buckets, heads] per stack,
    shared by its layers' self-attention."""

    kind: Literal["bucketed"] = "bucketed"
    buckets: Annotated[int, Field(ge=4)] = 32
    max_distance: Annotated[int, Field(ge=2)] = 128


class NoPosition(_PositionBase):
    kind: Literal["none"] = "none"


PositionSpec = Annotated[
    Union[SinusoidalPosition, LearnedPosition, RelativePosition, RotaryPosition, AlibiPosition, BucketedPosition,
          NoPosition],
    Field(discriminator="kind"),
]


# --- norms and dropout ----------------------------------------------------------------------


class NormSpec(Node):
    kind: Literal["layernorm", "rmsnorm"] = "layernorm"
    placement: Literal["post", "pre", "sandwich", "sublayer_output"] = "post"
    eps: Annotated[float, Field(gt=0.0, lt=1.0)] = 1.0e-6
    final: Literal["auto"] | bool = "auto"
    unit_offset: bool = False  # rmsnorm's gain is 1 + weight (Gemma), its weight initialised to 0
    bias: bool = True  # layernorm's bias (false: torch.nn.LayerNorm(bias=False)); rmsnorm has none


class DropoutSpec(Node):
    hidden: Annotated[float, Field(ge=0.0, lt=1.0)] = 0.1
    attention: Annotated[float, Field(ge=0.0, lt=1.0)] = 0.1


_RATE = {"type": "number", "minimum": 0.0, "exclusiveMaximum": 1.0}
# `dropout: 0.1` is short for {hidden: 0.1, attention: 0.1}
_DROPOUT_SCHEMA = {
    "anyOf": [
        _RATE,
        {"type": "object", "additionalProperties": False, "properties": {"hidden": _RATE, "attention": _RATE}},
    ],
    "default": 0.1,
}


# --- attention ------------------------------------------------------------------------------


class FullPattern(KindNode):
    kind: Literal["full"] = "full"


class LocalPattern(KindNode):
    """Restricted self-attention: each token sees ``window`` tokens on each side."""

    kind: Literal["local"] = "local"
    window: PosInt


class LinformerPattern(KindNode):
    """Wang et al. 2020: keys and values projected along the sequence to length ``k``."""

    kind: Literal["linformer"] = "linformer"
    k: PosInt


class BigBirdPattern(KindNode):
    """Zaheer et al. 2020: sliding window + global blocks + random blocks, at block granularity
    for the global and random parts. Random blocks are drawn once, from a seed, at resolution."""

    kind: Literal["bigbird"] = "bigbird"
    block: PosInt
    window: PosInt
    global_: Annotated[NonNegInt, Field(alias="global")]
    random: NonNegInt


PatternSpec = Annotated[
    Union[FullPattern, LocalPattern, LinformerPattern, BigBirdPattern], Field(discriminator="kind")
]


class AttentionSpec(KindNode):
    """Multi-head attention (Vaswani et al. 2017), grouped-query and multi-query with fewer
    `kv_heads`."""

    quiet: ClassVar[dict[str, Any]] = {"kind": "multi_head", "sinks": False}
    kind: Literal["multi_head"] = "multi_head"
    heads: PosInt = 8
    kv_heads: PosInt | None = None
    d_k: PosInt | None = None
    d_v: PosInt | None = None
    score: Literal["scaled_dot", "dot", "bilinear", "additive"] = "scaled_dot"
    merge: Literal["project", "concat", "mean"] = "project"
    share_kv: bool = False
    bias: bool = True
    output_bias: bool | None = None  # the output projection's bias; null: as `bias` (Qwen2: q, k, v only)
    qk_norm: Literal["none", "head", "full"] = "none"  # queries and keys normalised (the model's norm kind)
    # scaled_dot's factor on q.k; null: 1/sqrt(d_k) (Gemma 2/3: query_pre_attn_scalar^-1/2)
    scale: Annotated[float, Field(gt=0.0)] | None = None
    # scores capped smoothly: softcap * tanh(scores / softcap), before the mask (Gemma 2)
    softcap: Annotated[float, Field(gt=0.0)] | None = None
    # a learned logit per head that joins each row's softmax and takes no value (gpt-oss)
    sinks: bool = False
    pattern: PatternSpec = FullPattern()

    @field_validator("pattern", mode="before")
    @classmethod
    def _pattern_kind(cls, v: Any) -> Any:
        return _default_kind(v, "full")


class LatentAttentionSpec(KindNode):
    """Multi-head latent attention (DeepSeek-V2, arXiv:2405.04434, section 2.1; DeepSeek-V3,
    arXiv:2412.19437): keys and values come from one compressed latent per token, and the cache
    holds that latent and one rotary key per token, not each head's keys and values."""

    kind: Literal["latent"] = "latent"
    heads: PosInt = 8
    d_k: PosInt  # each head's query / key size, its rotary part (`rope_dims`, the last dims) included
    d_v: PosInt | None = None  # each head's value size; null: d_k
    rope_dims: PosInt  # the last dims of each query and key head, rotated; the key's shared by the heads
    q_rank: PosInt | None = None  # the queries' low rank; null: queries projected from x directly
    kv_rank: PosInt  # the latent's size: what the cache holds per token, with the rotary key
    latent_eps: Annotated[float, Field(gt=0.0, lt=1.0)] = 1.0e-6  # the latent RMSNorms' eps
    bias: bool = False  # the down projections' (q_a, kv_a) biases
    output_bias: bool | None = None  # the output projection's; null: as `bias`
    scale: Annotated[float, Field(gt=0.0)] | None = None  # the factor on q.k; null: 1/sqrt(d_k)
    softcap: Annotated[float, Field(gt=0.0)] | None = None
    sinks: bool = False
    pattern: PatternSpec = FullPattern()

    @field_validator("pattern", mode="before")
    @classmethod
    def _pattern_kind(cls, v: Any) -> Any:
        return _default_kind(v, "full")


AttentionKind = Annotated[Union[AttentionSpec, LatentAttentionSpec], Field(discriminator="kind")]


# the gated activations (act(gate(x)) * up(x), Shazeer 2020) -> the activation they gate with
# (clamped_swiglu, gpt-oss's, a routed expert's only: its own form, specc/nn/ops.py's `gated`)
GATED_ACTIVATIONS = {"swiglu": "silu", "geglu": "gelu", "geglu_tanh": "gelu_tanh", "clamped_swiglu": "silu"}


class FFNSpec(KindNode):
    """One feed-forward network every token passes through: down(act(up(x))), or with a gated
    activation down(act(gate(x)) * up(x))."""

    quiet: ClassVar[dict[str, Any]] = {"kind": "dense"}
    kind: Literal["dense"] = "dense"
    d_ff: PosInt = 2048
    activation: Literal["relu", "gelu", "gelu_tanh", "silu", "swiglu", "geglu", "geglu_tanh"] = "relu"
    bias: bool = True


# --- routed experts -------------------------------------------------------------------------
# A router turns x into one logit per expert (x W_r^T, + a bias with `bias`), chooses top_k experts
# and gives each chosen one a weight; the FFN's output is the weighted sum of the chosen experts'
# outputs (plus the shared expert's). Computed in fp32 (specc/nn/experts.py).

RouterScale = Annotated[float, Field(gt=0.0)]
GroupCount = Annotated[int, Field(ge=1)]


class SoftmaxRouter(KindNode):
    """Softmax over every expert's logit, the top_k highest probabilities chosen and used as the
    weights (Shazeer et al. 2017's gating without its noise; Mixtral and Qwen's MoEs with
    `normalize`, OLMoE, DeepSeek-V2). `normalize`: the chosen weights divided by their sum.
    `groups` / `top_groups`: the experts split into `groups` equal groups, each scored by
    `group_score` (its highest probability: DeepSeek-V2's group_limited_greedy), and the choice
    made among the experts of the best `top_groups` groups only. `scale`: the weights multiplied by
    it (DeepSeek's routed_scaling_factor)."""

    kind: Literal["softmax"] = "softmax"
    normalize: bool = False
    scale: RouterScale = 1.0
    bias: bool = False
    groups: GroupCount | None = None
    top_groups: GroupCount | None = None
    group_score: Literal["max", "top2_sum"] = "max"


class TopKSoftmaxRouter(KindNode):
    """The top_k highest logits chosen, their softmax the weights (Shazeer et al. 2017's
    KeepTopK then softmax; gpt-oss, with `bias`, and GraniteMoE)."""

    kind: Literal["top_k_softmax"] = "top_k_softmax"
    bias: bool = False


class SigmoidRouter(KindNode):
    """A sigmoid score per expert (DeepSeek-V3, arXiv:2412.19437, section 2.1.2): the choice is
    made on the scores plus a learned per-expert bias (`selection_bias`, the auxiliary-loss-free
    balancing bias, e_score_correction_bias) that no weight sees; the weights are the chosen
    experts' scores, divided by their sum (+ 1e-20) with `normalize`, times `scale`. `groups` /
    `top_groups` as the softmax router's; DeepSeek-V3's groups are scored by the sum of their two
    highest biased scores (`top2_sum`)."""

    kind: Literal["sigmoid"] = "sigmoid"
    selection_bias: bool = True
    normalize: bool = False
    scale: RouterScale = 1.0
    bias: bool = False
    groups: GroupCount | None = None
    top_groups: GroupCount | None = None
    group_score: Literal["max", "top2_sum"] = "top2_sum"


class SparseMixerRouter(KindNode):
    """PhiMoE's sparsemixer at inference (Liu et al. 2024, arXiv:2409.12136; transformers'
    phimoe.sparsemixer), for top_k 2: the first expert is the highest logit, weighted by the
    softmax of the logits that lie within 2 x `jitter_eps` of it (relative to max(|logit|, the
    highest)); the second the highest of the others, weighted the same way among them."""

    kind: Literal["sparsemixer"] = "sparsemixer"
    jitter_eps: Annotated[float, Field(gt=0.0, lt=1.0)] = 0.01
    bias: bool = False


RouterSpec = Annotated[
    Union[SoftmaxRouter, TopKSoftmaxRouter, SigmoidRouter, SparseMixerRouter], Field(discriminator="kind")
]


class SharedExpertSpec(Node):
    """An expert every token passes through beside the routed ones, of the routed experts'
    activation and bias: DeepSeek's n_shared_experts as one of d_ff = n x moe_intermediate_size,
    Qwen2-MoE's shared_expert with `gate` (its output multiplied by sigmoid(x w), w [D], its own
    learned gate)."""

    d_ff: PosInt
    gate: bool = False


MAX_EXPERTS = 4096  # the most routed experts of a layer: a few hundred in published models


class ExpertsFFNSpec(KindNode):
    """A mixture of routed experts (Shazeer et al. 2017; Switch Transformer, Fedus et al. 2021):
    `experts` FFNs of `d_ff` each, of which the router chooses `top_k` for each token; optionally a
    `shared` expert every token passes through. `clamped_swiglu` is gpt-oss's activation (its model
    card, arXiv:2508.10925; transformers' GptOssExperts): gate clamped above at `swiglu_limit`, up
    clamped to [-limit, limit], out = (up + 1) * gate * sigmoid(`swiglu_alpha` * gate)."""

    kind: Literal["moe"] = "moe"
    experts: Annotated[int, Field(ge=2, le=MAX_EXPERTS)]
    top_k: PosInt
    d_ff: PosInt  # each routed expert's
    activation: Literal["relu", "gelu", "gelu_tanh", "silu", "swiglu", "geglu", "geglu_tanh",
                        "clamped_swiglu"] = "swiglu"
    swiglu_alpha: Annotated[float, Field(gt=0.0)] | None = None  # clamped_swiglu: gpt-oss 1.702
    swiglu_limit: Annotated[float, Field(gt=0.0)] | None = None  # clamped_swiglu: gpt-oss 7.0
    bias: bool = False  # the experts' (and shared expert's) projections' biases (gpt-oss)
    router: RouterSpec = SoftmaxRouter()
    shared: SharedExpertSpec | None = None

    @field_validator("router", mode="before")
    @classmethod
    def _router_kind(cls, v: Any) -> Any:
        return _default_kind(v, "softmax")


FFNKind = Annotated[Union[FFNSpec, ExpertsFFNSpec], Field(discriminator="kind")]


class LayerOverride(Node):
    """Layers of a stack configured apart from its `attention:` and `ffn:` (Gemma 2 and 3: global
    layers among sliding-window ones; DeepSeek's first dense layers among mixtures of experts):
    those chosen by `every` (layers first, first + every, ...) or by `indices`, with their own
    attention `pattern` and, under rotary positions, `rotary_base` and `rotary_scaling` (in place
    of position.base and position.scaling; Gemma 3's 4B and larger scale their global layers'
    frequencies only, linearly by 8), and their own `ffn` (in place of the stack's, whole)."""

    every: PosInt | None = None
    first: NonNegInt = 0
    indices: list[NonNegInt] | None = None
    pattern: PatternSpec | None = None
    rotary_base: Annotated[float, Field(gt=1.0)] | None = None
    rotary_scaling: RotaryScaling | None = None
    ffn: FFNKind | None = None  # the layers' FFN in place of the stack's (DeepSeek's first dense layers)

    quiet: ClassVar[dict[str, Any]] = {"ffn": None}

    @field_validator("pattern", mode="before")
    @classmethod
    def _pattern_kind(cls, v: Any) -> Any:
        return v if v is None else _default_kind(v, "full")

    @field_validator("ffn", mode="before")
    @classmethod
    def _ffn_kind(cls, v: Any) -> Any:
        return v if v is None else _default_kind(v, "dense")


class StackSpec(Node):
    layers: Annotated[int, Field(ge=1, le=MAX_LAYERS)] = 6
    attention: AttentionKind = AttentionSpec()
    # Only the decoder of an encoder-decoder has cross-attention; null = same as attention.
    cross_attention: AttentionKind | None = None
    ffn: FFNKind = FFNSpec()
    # attention and feed-forward side by side from the layer's input (pre-norm layers): one norm for
    # both (GPT-J, PaLM) or one each (GPT-NeoX); none: one after the other
    parallel: Literal["none", "one_norm", "two_norms"] = "none"
    overrides: list[LayerOverride] = []  # layers that differ from `attention` / `ffn` (LayerOverride)

    @field_validator("attention", "cross_attention", mode="before")
    @classmethod
    def _attention_kind(cls, v: Any) -> Any:
        return v if v is None else _default_kind(v, "multi_head")

    @field_validator("ffn", mode="before")
    @classmethod
    def _ffn_kind(cls, v: Any) -> Any:
        return _default_kind(v, "dense")


# --- outputs --------------------------------------------------------------------------------

OutputName = Annotated[str, Field(pattern=OUTPUT_NAME_PATTERN, max_length=64)]


class HiddenOutput(KindNode):
    kind: Literal["hidden"] = "hidden"
    name: OutputName = "last_hidden_state"


class LMOutput(KindNode):
    """bias: the logits get a bias of their own [V] (GPT-J's lm_head). softcap: the logits
    capped smoothly, softcap * tanh(logits / softcap) (Gemma 2's final_logit_softcapping).
    scale: the hidden states multiplied by it before the projection (T5's tied head: d_model^-1/2)."""

    kind: Literal["lm"] = "lm"
    name: OutputName = "logits"
    bias: bool = False
    softcap: Annotated[float, Field(gt=0.0)] | None = None
    # the hidden states multiplied by this before the projection (T5's tied head: d_model^-1/2)
    scale: Annotated[float, Field(gt=0.0)] | None = None


class MLMOutput(KindNode):
    """BERT's masked-LM head: dense + activation + norm, then the (tied) vocabulary projection."""

    kind: Literal["mlm"] = "mlm"
    name: OutputName = "logits"


class ClassifierOutput(KindNode):
    kind: Literal["classifier"] = "classifier"
    name: OutputName = "logits"
    classes: Annotated[int, Field(ge=1)]
    pool: Literal["first", "mean", "last"] = "first"
    pooler: Literal["tanh"] | None = None


class PooledOutput(KindNode):
    """One vector per sequence (Hugging Face's pooler_output): pool, then the optional
    dense + tanh pooler, no projection, then, with `normalize`, scaled to unit length (L2).
    BERT's pooler is {kind: pooled, pool: first, pooler: tanh}; a sentence-transformers
    embedding {kind: pooled, name: sentence_embedding, pool: mean, normalize: true}. `max`: each
    feature's largest value over the real tokens (the attention mask's ones)."""

    kind: Literal["pooled"] = "pooled"
    name: OutputName = "pooler_output"
    pool: Literal["first", "mean", "last", "max"] = "first"
    pooler: Literal["tanh"] | None = None
    normalize: bool = False


class TokenClassifierOutput(KindNode):
    kind: Literal["token_classifier"] = "token_classifier"
    name: OutputName = "logits"
    classes: Annotated[int, Field(ge=1)]


OutputSpec = Annotated[
    Union[HiddenOutput, LMOutput, MLMOutput, ClassifierOutput, TokenClassifierOutput, PooledOutput],
    Field(discriminator="kind"),
]


# --- tokens, serving ------------------------------------------------------------------------


class TokensSpec(Node):
    bos: NonNegInt | None = None
    eos: NonNegInt | None = None
    pad: NonNegInt | None = None
    decoder_start: NonNegInt | None = None


class RangeSpec(Node):
    min: PosInt
    opt: PosInt
    max: PosInt


class GenerationServingSpec(Node):
    """What `specc serve` decodes at once for its generate endpoint (docs/serving.md, "The
    scheduler"): at most `max_sequences` sequences in one batched decode step (null:
    serving.batch.max; never more), their KV cache at most `max_cache_tokens` positions, counted
    as the cache holds them: rows x the longest row, padding included (null: max_sequences x
    serving.length.max), at most `max_waiting` requests queued for a place (one more is
    answered 503), and at most `prefix_cache_tokens` positions of recent prompts' K/V kept, so
    that a request beginning with one prefills only the rest (null: as many as max_cache_tokens;
    0: no prefix cache). `specc serve` flags override each."""

    max_sequences: PosInt | None = None
    max_cache_tokens: PosInt | None = None
    max_waiting: NonNegInt = 64
    prefix_cache_tokens: NonNegInt | None = None


class ServingSpec(Node):
    """`activations`: what an integer build's weight-only kernels (MatMulNBits, QMoE) compute in
    when the graph decodes a token at a time: fp32 (the input meets the dequantized weights
    unrounded; onnxruntime's accuracy level 1) or int8 (the input rounded to int8 per block, as
    llama.cpp's quantized dot products round it; level 4: faster, a little noisier); null: the
    precision's own (int8 builds int8, int4 and gguf builds fp32; specc/export/quantize.py). A
    graph without a cache (an encoder) and a tied head keep their own."""

    batch: RangeSpec = RangeSpec(min=1, opt=8, max=32)
    length: RangeSpec = RangeSpec(min=1, opt=128, max=512)
    precision: PrecisionName = "fp32"  # the names of specc/spec/targets.py's PRECISIONS
    activations: Literal["fp32", "int8"] | None = None
    generation: GenerationServingSpec = GenerationServingSpec()


# --- the whole model ------------------------------------------------------------------------


class ModelSpec(Node):
    specc: Literal[1]
    name: Annotated[str, Field(pattern=NAME_PATTERN, max_length=128)]
    description: str = ""
    extends: str | None = None
    architecture: Literal["encoder", "decoder", "encoder-decoder"]
    d_model: PosInt
    vocab: VocabSpec
    position: PositionSpec = SinusoidalPosition()
    norm: NormSpec = NormSpec()
    dropout: Annotated[DropoutSpec, WithJsonSchema(_DROPOUT_SCHEMA)] = DropoutSpec()
    encoder: StackSpec | None = None
    decoder: StackSpec | None = None
    outputs: list[OutputSpec] | None = None
    tokens: TokensSpec = TokensSpec()
    weights: str | None = None
    tokenizer: str | None = None
    serving: ServingSpec = ServingSpec()

    # Where the spec came from (set by the loader; not part of the language).
    _path: str | None = PrivateAttr(default=None)
    _weights_path: str | None = PrivateAttr(default=None)
    _tokenizer_path: str | None = PrivateAttr(default=None)

    @field_validator("position", mode="before")
    @classmethod
    def _position_kind(cls, v: Any) -> Any:
        return _default_kind(v, "sinusoidal")

    @field_validator("dropout", mode="before")
    @classmethod
    def _dropout_number(cls, v: Any) -> Any:
        # `dropout: 0.1` is short for {hidden: 0.1, attention: 0.1}
        if isinstance(v, (int, float)) and not isinstance(v, bool):
            return {"hidden": v, "attention": v}
        if not isinstance(v, (dict, DropoutSpec)):
            raise ValueError("dropout is a number in [0, 1) or a mapping {hidden: ..., attention: ...}")
        return v

    @model_validator(mode="after")
    def _rules(self, info) -> "ModelSpec":
        from specc.spec.rules import check_rules  # rules import the schema

        problems = check_rules(self)
        collector = (info.context or {}).get("rule_issues") if info.context is not None else None
        if collector is not None:
            collector.extend(problems)
        elif problems:
            path, message = problems[0]
            raise ValueError(f"{'.'.join(map(str, path))}: {message}")
        return self

    def __eq__(self, other: object) -> bool:
        # equal content is an equal spec, wherever it was loaded from
        return type(other) is type(self) and self.__dict__ == other.__dict__

    def __hash__(self) -> int:
        return hash(self.model_dump_json())

    @property
    def path(self) -> str | None:
        """The file this spec was loaded from, if any."""
        return self._path

    @property
    def weights_path(self) -> str | None:
        """The weights file as an absolute path, relative paths taken from the file that named it."""
        return self._weights_path

    @property
    def tokenizer_path(self) -> str | None:
        """The tokenizer folder as an absolute path, relative paths taken from the file that named it."""
        return self._tokenizer_path
