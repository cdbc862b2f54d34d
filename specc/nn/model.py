"""The whole model: embeddings, stacks, output heads; forward() speaks the IO signature.

    input_ids --tokens (* sqrt(D))--+ positions (+ types) --norm--> encoder/decoder stack --> heads
                                                                                     |
    outputs: {name: tensor} (+ present.N.key/.value where a cache is used)          <-'
             (latent attention: present.N.latent/.rope_key, spec/io.py)

Parameter names (docs/weights.md) are module paths: embeddings.tokens.weight,
decoder.layers.0.attention.q.weight, heads.logits.proj.weight, ...
"""
from __future__ import annotations

import math

import torch
from torch import nn

from specc.nn.blocks import ACTIVATIONS, Stack, make_norm
from specc.nn.experts import observing_routing
from specc.nn.ops import Dropout
from specc.spec.io import (
    ATTENTION_MASK,
    CROSS,
    ENCODER_ATTENTION_MASK,
    INPUT_IDS,
    LAST_HIDDEN_STATE,
    OWN,
    POSITION_IDS,
    TOKEN_TYPE_IDS,
    is_past,
    is_present,
    layer_pasts,
    layer_presents,
    past_from_caches,
    positions_from_mask,
    present_to_past,
)
from specc.spec.resolve import ResolvedSpec
from specc.spec.schema import GATED_ACTIVATIONS, OutputSpec

Tensor = torch.Tensor


class Embeddings(nn.Module):
    """tokens [V, D]; target_tokens [V_target, D] (encoder-decoder with share: false);
    types [type_size, D] (token types)."""

    def __init__(self, r: ResolvedSpec):
        super().__init__()
        v = r.vocab
        self.tokens = nn.Embedding(v.size, r.d_model)
        separate = r.architecture == "encoder-decoder" and not v.share
        self.target_tokens = nn.Embedding(r.target_vocab_size, r.d_model) if separate else None
        self.types = nn.Embedding(v.type_size, r.d_model) if v.type_size else None
        self.scale = math.sqrt(r.d_model) if v.scale == "sqrt_d_model" else 1.0

    def table(self, role: str) -> nn.Embedding:
        return self.target_tokens if role == "decoder" and self.target_tokens is not None else self.tokens

    def lookup(self, ids: Tensor, role: str) -> Tensor:
        x = self.table(role)(ids)
        return x * self.scale if self.scale != 1.0 else x


