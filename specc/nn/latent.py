"""Multi-head latent attention (DeepSeek-V2, arXiv:2405.04434, section 2.1; DeepSeek-V3,
arXiv:2412.19437, section 2.1.1), as transformers' DeepseekV2Attention / DeepseekV3Attention
compute it.

Shapes: B batch, T new tokens, P cached, S = P + T keys, H heads, Dk = Dn + Dr each query / key
head (Dn not rotated, then Dr rotated: `rope_dims`), Dv each value head, Rq / Rkv the ranks.

    x [B,T,D] --q (or q_a, q_a_norm, q_b)--> q [B,H,T,Dk] = [q_nope | q_rot]   (rotary on q_rot)
    x --kv_a--> [latent Rkv | k_rot Dr] --kv_a_norm(latent)--> latent [B,1,T,Rkv], k_rot [B,1,T,Dr]
        (rotary on k_rot) --cat(past)--> present: the cache holds these two, not K and V
    latent [B,1,S,Rkv] --kv_b--> [B,H,S,Dn+Dv] = [k_nope | v];   k = [k_nope | k_rot shared by the heads]
    softmax(q k^T * scale | mask (| sinks)) v  [B,H,T,Dv] --o--> [B,T,D]

The scale is 1/sqrt(Dk) unless the spec's `scale` says otherwise (DeepSeek's YaRN models multiply
it by mscale^2, mscale = 0.1 mscale_all_dim ln(factor) + 1: transformers' yarn_apply_mscale). The
rotary part rotates in the model's layout: `interleaved` pairs (2i, 2i+1), DeepSeek's, or halves.
transformers' V3 with rope_interleave turns the interleaved pairs and writes them back in halves
order, in queries and keys alike: the same scores.
"""
from __future__ import annotations

import torch
from torch import nn

from specc.nn.attention import KV, Attention, _bigbird_table
from specc.nn.norms import RMSNorm
from specc.nn.ops import Dropout
from specc.nn.positions import apply_rotary, rotary_frequencies
from specc.spec.resolve import ResolvedAttention
from specc.spec.schema import PositionSpec


class LatentAttention(Attention):
    """Parameters: q [H*Dk, D] (no q_rank), or q_a [Rq, D], q_a_norm [Rq] and q_b [H*Dk, Rq];
    kv_a [Rkv + Dr, D]; kv_a_norm [Rkv]; kv_b [H*(Dn + Dv), Rkv]; o [D, H*Dv]; sinks [H] (sinks).
    `bias`: q_a's and kv_a's biases; `output_bias`: o's."""

    def __init__(self, spec: ResolvedAttention, d_model: int, position: PositionSpec, dropout: float):
        nn.Module.__init__(self)
        self.spec = spec
        h, dk, dv, dr = spec.heads, spec.d_k, spec.d_v, spec.rotary_dims
        if spec.q_rank is None:
            self.q = nn.Linear(d_model, h * dk, bias=False)
            self.q_a = self.q_a_norm = self.q_b = None
        else:
            self.q = None
            self.q_a = nn.Linear(d_model, spec.q_rank, bias=spec.bias)
            self.q_a_norm = RMSNorm(spec.q_rank, spec.latent_eps)
            self.q_b = nn.Linear(spec.q_rank, h * dk, bias=False)
        self.kv_a = nn.Linear(d_model, spec.kv_rank + dr, bias=spec.bias)
        self.kv_a_norm = RMSNorm(spec.kv_rank, spec.latent_eps)
        self.kv_b = nn.Linear(spec.kv_rank, h * (dk - dr + dv), bias=False)
        self.o = nn.Linear(h * dv, d_model, bias=spec.output_bias)
        # what Attention's shared code reads: no per-head k / v projections, norms, or positions
        # other than the rotary part's
        self.k = self.v = self.q_norm = self.k_norm = self.rel_k = self.rel_v = None
        self.clip, self.alibi = 0, False
        self.interleaved = position.kind == "rotary" and position.layout == "interleaved"
        self.frequencies = None
        if dr and position.kind == "rotary":
            self.frequencies = rotary_frequencies(dr, spec.rotary_base, spec.rotary_scaling, position.max_length)
        if spec.pattern.kind == "bigbird":
            self.register_buffer("random_table", _bigbird_table(spec), persistent=False)
        self.sinks = nn.Parameter(torch.empty(h)) if spec.sinks else None
        self.drop = Dropout(dropout)

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
        """As Attention.forward, but `past` and the present are (latent [B,1,P,Rkv], rotary key
        [B,1,P,Dr])."""
        s = self.spec
        b, t, _ = x.shape
        dr = s.rotary_dims
        dn = s.d_k - dr
        q = self.q(x) if self.q is not None else self.q_b(self.q_a_norm(self.q_a(x)))
        q_nope, q_rot = self._heads(q, s.heads, s.d_k).split((dn, dr), dim=-1)
        latent, k_rot = self.kv_a(x).split((s.kv_rank, dr), dim=-1)
        latent, k_rot = self.kv_a_norm(latent)[:, None], k_rot[:, None]  # [B,1,T,Rkv], [B,1,T,Dr]
        if rope is not None:
            cos, sin = rope
            q_rot, k_rot = apply_rotary(q_rot, cos, sin, self.interleaved), apply_rotary(k_rot, cos, sin, self.interleaved)
        if past is not None:
            latent, k_rot = torch.cat((past[0], latent), dim=2), torch.cat((past[1], k_rot), dim=2)
        n_keys = latent.shape[2]
        kv = self._heads(self.kv_b(latent[:, 0]), s.heads, dn + s.d_v)  # [B,H,S,Dn+Dv]
        k_nope, v = kv.split((dn, s.d_v), dim=-1)
        k = torch.cat((k_nope, k_rot.expand(b, s.heads, n_keys, dr)), dim=-1)
        return self._attend(x, torch.cat((q_nope, q_rot), dim=-1), k, v, (latent, k_rot), allowed, q_idx, key_keep,
                            position_bias)
