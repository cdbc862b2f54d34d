"""Multi-head attention, every variant of the language in one module.

Shapes: B batch, T new (query) tokens, P cached tokens, S = P + T keys (self) or the source length
(cross), H heads, Hkv key/value heads, Dk / Dv head dims, D d_model.

    x [B,T,D] --q--> [B,H,T,Dk] --rotary--.
    x or memory --k,v--> [B,Hkv,T,Dk|Dv] --rotary(k)--> cat(past) = present --repeat to H--.
                                                                                        v
    scores [B,H,T,S] = score(q, k) (+ Shaw a^K) (scaled) (+ ALiBi) --mask--> softmax (fp32)
                       (sinks: softmax over [scores | s_h], the sink's column dropped after)
    out = probs @ v (+ Shaw a^V)  [B,H,T,Dv] --merge: project (W_o) | concat | mean--> [B,T,D]

Masks are boolean "may attend" [B,1,T,S] from the caller (padding, causal), combined here with the
pattern (local window, BigBird). Masked scores take the dtype's finite minimum, so a row with
nothing to attend to stays finite and the value fits fp16.
"""
from __future__ import annotations

import math

import torch
from torch import nn

from specc.nn.ops import Dropout, cast
from specc.nn.positions import alibi_slopes, apply_rotary, relative_index, rotary_frequencies
from specc.spec.resolve import ResolvedAttention
from specc.spec.schema import PositionSpec

KV = tuple[torch.Tensor, torch.Tensor]


def _bigbird_table(att: ResolvedAttention) -> torch.Tensor:
    """[n_blocks, n_blocks] bool: query block i also sees key block j (random blocks)."""
    n = len(att.random_blocks)
    table = torch.zeros(n, n, dtype=torch.bool)
    for i, row in enumerate(att.random_blocks):
        for j in row:
            table[i, j] = True
    return table


