"""DistilBERT: BERT's layers under other names, no token types. Its GGUF files are read by BERT's
row (llama.cpp's converter writes them as bert)."""
from __future__ import annotations

from specc.importers.table import (ACTIVATIONS, BOOL, INT, NUMBER, STR, TOKEN, Family, Field_, Name, Registered, linear,
                                   lookup, norm)

_DB = "transformer.layer.{i}."
DISTILBERT = Family(
    model_types=("distilbert",),
    architecture="encoder",
    fields=(
        Field_("d_model", "dim", kind=INT),
        Field_("vocab.size", "vocab_size", kind=INT),
        Field_("vocab.tie_output", "tie_word_embeddings", True, kind=BOOL),
        Field_("position.max_length", "max_position_embeddings", kind=INT),
        Field_("dropout.hidden", "dropout", 0.1, kind=NUMBER),
        Field_("dropout.attention", "attention_dropout", 0.1, kind=NUMBER),
        Field_("encoder.layers", "n_layers", kind=INT),
        Field_("encoder.attention.heads", "n_heads", kind=INT),
        Field_("encoder.ffn.d_ff", "hidden_dim", kind=INT),
        Field_("encoder.ffn.activation", "activation", "gelu", lookup(ACTIVATIONS, "activation"), kind=STR),
        Field_("tokens.pad", "pad_token_id", None, kind=TOKEN),
    ),
    # sinusoidal_pos_embds only chooses how the table was initialised: the table is in the checkpoint
    fixed={"architecture": "encoder", "vocab": {"norm": True, "type_size": 0}, "position": {"kind": "learned"},
           "norm": {"kind": "layernorm", "placement": "post", "eps": 1e-12},
           "encoder": {"attention": {"bias": True}, "ffn": {"bias": True}}},
    refuse=(),
    heads={"DistilBertModel": lambda cfg, t: [{"kind": "hidden", "name": "last_hidden_state"}],
           "DistilBertForMaskedLM": lambda cfg, t: [{"kind": "hidden", "name": "last_hidden_state"},
                                                    {"kind": "mlm", "name": "logits"}]},
    names=(
        Name("embeddings.tokens.weight", ("embeddings.word_embeddings.weight",)),
        Name("encoder.positions.weight", ("embeddings.position_embeddings.weight",)),
        *norm("encoder.embed_norm", "embeddings.LayerNorm"),
        *linear("encoder.layers.{i}.attention.q", _DB + "attention.q_lin", "encoder"),
        *linear("encoder.layers.{i}.attention.k", _DB + "attention.k_lin", "encoder"),
        *linear("encoder.layers.{i}.attention.v", _DB + "attention.v_lin", "encoder"),
        *linear("encoder.layers.{i}.attention.o", _DB + "attention.out_lin", "encoder"),
        *norm("encoder.layers.{i}.attention_norm", _DB + "sa_layer_norm", "encoder"),
        *linear("encoder.layers.{i}.ffn.up", _DB + "ffn.lin1", "encoder"),
        *linear("encoder.layers.{i}.ffn.down", _DB + "ffn.lin2", "encoder"),
        *norm("encoder.layers.{i}.ffn_norm", _DB + "output_layer_norm", "encoder"),
        *linear("heads.{head}.transform", "vocab_transform"),
        *norm("heads.{head}.norm", "vocab_layer_norm"),
        Name("heads.{head}.bias", ("vocab_projector.bias",)),
        Name("heads.{head}.proj.weight", ("vocab_projector.weight",)),
    ),
    prefixes=("distilbert.", ""),
    ignore=(r"embeddings\.position_ids$",),
)

REGISTERED = Registered(DISTILBERT)
