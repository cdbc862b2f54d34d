"""BERT's pieces against Hugging Face's implementation (random weights from a config, copied
across): token types, embedding norm, post-norm GELU layers, the MLM head (transform + norm +
tied decoder + bias), the pooler with the NSP-shaped classifier, and a token classifier."""
from __future__ import annotations

import pytest
import torch

import specc

from tests.helpers.speclib import tiny

transformers = pytest.importorskip("transformers")

D, LAYERS, HEADS, FF, VOCAB, MAXLEN = 32, 2, 4, 64, 100, 64


def _bert_pair():
    torch.manual_seed(0)
    cfg = transformers.BertConfig(
        vocab_size=VOCAB, hidden_size=D, num_hidden_layers=LAYERS, num_attention_heads=HEADS,
        intermediate_size=FF, max_position_embeddings=MAXLEN, type_vocab_size=2, hidden_act="gelu",
        layer_norm_eps=1e-12, hidden_dropout_prob=0.0, attention_probs_dropout_prob=0.0, num_labels=5,
    )
    pre = transformers.BertForPreTraining(cfg).eval()
    tok = transformers.BertForTokenClassification(cfg).eval()
    tok.bert.load_state_dict(pre.bert.state_dict(), strict=False)  # same encoder, no pooler
    with torch.no_grad():  # non-trivial norms and biases, so that wiring mistakes show
        for p in list(pre.parameters()) + list(tok.classifier.parameters()):
            p.add_(0.1 * torch.randn_like(p))
        tok.bert.load_state_dict(pre.bert.state_dict(), strict=False)
    spec = tiny({
        "architecture": "encoder", "d_model": D,
        "vocab": {"size": VOCAB, "type_size": 2, "norm": True, "tie_output": True},
        "position": {"kind": "learned", "max_length": MAXLEN},
        "norm": {"kind": "layernorm", "placement": "post", "eps": 1e-12},
        "encoder": {"layers": LAYERS, "attention": {"heads": HEADS}, "ffn": {"d_ff": FF, "activation": "gelu"}},
        "outputs": [
            {"name": "last_hidden_state", "kind": "hidden"},
            {"name": "prediction_logits", "kind": "mlm"},
            {"name": "seq_relationship_logits", "kind": "classifier", "classes": 2, "pool": "first", "pooler": "tanh"},
            {"name": "pooler_output", "kind": "pooled", "pool": "first", "pooler": "tanh"},
            {"name": "tags", "kind": "token_classifier", "classes": 5},
        ],
    })
    ours = specc.to_torch(spec)
    hf = pre.state_dict()
    names = {
        "embeddings.tokens.weight": "bert.embeddings.word_embeddings.weight",
        "embeddings.types.weight": "bert.embeddings.token_type_embeddings.weight",
        "encoder.positions.weight": "bert.embeddings.position_embeddings.weight",
        "encoder.embed_norm.weight": "bert.embeddings.LayerNorm.weight",
        "encoder.embed_norm.bias": "bert.embeddings.LayerNorm.bias",
    }
    for i in range(LAYERS):
        hfl, us = f"bert.encoder.layer.{i}.", f"encoder.layers.{i}."
        for a, b in (("attention.q", "attention.self.query"), ("attention.k", "attention.self.key"),
                     ("attention.v", "attention.self.value"), ("attention.o", "attention.output.dense"),
                     ("attention_norm", "attention.output.LayerNorm"), ("ffn.up", "intermediate.dense"),
                     ("ffn.down", "output.dense"), ("ffn_norm", "output.LayerNorm")):
            for leaf in ("weight", "bias"):
                names[f"{us}{a}.{leaf}"] = f"{hfl}{b}.{leaf}"
    for leaf in ("weight", "bias"):
        names[f"heads.prediction_logits.transform.{leaf}"] = f"cls.predictions.transform.dense.{leaf}"
        names[f"heads.prediction_logits.norm.{leaf}"] = f"cls.predictions.transform.LayerNorm.{leaf}"
        for head in ("seq_relationship_logits", "pooler_output"):
            names[f"heads.{head}.pooler.{leaf}"] = f"bert.pooler.dense.{leaf}"
        names[f"heads.seq_relationship_logits.proj.{leaf}"] = f"cls.seq_relationship.{leaf}"
    names["heads.prediction_logits.bias"] = "cls.predictions.bias"
    state = {ours_name: hf[hf_name] for ours_name, hf_name in names.items()}
    state["heads.tags.proj.weight"] = tok.classifier.weight.detach()
    state["heads.tags.proj.bias"] = tok.classifier.bias.detach()
    ours.load_state_dict(state, strict=True)
    return pre, tok, ours


def test_bert_matches_hugging_face_with_padding_and_token_types():
    pre, tok, ours = _bert_pair()
    g = torch.Generator().manual_seed(1)
    ids = torch.randint(0, VOCAB, (3, 11), generator=g)
    types = torch.randint(0, 2, (3, 11), generator=g)
    mask = torch.ones_like(ids)
    mask[1, 7:] = 0
    mask[2, 4:] = 0
    with torch.no_grad():
        ref = pre(input_ids=ids, attention_mask=mask, token_type_ids=types, output_hidden_states=True)
        base = pre.bert(input_ids=ids, attention_mask=mask, token_type_ids=types)
        ref_tags = tok(input_ids=ids, attention_mask=mask, token_type_ids=types).logits
        out = ours(input_ids=ids, attention_mask=mask, token_type_ids=types)
    real = mask.bool()
    pairs = {
        "last_hidden_state": base.last_hidden_state,
        "prediction_logits": ref.prediction_logits,
        "tags": ref_tags,
    }
    for name, want in pairs.items():
        assert torch.allclose(out[name][real], want[real], atol=1e-4), (name, (out[name][real] - want[real]).abs().max())
    assert torch.allclose(out["pooler_output"], base.pooler_output, atol=1e-5)
    assert torch.allclose(out["seq_relationship_logits"], ref.seq_relationship_logits, atol=1e-5)
