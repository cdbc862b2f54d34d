"""Norms, feed-forward networks, layers and stacks.

A layer wires each sublayer f (self-attention, cross-attention, FFN) by the norm placement:

    post:      x = Norm(x + drop(f(x)))                 (Vaswani et al. 2017, BERT)
    pre:       x = x + drop(f(Norm(x)))                 (GPT-2, LLaMA)
    sandwich:  x = x + drop(PostNorm(f(Norm(x))))       (Ding et al. 2021, CogView)
    sublayer_output: x = x + drop(Norm(f(x)))           (Swin V2's res-post-norm; OLMo 2)

and, with `parallel` (pre-norm), attention and FFN side by side from the layer's input:

    one_norm:  x = x + drop(Attn(Norm(x))) + drop(FFN(Norm(x)))        (GPT-J; PaLM, Chowdhery et al. 2022)
    two_norms: x = x + drop(Attn(Norm(x))) + drop(FFN(FFNNorm(x)))     (GPT-NeoX, Black et al. 2022)
"""
from __future__ import annotations

import contextlib
import hashlib
import math

import torch
from torch import nn

from specc.nn.attention import KV, Attention
from specc.nn.experts import MoE
from specc.nn.latent import LatentAttention
from specc.nn.norms import RMSNorm, make_norm
from specc.nn.ops import ACTIVATIONS, GATED, Dropout
from specc.nn.positions import distance_buckets, relative_bucket, rotary_cos_sin, sinusoidal
from specc.spec.resolve import ResolvedLayer, ResolvedSpec, ResolvedStack
from specc.spec.schema import FFNSpec


class FFN(nn.Module):
    """up [F,D], down [D,F]; gated activations add gate [F,D]."""

    def __init__(self, spec: FFNSpec, d_model: int):
        super().__init__()
        self.act = ACTIVATIONS[spec.activation]
        self.gate = nn.Linear(d_model, spec.d_ff, bias=spec.bias) if spec.activation in GATED else None
        self.up = nn.Linear(d_model, spec.d_ff, bias=spec.bias)
        self.down = nn.Linear(spec.d_ff, d_model, bias=spec.bias)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        if self.gate is not None:
            return self.down(self.act(self.gate(x)) * self.up(x))
        return self.down(self.act(self.up(x)))


class Layer(nn.Module):
    """Parameters: attention, attention_norm, [cross_attention, cross_attention_norm], ffn,
    ffn_norm (none in one_norm parallel layers: the FFN reads attention_norm's output); sandwich
    placement adds *_post_norm after each sublayer."""

    def __init__(self, layer: ResolvedLayer, r: ResolvedSpec):
        super().__init__()
        d, norm = r.d_model, r.norm
        self.placement = norm.placement
        made = lambda width: make_norm(norm, width)  # noqa: E731  (qk_norm's, the model's kind)
        if layer.attention.kind == "latent":
            self.attention = LatentAttention(layer.attention, d, r.position, r.dropout.attention)
        else:
            self.attention = Attention(layer.attention, d, r.position, r.dropout.attention, made)
        self.attention_norm = make_norm(norm, d)
        self.cross_attention = None
        if layer.cross_attention is not None:
            self.cross_attention = Attention(layer.cross_attention, d, r.position, r.dropout.attention, made)
            self.cross_attention_norm = make_norm(norm, d)
        self.ffn = FFN(layer.ffn, d) if layer.ffn.kind == "dense" else MoE(layer.ffn, d)
        self.parallel = layer.parallel
        if layer.parallel != "one_norm":
            self.ffn_norm = make_norm(norm, d)
        if norm.placement == "sandwich":
            self.attention_post_norm = make_norm(norm, d)
            if self.cross_attention is not None:
                self.cross_attention_post_norm = make_norm(norm, d)
            self.ffn_post_norm = make_norm(norm, d)
        self.drop = Dropout(r.dropout.hidden)

    def _sublayer(self, x: torch.Tensor, name: str, f) -> tuple[torch.Tensor, KV | None]:
        norm = getattr(self, f"{name}_norm")
        if self.placement == "post":
            y, extra = f(x)
            return norm(x + self.drop(y)), extra
        if self.placement == "sublayer_output":
            y, extra = f(x)
            return x + self.drop(norm(y)), extra
        y, extra = f(norm(x))
        if self.placement == "sandwich":
            y = getattr(self, f"{name}_post_norm")(y)
        return x + self.drop(y), extra

    def forward(self, x, allowed, q_idx, rope=None, past=None, memory=None, memory_allowed=None,
                cross_past=None, memory_keep=None, position_bias=None) -> tuple[torch.Tensor, KV, KV | None]:
        if self.parallel != "none":  # pre-norm, no cross-attention (rules.parallel_layers)
            h = self.attention_norm(x)
            y, present = self.attention(h, allowed, q_idx, rope=rope, past=past, position_bias=position_bias)
            f = self.ffn(h if self.parallel == "one_norm" else self.ffn_norm(x))
            return x + self.drop(y) + self.drop(f), present, None
        x, present = self._sublayer(x, "attention", lambda h: self.attention(h, allowed, q_idx, rope=rope, past=past,
                                                                             position_bias=position_bias))
        cross_present = None
        if self.cross_attention is not None:
            x, cross_present = self._sublayer(
                x, "cross_attention",
                lambda h: self.cross_attention(h, memory_allowed, q_idx, past=cross_past, memory=memory, key_keep=memory_keep),
            )
        x, _ = self._sublayer(x, "ffn", lambda h: (self.ffn(h), None))
        return x, present, cross_present