class Head(nn.Module):
    """One output. hidden: the stack's last hidden state. lm: proj [V, D] (absent when tied), with
    `bias`: proj's bias [V] (bias [V] when tied).
    mlm (BERT): transform [D, D] + activation + norm, proj [V, D] (absent when tied), bias [V].
    classifier: pool (first | mean | last), pooler [D, D] + tanh (optional), proj [classes, D].
    pooled: the classifier without its proj (Hugging Face's pooler_output); pool may also be max,
    and `normalize` scales the result to unit length.
    token_classifier: proj [classes, D]."""

    def __init__(self, out: OutputSpec, r: ResolvedSpec, vocab: int, tied: bool, activation: str):
        super().__init__()
        self.kind = out.kind
        d = r.d_model
        self.pool = getattr(out, "pool", None)
        self.normalize = getattr(out, "normalize", False)  # a pooled output's
        self.pooler = None
        self.proj = None
        self.bias = None  # mlm's, or a tied lm head's with `bias`
        # a tied head's projection where it is not the embedding table itself: the table as an
        # integer build's graph multiplies by it (quantize.dequantize_linears), for its reference;
        # a buffer (not saved), so that releasing the module's tensors frees it too
        self.register_buffer("tied_projection", None, persistent=False)
        self.softcap = getattr(out, "softcap", None)  # an lm head's
        self.scale = getattr(out, "scale", None) if out.kind == "lm" else None
        lm_bias = out.kind == "lm" and out.bias
        if out.kind in ("lm", "mlm") and not tied:
            self.proj = nn.Linear(d, vocab, bias=lm_bias)
        if lm_bias and tied:
            self.bias = nn.Parameter(torch.zeros(vocab))
        if out.kind == "mlm":
            self.transform = nn.Linear(d, d)
            self.act = ACTIVATIONS[activation]
            self.norm = make_norm(r.norm, d)
            self.bias = nn.Parameter(torch.zeros(vocab))
        if out.kind in ("classifier", "pooled"):
            self.pooler = nn.Linear(d, d) if out.pooler == "tanh" else None
        if out.kind in ("classifier", "token_classifier"):
            self.proj = nn.Linear(d, out.classes)
            self.drop = Dropout(r.dropout.hidden)

    @property
    def pooled_linears(self) -> list[nn.Linear]:
        """The Linear layers applied to a pooled [B, D] row (the exporter writes them as Gemm,
        which an integer build leaves in fp32) rather than to every token (MatMul)."""
        if self.kind not in ("classifier", "pooled"):
            return []
        return [m for m in (self.pooler, self.proj) if isinstance(m, nn.Linear)]

    def forward(self, h: Tensor, tied_weight: Tensor, mask: Tensor) -> Tensor:
        """h [B,T,D]; tied_weight [V,D]: the embedding table; mask [B,T]: 1 for real tokens."""
        if self.kind == "hidden":
            return h
        if self.kind in ("lm", "mlm"):
            if self.kind == "mlm":
                h = self.norm(self.act(self.transform(h)))
            if self.scale is not None:
                h = h * self.scale
            if self.proj is not None:
                logits = self.proj(h)
            else:
                logits = h @ (tied_weight if self.tied_projection is None else self.tied_projection).t()
            if self.bias is not None:
                logits = logits + self.bias
            return logits if self.softcap is None else torch.tanh(logits / self.softcap) * self.softcap
        if self.kind in ("classifier", "pooled"):
            h = self._pool(h, mask)
            if self.pooler is not None:
                h = torch.tanh(self.pooler(h))
            if self.kind == "pooled":
                # sentence-transformers' Normalize: x / max(||x||, 1e-12)
                return torch.nn.functional.normalize(h, p=2.0, dim=-1) if self.normalize else h
        return self.proj(self.drop(h))

    def _pool(self, h: Tensor, mask: Tensor) -> Tensor:
        if self.pool == "first":
            return h[:, 0]
        m = mask.to(h.dtype).unsqueeze(-1)  # [B,T,1]
        if self.pool == "mean":
            return (h * m).sum(1) / m.sum(1).clamp(min=1.0)
        if self.pool == "max":  # padding at -1e9, as sentence-transformers' max pooling sets it
            return torch.where(m > 0, h, torch.full_like(h, -1e9)).amax(1)
        # last real token of each row (right or left padding)
        idx = (mask * torch.arange(mask.shape[1], device=mask.device)).argmax(dim=1)  # [B]
        return h[torch.arange(h.shape[0], device=h.device), idx]


def _causal(p: int, t: int, device) -> tuple[Tensor, Tensor]:
    """Sequence indices of T new queries after P cached tokens, and the causal mask [1,1,T,P+T]."""
    q_idx = torch.arange(t, device=device) + p
    k_idx = torch.arange(p + t, device=device)
    return q_idx, (q_idx[:, None] >= k_idx[None, :])[None, None]