class Attention(nn.Module):
    """Parameters: q, k, v (absent with share_kv: k serves both), o (merge: project),
    score_w (bilinear [H,Dk,Dk]; additive [H,Dk]), rel_k / rel_v (relative positions, per layer),
    proj_k / proj_v (linformer [k, max_length], shared by the heads), q_norm / k_norm (qk_norm:
    made by `norm(width)`, the model's norm; over each head's Dk, or over all heads' at once),
    sinks [H] (sinks: a logit per head that joins each row's softmax and takes no value, gpt-oss).
    With share_kv, k_norm normalises the keys only (the values are k's projection as it was)."""

    def __init__(self, spec: ResolvedAttention, d_model: int, position: PositionSpec, dropout: float, norm=None):
        super().__init__()
        self.spec = spec
        h, hkv, dk, dv = spec.heads, spec.kv_heads, spec.d_k, spec.d_v
        self.q_norm = self.k_norm = None
        if spec.qk_norm != "none":
            self.q_norm = norm(dk if spec.qk_norm == "head" else h * dk)
            self.k_norm = norm(dk if spec.qk_norm == "head" else hkv * dk)
        self.q = nn.Linear(d_model, h * dk, bias=spec.bias)
        self.k = nn.Linear(d_model, hkv * dk, bias=spec.bias)
        self.v = None if spec.share_kv else nn.Linear(d_model, hkv * dv, bias=spec.bias)
        self.o = nn.Linear(h * dv, d_model, bias=spec.output_bias) if spec.merge == "project" else None
        if spec.score == "bilinear":
            self.score_w = nn.Parameter(torch.empty(h, dk, dk))
        elif spec.score == "additive":
            self.score_w = nn.Parameter(torch.empty(h, dk))
        positional = not spec.cross
        self.rel_k = self.rel_v = None
        self.clip = 0
        if positional and position.kind == "relative":
            self.clip = position.clip
            self.rel_k = nn.Embedding(2 * position.clip + 1, dk)
            self.rel_v = nn.Embedding(2 * position.clip + 1, dv) if position.values else None
        self.alibi = positional and position.kind == "alibi"
        self.interleaved = position.kind == "rotary" and position.layout == "interleaved"
        # rotary: this layer's inverse frequencies (its base and scaling), computed once here
        self.frequencies = None
        if spec.rotary_dims:
            self.frequencies = rotary_frequencies(spec.rotary_dims, spec.rotary_base, spec.rotary_scaling,
                                                  position.max_length)
        if self.alibi:
            self.register_buffer("slopes", torch.tensor(alibi_slopes(h)).view(1, h, 1, 1), persistent=False)
        if spec.pattern.kind == "linformer":
            self.proj_k = nn.Parameter(torch.empty(spec.pattern.k, position.max_length))
            self.proj_v = nn.Parameter(torch.empty(spec.pattern.k, position.max_length))
        if spec.pattern.kind == "bigbird":
            self.register_buffer("random_table", _bigbird_table(spec), persistent=False)
        self.sinks = nn.Parameter(torch.empty(h)) if spec.sinks else None
        self.drop = Dropout(dropout)

    # --- pieces ------------------------------------------------------------------------------

    def _heads(self, x: torch.Tensor, n: int, d: int) -> torch.Tensor:
        b, t, _ = x.shape
        return x.view(b, t, n, d).transpose(1, 2)  # [B, n, T, d]

    def _repeat(self, x: torch.Tensor) -> torch.Tensor:
        """[B, Hkv, S, d] -> [B, H, S, d]: each kv head serves H/Hkv consecutive query heads (a
        tensor of H heads already, as linformer's projected keys, is returned as it is)."""
        g = self.spec.heads // self.spec.kv_heads
        if g == 1 or x.shape[1] == self.spec.heads:
            return x
        b, hkv, s, d = x.shape
        return x[:, :, None].expand(b, hkv, g, s, d).reshape(b, hkv * g, s, d)

    def pattern_mask(self, q_idx: torch.Tensor, k_idx: torch.Tensor) -> torch.Tensor | None:
        """[T, S] bool from the pattern (None: every key), by sequence index."""
        p = self.spec.pattern
        if p.kind == "local":
            return (q_idx[:, None] - k_idx[None, :]).abs() <= p.window
        if p.kind == "bigbird":
            near = (q_idx[:, None] - k_idx[None, :]).abs() <= p.window
            n = self.random_table.shape[0]
            qb, kb = (q_idx // p.block).clamp(max=n - 1), (k_idx // p.block).clamp(max=n - 1)
            glob = (qb < p.global_)[:, None] | (kb < p.global_)[None, :]
            rand = self.random_table[qb][:, kb]
            return near | glob | rand
        return None

    def _with_pattern(self, allowed: torch.Tensor, q_idx: torch.Tensor, k_idx: torch.Tensor | None) -> torch.Tensor:
        """The caller's mask [B,1,T,S] narrowed by the pattern's, where it has one."""
        pat = self.pattern_mask(q_idx, k_idx)
        return allowed if pat is None else allowed & pat

    def _scores(self, q: torch.Tensor, k: torch.Tensor, rel_k: torch.Tensor | None,
                bilinear_done: bool = False) -> torch.Tensor:
        """q·k-based scores (`bilinear_done`: q has been multiplied by W already)."""
        s = self.spec
        if s.score == "additive":
            # w^T tanh(q_i + k_j (+ a^K_ij)): [B,H,T,S,Dk] summed against w [H,Dk]
            summed = q[:, :, :, None, :] + k[:, :, None, :, :]
            if rel_k is not None:
                summed = summed + rel_k
            return torch.einsum("bhtsd,hd->bhts", torch.tanh(summed), self.score_w)
        if s.score == "bilinear" and not bilinear_done:
            q = torch.einsum("bhtd,hde->bhte", q, self.score_w)  # q^T W
        scores = q @ k.transpose(-1, -2)
        if rel_k is not None:
            scores = scores + torch.einsum("bhtd,tsd->bhts", q, rel_k)
        if s.score == "scaled_dot":
            scores = scores * s.scale if s.scale is not None else scores / math.sqrt(s.d_k)
        if s.softcap is not None:
            scores = torch.tanh(scores / s.softcap) * s.softcap
        return scores

    def _normed(self, lin: torch.Tensor, n: int, d: int, norm: nn.Module | None) -> torch.Tensor:
        """A projection [B,T,n*d] as heads [B,n,T,d], normalised by `norm` where qk_norm says."""
        if norm is not None and self.spec.qk_norm == "full":
            lin = norm(lin)
        heads = self._heads(lin, n, d)
        return norm(heads) if norm is not None and self.spec.qk_norm == "head" else heads

    def memory_kv(self, memory: torch.Tensor) -> KV:
        """Cross-attention keys and values of the encoder output [B,S,D]: [B,Hkv,S,Dk|Dv]."""
        s = self.spec
        k_lin = self.k(memory)
        # share_kv: the same values, but a tensor of their own, so that the exported graph has
        # two outputs (present.N.encoder.key / .value) and not one aliased under two names
        v = self._heads(k_lin, s.kv_heads, s.d_k).clone() if self.v is None else self._heads(self.v(memory), s.kv_heads, s.d_v)
        return self._normed(k_lin, s.kv_heads, s.d_k, self.k_norm), v

    # --- forward -----------------------------------------------------------------------------

    def forward(
        self,
        x: torch.Tensor,
        allowed: torch.Tensor,
        q_idx: torch.Tensor,
        rope: tuple[torch.Tensor, torch.Tensor] | None = None,
        past: KV | None = None,
        memory: torch.Tensor | None = None,
        key_keep: torch.Tensor | None = None,
        position_bias: torch.Tensor | None = None,
    ) -> tuple[torch.Tensor, KV]:
        """x [B,T,D]; allowed [B,1,T,S] bool; q_idx [T] sequence index of each query;
        position_bias [1,H,T,S]: added to the scores (the stack's bucketed positions);
        rope (cos, sin) [B,1,T,R]; past: cached (k, v) [B,Hkv,P,Dk|Dv] (a window cache's P is at
        most its window W, and `allowed` still covers the whole sequence; for cross-attention:
        the source's k, v, used as they are); memory [B,S,D]: the encoder output (cross-attention
        without a cache); key_keep [B,S] bool: real (not padding) keys, for linformer.
        Returns the output [B,T,D] and the present (k, v)."""
        s = self.spec
        q = self._normed(self.q(x), s.heads, s.d_k, self.q_norm)
        if s.cross:
            k, v = past if past is not None else self.memory_kv(memory)
        else:
            k_lin = self.k(x)
            k = self._normed(k_lin, s.kv_heads, s.d_k, self.k_norm)
            if self.v is not None:
                v = self._heads(self.v(x), s.kv_heads, s.d_v)
            else:  # share_kv: k's projection serves as the values, before any k_norm
                v = k if self.k_norm is None else self._heads(k_lin, s.kv_heads, s.d_k)
            if rope is not None:
                cos, sin = rope
                q, k = apply_rotary(q, cos, sin, self.interleaved), apply_rotary(k, cos, sin, self.interleaved)
            if past is not None:
                k, v = torch.cat((past[0], k), dim=2), torch.cat((past[1], v), dim=2)
        return self._attend(x, q, k, v, (k, v), allowed, q_idx, key_keep, position_bias)

    def _attend(self, x: torch.Tensor, q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, present: KV,
                allowed: torch.Tensor, q_idx: torch.Tensor, key_keep: torch.Tensor | None,
                position_bias: torch.Tensor | None) -> tuple[torch.Tensor, KV]:
        """Attention of the queries q [B,H,T,Dk] over the keys and values k, v [B,Hkv,S,Dk|Dv] (every
        key the call sees, the past's first), merged into [B,T,D]; `present`: the caches after the
        call, of the whole sequence (a window cache keeps their last W positions). Returns the
        output and the present."""
        s = self.spec
        n_keys = k.shape[2]
        first_key = 0  # sequence index of the first key
        if s.cache_window is not None:
            # a window cache: the keys are the last past + new positions of the sequence the mask
            # covers, and the present keeps the last W of them (specc/spec/io.py)
            total = allowed.shape[-1]
            first_key = total - n_keys
            allowed = allowed[..., first_key:]
            if position_bias is not None:
                position_bias = position_bias[..., first_key:]
            present = (present[0][:, :, -s.cache_window:], present[1][:, :, -s.cache_window:])
        # key positions, only where something reads them (else a dead op in every traced layer)
        k_idx = (torch.arange(n_keys, device=x.device) + first_key
                 if self.rel_k is not None or self.alibi or s.pattern.kind in ("local", "bigbird") else None)

        if s.pattern.kind == "linformer":
            k, v = self._repeat(k), self._repeat(v)
            # project the key axis: K' = E[:, :S] K (padding keys zeroed first)
            if key_keep is not None:
                keep = key_keep[:, None, :, None].to(k.dtype)
                k, v = k * keep, v * keep
            k = torch.einsum("ks,bhsd->bhkd", self.proj_k[:, :n_keys], k)
            v = torch.einsum("ks,bhsd->bhkd", self.proj_v[:, :n_keys], v)
            allowed = None

        bias = position_bias
        rel_k = rel_v = None
        if self.rel_k is not None:
            idx = relative_index(q_idx, k_idx, self.clip)  # [T, S]
            rel_k = self.rel_k(idx)
            rel_v = self.rel_v(idx) if self.rel_v is not None else None

        if self._fused(q, rel_k) and bias is None:
            out = self._fused_attention(q, self._repeat(k), self._repeat(v), allowed, q_idx, k_idx)
        else:
            out = self._attention(q, k, v, allowed, q_idx, k_idx, rel_k, rel_v, bias)
        b, _, t, _ = out.shape
        if s.merge == "mean":
            return out.mean(dim=1), present
        out = out.transpose(1, 2).reshape(b, t, s.heads * s.d_v)
        return (self.o(out) if self.o is not None else out), present

    def _fused(self, q: torch.Tensor, rel_k: torch.Tensor | None) -> bool:
        """Whether this call may take torch's fused kernel: run eagerly (never while torch.export
        or torch.compile traces, so every exported graph holds the written-out form below), in
        fp32, in eval mode (no dropout on the weights), with a dot-product score and nothing added
        to it but the mask."""
        return (self.spec.score in ("dot", "scaled_dot", "bilinear") and rel_k is None and not self.alibi
                and self.spec.softcap is None and self.sinks is None
                and not (self.training and self.drop.p > 0) and q.dtype == torch.float32
                and not torch.compiler.is_compiling())

    def _fused_attention(self, q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, allowed: torch.Tensor | None,
                         q_idx: torch.Tensor, k_idx: torch.Tensor | None) -> torch.Tensor:
        """softmax(score(q, k) | mask) v by torch's scaled_dot_product_attention: the same function as
        _attention (tests/nn/test_model.py checks both forms agree), without the [B,H,T,S] scores
        written out four times (what that saves: docs/build.md).
        The mask is additive: 0 where allowed, the dtype's minimum elsewhere, which rounds every
        masked score to that minimum as _attention's replacement does (a row with nothing to attend
        to averages all values in both)."""
        s = self.spec
        if s.score == "bilinear":
            q = torch.einsum("bhtd,hde->bhte", q, self.score_w)
        scale = (s.scale if s.scale is not None else 1 / math.sqrt(s.d_k)) if s.score == "scaled_dot" else 1.0
        bias = None
        if allowed is not None:
            allowed = self._with_pattern(allowed, q_idx, k_idx)
            bias = torch.zeros(allowed.shape, dtype=q.dtype, device=q.device).masked_fill_(~allowed, torch.finfo(q.dtype).min)
        return nn.functional.scaled_dot_product_attention(q, k, v, attn_mask=bias, scale=scale)

    def _attention(self, q, k, v, allowed, q_idx, k_idx, rel_k, rel_v, bias=None) -> torch.Tensor:
        """The attention written out op by op: the form torch.export records. k, v: [B,Hkv,S,d]
        (or already H heads); bias [1,H,T,S]: added to the scores (bucketed positions).

        With grouped key-value heads (GQA) and a score that is a product of q and k, the g = H/Hkv
        query heads of one kv head multiply that head's keys and values as they are, broadcast
        ([B,Hkv,g,T,d] x [B,Hkv,1,d,S]): the cached K and V are read once, never copied out g
        times as a repeat would (what a decode step saves: docs/benchmarks.md). Scores, masks and
        softmax see the usual [B,H,T,S] (a view). Only the head axis is split and joined
        (unflatten, flatten): a size inferred (-1) or multiplied would be computed by the exporter
        once, in the first layer, and a stitched export needs every layer alike."""
        g = q.shape[1] // k.shape[1]
        grouped = g > 1 and self.spec.score != "additive" and rel_k is None and rel_v is None
        if grouped:
            if self.spec.score == "bilinear":
                q = torch.einsum("bhtd,hde->bhte", q, self.score_w)  # q^T W, per query head
            scores = self._scores(q.unflatten(1, (k.shape[1], g)), k[:, :, None], None, bilinear_done=True)
            scores = scores.flatten(1, 2)
        else:
            k, v = self._repeat(k), self._repeat(v)
            scores = self._scores(q, k, rel_k)
        if bias is not None:
            scores = scores + bias.to(scores.dtype)
        if self.alibi:
            dist = (q_idx[:, None] - k_idx[None, :]).abs().to(scores.dtype)  # [T, S]
            scores = scores - self.slopes.to(scores.dtype) * dist
        if allowed is not None:
            allowed = self._with_pattern(allowed, q_idx, k_idx)
            scores = torch.where(allowed, scores, torch.finfo(scores.dtype).min)
        probs = self.drop(cast(self._softmax(cast(scores, torch.float32)), q.dtype))
        if grouped:
            out = (probs.unflatten(1, (k.shape[1], g)) @ v[:, :, None]).flatten(1, 2)
        else:
            out = probs @ v
        if rel_v is not None:
            out = out + torch.einsum("bhts,tsd->bhtd", probs, rel_v)
        return out

    def _softmax(self, scores: torch.Tensor) -> torch.Tensor:
        """softmax over the keys of fp32 scores [B,H,T,S]; with sinks, over [scores | s_h] (the
        head's sink logit as one more column), that column dropped after: each row's weights sum
        to less than one, what the sink took (transformers' GptOssAttention)."""
        if self.sinks is None:
            return torch.softmax(scores, dim=-1)
        sink = self.sinks.to(scores.dtype).view(1, -1, 1, 1).expand(*scores.shape[:-1], 1)
        return torch.softmax(torch.cat((scores, sink), dim=-1), dim=-1)[..., :-1]