class Stack(nn.Module):
    """An encoder or decoder: positions (learned: `positions` [max_length, D]), `embed_norm`
    (vocab.norm), `layers.N`, `final_norm`. Token embeddings live in the model (they may be shared)."""

    def __init__(self, stack: ResolvedStack, r: ResolvedSpec):
        super().__init__()
        self.r = r
        self.role = stack.role
        d = r.d_model
        self.positions = nn.Embedding(r.position.max_length, d) if r.position.kind == "learned" else None
        # bucketed positions: the stack's [buckets, H] table, and how a distance finds its bucket
        # (exact, thresholds, the upper half's offset: 0 in a decoder, which sees only the past)
        self.relative_bias = self.buckets = None
        if r.position.kind == "bucketed":
            both = not stack.layers[0].attention.causal
            self.relative_bias = nn.Embedding(r.position.buckets, stack.layers[0].attention.heads)
            self.buckets = (*distance_buckets(r.position.buckets, r.position.max_distance, both),
                            r.position.buckets // 2 if both else 0)
        self.embed_norm = make_norm(r.norm, d) if r.vocab.norm else None
        self.layers = nn.ModuleList(Layer(layer, r) for layer in stack.layers)
        self.final_norm = make_norm(r.norm, d) if stack.final_norm else None
        self.drop = Dropout(r.dropout.hidden)

    def embed(self, tokens: torch.Tensor, position_ids: torch.Tensor, types: torch.Tensor | None) -> torch.Tensor:
        """tokens [B,T,D] (already looked up, scaled) + positions (+ types) -> norm -> dropout."""
        x = tokens
        pos = self.r.position
        if pos.kind == "sinusoidal":
            x = x + sinusoidal(position_ids, self.r.d_model, pos.base, pos.layout).to(x.dtype)
        elif pos.kind == "learned":
            x = x + self.positions(position_ids)
        if types is not None:
            x = x + types
        if self.embed_norm is not None:
            x = self.embed_norm(x)
        return self.drop(x)

    def forward(self, x, allowed, q_idx, position_ids, past=None, memory=None, memory_allowed=None,
                cross_past=None, memory_keep=None):
        """Runs the layers. past / cross_past: per-layer (k, v) lists or None.
        Returns hidden [B,T,D], presents, cross presents."""
        ropes = {}  # rotary frequencies -> (cos, sin), made once for the layers that share them (overrides)
        bias = None  # bucketed positions: [1, H, T, S], made once for every layer's self-attention
        if self.relative_bias is not None:
            keys = torch.arange(allowed.shape[-1], device=x.device)
            bias = self.relative_bias(relative_bucket(q_idx, keys, *self.buckets)).permute(2, 0, 1).unsqueeze(0)
        presents, cross_presents = [], []
        for i, layer in enumerate(self.layers):
            freqs = layer.attention.frequencies
            if freqs is not None and freqs not in ropes:
                ropes[freqs] = rotary_cos_sin(position_ids, freqs, x.dtype, layer.attention.interleaved)
            x, present, cross_present = layer(
                x, allowed, q_idx, rope=ropes.get(freqs), position_bias=bias,
                past=past[i] if past is not None else None,
                memory=memory, memory_allowed=memory_allowed,
                cross_past=cross_past[i] if cross_past is not None else None,
                memory_keep=memory_keep,
            )
            presents.append(present)
            cross_presents.append(cross_present)
        if self.final_norm is not None:
            x = self.final_norm(x)
        return x, presents, cross_presents


# what a sublayer adds to the stream
RESIDUAL_OUTPUTS = ("attention.o.weight", "cross_attention.o.weight", "ffn.down.weight", "ffn.experts.down",
                    "ffn.shared.down.weight")


def init_weights(module: nn.Module, seed: int, prefix: str = "", depth: dict[str, int] | None = None) -> None:
    """Seeded initialisation, independent of construction order and of which other parameters
    exist: each parameter is drawn from its own generator, seeded by (seed, its full name:
    `prefix` + its name in `module`), so a layer built alone (a streamed build, specc/nn/streamed.py)
    gets the values it has inside the whole model. Linear and embedding weights ~ N(0, 0.02)
    (GPT-2 / BERT), biases 0, norm weights 1 (and biases 0), bilinear W ~ I + N(0, 0.02),
    linformer E ~ N(0, 1/k). The projections whose output is added to the residual stream
    (RESIDUAL_OUTPUTS) of a stack of N layers (`depth`: {role: N}, the whole model's) ~ N(0,
    0.02 / sqrt(2N)), GPT-2's scaled initialisation (Radford et al. 2019, section 2.3): without it
    a deep random model is chaotic, and an int4 build of a correct 32-layer one misses the
    quality bars (docs/build.md, "Streamed builds")."""
    for name, p in module.named_parameters():
        owner = module.get_submodule(name.rsplit(".", 1)[0]) if "." in name else module
        init_parameter(p, prefix + name, owner, seed, depth)


def init_parameter(p: torch.Tensor, name: str, owner: nn.Module, seed: int, depth: dict[str, int] | None) -> None:
    """One parameter's seeded values (init_weights' rules), in place: `name` is its full name,
    `owner` the module that holds it (a parameter made alone, specc/nn/streamed.py, takes its
    owner's kind from a layer of the same stack)."""
    leaf = name.rsplit(".", 1)[-1]
    gen = torch.Generator().manual_seed(param_seed(seed, name))
    with torch.no_grad():
        if isinstance(owner, (nn.LayerNorm, RMSNorm)):
            p.fill_(1.0 if leaf == "weight" and not getattr(owner, "unit_offset", False) else 0.0)
        elif leaf == "bias" or leaf.endswith("_bias"):  # experts' gate_bias ..., a router's selection_bias
            p.zero_()
        elif leaf in ("proj_k", "proj_v"):
            _randn_into(p, gen).div_(math.sqrt(p.shape[0]))
        elif leaf == "score_w" and p.dim() == 3:
            _randn_into(p, gen).mul_(0.02).add_(torch.eye(p.shape[-1]))
        else:
            _randn_into(p, gen).mul_(0.02 / math.sqrt(2 * _depth(name, depth)) if _residual(name) else 0.02)


def stack_depths(r: ResolvedSpec) -> dict[str, int]:
    """{role: layers} of the spec's stacks: init_weights' `depth`."""
    return {s.role: len(s.layers) for s in (r.encoder, r.decoder) if s is not None}


def _residual(name: str) -> bool:
    parts = name.split(".", 3)
    return len(parts) == 4 and parts[1] == "layers" and parts[3] in RESIDUAL_OUTPUTS


def _depth(name: str, depth: dict[str, int] | None) -> int:
    role = name.split(".", 1)[0]
    if depth is None or role not in depth:
        raise ValueError(f"init_weights: the depth of the {role} stack is needed for {name}")
    return depth[role]


def param_seed(seed: int, name: str) -> int:
    """The seed of the generator a parameter is drawn from: 64 bits of sha256("seed/name")."""
    return int.from_bytes(hashlib.sha256(f"{seed}/{name}".encode()).digest()[:8], "little")


def _randn_into(p: torch.Tensor, gen: torch.Generator) -> torch.Tensor:
    """p's storage filled with N(0, 1) samples from gen, in place (the values torch.randn(p.shape,
    generator=gen) gives, without a second tensor of p's size)."""
    torch.randn(p.shape, generator=gen, out=p.data)
    return p.data


@contextlib.contextmanager
def default_init_skipped():
    """Construct modules without torch's default initialisation of nn.Linear and nn.Embedding
    (kaiming-uniform / normal draws that init_weights overwrites at once, a quarter of a module's
    construction). Their parameters hold whatever memory they were given until init_weights fills
    every one."""
    saved = {cls: cls.reset_parameters for cls in (nn.Linear, nn.Embedding)}
    try:
        for cls in saved:
            cls.reset_parameters = lambda self: None
        yield
    finally:
        for cls, method in saved.items():
            cls.reset_parameters = method