class SpeccModel(nn.Module):
    """forward(**inputs) takes the tensors named by the IO signature and returns a dict keyed by
    output name, plus `present.*` where a cache is used (past given, or use_cache=True).

    encoder:         forward(input_ids, attention_mask=None, token_type_ids=None)
    decoder:         forward(input_ids, attention_mask=None, position_ids=None, token_type_ids=None,
                             past_key_values.N.key / .value, use_cache=False)
    encoder-decoder: forward(input_ids, attention_mask, decoder_input_ids, ...) runs both stacks;
                     encode(...) and decode(...) are the two exported graphs.
    """

    def __init__(self, r: ResolvedSpec):
        super().__init__()
        self.resolved = r
        self.embeddings = Embeddings(r)
        self.encoder = Stack(r.encoder, r) if r.encoder is not None else None
        self.decoder = Stack(r.decoder, r) if r.decoder is not None else None
        top = r.decoder or r.encoder
        # the mlm transform uses the FFN's activation (BERT: gelu), ungated
        activation = top.layers[0].ffn.activation
        activation = GATED_ACTIVATIONS.get(activation, activation)
        self.heads = nn.ModuleDict({o.name: Head(o, r, r.output_vocab_size, r.tie_output, activation) for o in r.outputs})

    # --- helpers ---------------------------------------------------------------------------

    def _outputs(self, h: Tensor, mask: Tensor, role: str) -> dict[str, Tensor]:
        tied = self.embeddings.table(role).weight
        return {name: head(h, tied, mask) for name, head in self.heads.items()}

    @staticmethod
    def _check(inputs: dict, allowed: set[str], graph: str) -> None:
        unknown = sorted(k for k in inputs if k not in allowed and not is_past(k))
        if unknown:
            raise TypeError(f"unexpected input(s) {unknown} for the {graph} graph; expected {sorted(allowed)}")

    def _types(self, inputs: dict) -> Tensor | None:
        ids = inputs.get(TOKEN_TYPE_IDS)
        if self.embeddings.types is None:
            return None
        if ids is None:
            ids = torch.zeros_like(inputs[INPUT_IDS])
        return self.embeddings.types(ids)

    # --- graphs ----------------------------------------------------------------------------

    def _run_encoder(self, inputs: dict) -> tuple[Tensor, Tensor]:
        ids = inputs[INPUT_IDS]
        b, t = ids.shape
        mask = inputs.get(ATTENTION_MASK)
        mask = torch.ones_like(ids) if mask is None else mask
        position_ids = torch.arange(t, device=ids.device).unsqueeze(0).expand(b, t)
        x = self.encoder.embed(self.embeddings.lookup(ids, "encoder"), position_ids, self._types(inputs))
        allowed = mask.bool()[:, None, None, :]  # [B,1,1,S]: padding keys
        q_idx = torch.arange(t, device=ids.device)
        h, _, _ = self.encoder(x, allowed, q_idx, position_ids)
        return h, mask

    @staticmethod
    def routing():
        """A context in which this thread's forward passes record their routers' choice values,
        routed layer by routed layer (specc.nn.experts.observing_routing): verification's."""
        return observing_routing()

    def encode(self, **inputs: Tensor) -> dict[str, Tensor]:
        """The encoder graph. For an encoder-decoder: last_hidden_state and the cross-attention
        K/V of every decoder layer (present.N.encoder.key / .value)."""
        self._check(inputs, {INPUT_IDS, ATTENTION_MASK, TOKEN_TYPE_IDS}, "encoder")
        h, mask = self._run_encoder(inputs)
        if self.decoder is None:
            return self._outputs(h, mask, "encoder")
        cross = [layer.cross_attention.memory_kv(h) for layer in self.decoder.layers]
        return {LAST_HIDDEN_STATE: h, **layer_presents(cross, CROSS)}

    def decode(self, **inputs: Tensor) -> dict[str, Tensor]:
        """The decoder graph (encoder-decoder and decoder-only).

        encoder-decoder: input_ids, encoder_attention_mask, past_key_values.N.decoder.* and
        past_key_values.N.encoder.* (or encoder_hidden_states instead of the encoder K/V)."""
        if self.encoder is None:
            return self._decode_only(inputs)
        self._check(inputs, {INPUT_IDS, ENCODER_ATTENTION_MASK, "encoder_hidden_states", "use_cache"}, "decoder")
        use_cache = bool(inputs.get("use_cache", True))
        ids = inputs[INPUT_IDS]
        b, t = ids.shape
        n = len(self.decoder.layers)
        past, cross = layer_pasts(inputs, n, OWN, self.resolved.cache_pair), layer_pasts(inputs, n, CROSS)
        memory = inputs.get("encoder_hidden_states")
        if cross is None and memory is None:
            raise TypeError("decode() needs past_key_values.N.encoder.* or encoder_hidden_states")
        enc_mask = inputs.get(ENCODER_ATTENTION_MASK)
        if enc_mask is None:
            s_enc = cross[0][0].shape[2] if cross is not None else memory.shape[1]
            enc_mask = torch.ones(b, s_enc, dtype=torch.int64, device=ids.device)
        p = past[0][0].shape[2] if past is not None else 0
        q_idx, allowed = _causal(p, t, ids.device)
        position_ids = q_idx.unsqueeze(0).expand(b, t)
        x = self.decoder.embed(self.embeddings.lookup(ids, "decoder"), position_ids, None)
        h, presents, cross_presents = self.decoder(
            x, allowed, q_idx, position_ids, past=past, memory=memory,
            memory_allowed=enc_mask.bool()[:, None, None, :], cross_past=cross, memory_keep=enc_mask.bool(),
        )
        out = self._outputs(h, torch.ones_like(ids), "decoder")
        if use_cache:
            out.update(layer_presents(presents, OWN, self.resolved.cache_pair))
            if cross is None:
                out.update(layer_presents(cross_presents, CROSS))
        return out

    def _past_length(self, past: list | None) -> int:
        """Positions before this call, from the caches alone (no attention_mask given; spec/io.py).
        The windows come from the resolved spec, never from the layers: a streamed model makes a
        layer each time one is reached (specc/nn/streamed.py)."""
        if past is None:
            return 0
        windows = self.resolved.cache_windows
        p = past_from_caches((kv[0].shape[2], w) for kv, w in zip(past, windows))
        if p is None:
            raise TypeError(f"every layer keeps a window cache (of at most {windows[0]} positions), so a past "
                            f"of {past[0][0].shape[2]} does not say how long the sequence is; give attention_mask")
        return p

    def _decode_only(self, inputs: dict) -> dict[str, Tensor]:
        self._check(inputs, {INPUT_IDS, ATTENTION_MASK, POSITION_IDS, TOKEN_TYPE_IDS, "use_cache"}, "decoder")
        ids = inputs[INPUT_IDS]
        b, t = ids.shape
        past = layer_pasts(inputs, len(self.decoder.layers), pair=self.resolved.cache_pair)
        use_cache = bool(inputs.get("use_cache", past is not None))
        mask = inputs.get(ATTENTION_MASK)
        # a model with window caches reads the past's length off the mask (its caches may be cut);
        # the others off the cache, as their graphs always have
        windowed = any(self.resolved.cache_windows)
        p = mask.shape[1] - t if mask is not None and windowed else self._past_length(past)
        if mask is None:
            mask = torch.ones(b, p + t, dtype=torch.int64, device=ids.device)
        position_ids = inputs.get(POSITION_IDS)
        if position_ids is None:
            # positions count real tokens only, so left-padded rows start at 0 (as HF does)
            position_ids = positions_from_mask(mask, t)
        q_idx, causal = _causal(p, t, ids.device)
        allowed = mask.bool()[:, None, None, :] & causal
        x = self.decoder.embed(self.embeddings.lookup(ids, "decoder"), position_ids, self._types(inputs))
        h, presents, _ = self.decoder(x, allowed, q_idx, position_ids, past=past)
        out = self._outputs(h, mask[:, -t:], "decoder")
        if use_cache:
            out.update(layer_presents(presents, pair=self.resolved.cache_pair))
        return out

    def forward(self, **inputs: Tensor) -> dict[str, Tensor]:
        arch = self.resolved.architecture
        if arch == "encoder":
            return self.encode(**inputs)
        if arch == "decoder":
            return self._decode_only(inputs)
        if "decoder_input_ids" not in inputs:
            raise TypeError("an encoder-decoder's forward() takes input_ids, attention_mask and decoder_input_ids "
                            "(or call encode() / decode() for one graph)")
        use_cache = bool(inputs.pop("use_cache", False))
        dec_ids = inputs.pop("decoder_input_ids")
        enc = self.encode(**inputs)
        dec_inputs = {INPUT_IDS: dec_ids, "use_cache": use_cache}
        if ATTENTION_MASK in inputs:
            dec_inputs[ENCODER_ATTENTION_MASK] = inputs[ATTENTION_MASK]
        dec_inputs.update(present_to_past(enc))
        out = self.decode(**dec_inputs)
        if use_cache:
            out.update({k: v for k, v in enc.items() if is_present(k)})
        return out
