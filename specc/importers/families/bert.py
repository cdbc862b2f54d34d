"""BERT: its Hugging Face table (config.json -> spec, the pooler, MLM and classifier heads), and the
GGUF row `bert` (BERT, and the DistilBERT, RoBERTa and XLM-RoBERTa checkpoints llama.cpp's converter
writes as bert: each is computed as the BERT it is stored as; RoBERTa's position rows before its
padding id + 1, which the converter cuts off, leave the table of a BERT that computes what the
RoBERTa computes for every real token; the pooler and the MLM head are not written)."""
from __future__ import annotations

from specc.importers.gguftable import Arch, Meta, encoder_heads, rows, token_id
from specc.importers.table import (ACTIVATIONS, BOOL, INT, NUMBER, OBJECT_OR_NULL, STR, TOKEN, Family, Field_, Name,
                                   Refuse, Registered, has_tensor, linear, lookup, norm, read)


def _bert_heads_model(cfg: dict, tensors: dict) -> list:
    outs = [{"kind": "hidden", "name": "last_hidden_state"}]
    if has_tensor(tensors, "pooler.dense.weight", ("bert.", "")):
        outs.append({"kind": "pooled", "name": "pooler_output", "pool": "first", "pooler": "tanh"})
    return outs


def _classes(cfg: dict) -> int:
    labels = read(cfg, "id2label", OBJECT_OR_NULL, None)
    if labels is not None:
        return len(labels)
    return read(cfg, "num_labels", INT, 2)


BERT = Family(
    model_types=("bert",),
    architecture="encoder",
    fields=(
        Field_("d_model", "hidden_size", kind=INT),
        Field_("vocab.size", "vocab_size", kind=INT),
        Field_("vocab.type_size", "type_vocab_size", 2, kind=INT),
        Field_("vocab.tie_output", "tie_word_embeddings", True, kind=BOOL),
        Field_("position.max_length", "max_position_embeddings", kind=INT),
        Field_("norm.eps", "layer_norm_eps", 1e-12, kind=NUMBER),
        Field_("dropout.hidden", "hidden_dropout_prob", 0.1, kind=NUMBER),
        Field_("dropout.attention", "attention_probs_dropout_prob", 0.1, kind=NUMBER),
        Field_("encoder.layers", "num_hidden_layers", kind=INT),
        Field_("encoder.attention.heads", "num_attention_heads", kind=INT),
        Field_("encoder.ffn.d_ff", "intermediate_size", kind=INT),
        Field_("encoder.ffn.activation", "hidden_act", "gelu", lookup(ACTIVATIONS, "hidden_act"), kind=STR),
        Field_("tokens.pad", "pad_token_id", None, kind=TOKEN),
    ),
    fixed={"architecture": "encoder", "vocab": {"norm": True},
           "position": {"kind": "learned"}, "norm": {"kind": "layernorm", "placement": "post"},
           "encoder": {"attention": {"bias": True}, "ffn": {"bias": True}}},
    refuse=(
        Refuse("position_embedding_type", ("absolute",), "absolute",
               "relative_key / relative_key_query are not Shaw et al.'s clipped relative positions"),
        Refuse("is_decoder", (False,), False, "a BERT used as a causal decoder"),
        Refuse("add_cross_attention", (False,), False, "BERT layers with cross-attention"),
    ),
    heads={
        "BertModel": _bert_heads_model,
        "BertForMaskedLM": lambda cfg, t: [{"kind": "hidden", "name": "last_hidden_state"},
                                           {"kind": "mlm", "name": "logits"}],
        "BertForSequenceClassification": lambda cfg, t: [
            {"kind": "hidden", "name": "last_hidden_state"},
            {"kind": "classifier", "name": "logits", "classes": _classes(cfg), "pool": "first", "pooler": "tanh"}],
    },
    names=(
        Name("embeddings.tokens.weight", ("embeddings.word_embeddings.weight",)),
        Name("embeddings.types.weight", ("embeddings.token_type_embeddings.weight",)),
        Name("encoder.positions.weight", ("embeddings.position_embeddings.weight",)),
        *norm("encoder.embed_norm", "embeddings.LayerNorm"),
        *linear("encoder.layers.{i}.attention.q", "encoder.layer.{i}.attention.self.query", "encoder"),
        *linear("encoder.layers.{i}.attention.k", "encoder.layer.{i}.attention.self.key", "encoder"),
        *linear("encoder.layers.{i}.attention.v", "encoder.layer.{i}.attention.self.value", "encoder"),
        *linear("encoder.layers.{i}.attention.o", "encoder.layer.{i}.attention.output.dense", "encoder"),
        *norm("encoder.layers.{i}.attention_norm", "encoder.layer.{i}.attention.output.LayerNorm", "encoder"),
        *linear("encoder.layers.{i}.ffn.up", "encoder.layer.{i}.intermediate.dense", "encoder"),
        *linear("encoder.layers.{i}.ffn.down", "encoder.layer.{i}.output.dense", "encoder"),
        *norm("encoder.layers.{i}.ffn_norm", "encoder.layer.{i}.output.LayerNorm", "encoder"),
        *linear("heads.{head}.pooler", "pooler.dense"),
        *linear("heads.{head}.transform", "cls.predictions.transform.dense"),
        *norm("heads.{head}.norm", "cls.predictions.transform.LayerNorm"),
        Name("heads.{head}.bias", ("cls.predictions.bias", "cls.predictions.decoder.bias")),
        Name("heads.{head}.proj.weight", ("cls.predictions.decoder.weight", "classifier.weight")),
        Name("heads.{head}.proj.bias", ("classifier.bias",)),
    ),
    prefixes=("bert.", ""),
    ignore=(r"embeddings\.position_ids$", r"embeddings\.token_type_ids$"),
    sources={"classes": "id2label (or num_labels)"},
)


# --- GGUF ---------------------------------------------------------------------------------------

def _bert_config(m: Meta) -> dict:
    """BERT's body (post-norm LayerNorm, learned positions, token types where the file has
    token_types: DistilBERT has none), computed both ways (`attention.causal` true is refused),
    GELU (exact: BERT's, RoBERTa's and DistilBERT's; llama.cpp computes its tanh approximation).
    Positions: the table's rows (the converter's context_length; RoBERTa's less the rows it cut).
    A classifier (cls.weight, cls.output.weight: RoBERTa's dense + tanh + projection on the first
    token) is BertForSequenceClassification's pooler and classifier; BERT's own classifier, whose
    pooler the converter drops (cls.output.weight alone), is refused."""
    if m.flag("attention.causal", False):
        m.refuse("bert.attention.causal", "true: a BERT used as a causal decoder is not imported")
    cfg = {
        "model_type": "bert", "architectures": ["BertModel"], "hidden_size": int(m.number("embedding_length")),
        "num_hidden_layers": int(m.number("block_count")), "num_attention_heads": encoder_heads(m),
        "intermediate_size": int(m.number("feed_forward_length")),
        "layer_norm_eps": float(m.number("attention.layer_norm_epsilon")), "hidden_act": "gelu",
        "vocab_size": rows(m, "token_embd.weight"),
        "type_vocab_size": rows(m, "token_types.weight") if m.has("token_types.weight") else 0,
        "max_position_embeddings": (rows(m, "position_embd.weight") if m.has("position_embd.weight")
                                    else int(m.number("context_length"))),
        "pad_token_id": token_id(m, "padding_token_id"),
    }
    if m.has("cls.output.weight"):
        if not m.has("cls.weight"):
            m.refuse("cls.output.weight", "BERT's classifier reads its pooler (dense + tanh), which llama.cpp's "
                     "converter does not write; import the Hugging Face checkpoint with specc import hf")
        cfg["architectures"] = ["BertForSequenceClassification"]
        cfg["num_labels"] = rows(m, "cls.output.weight")
    return cfg


# llama.cpp's pooling types (gguf.PoolingType) specc pools with, as the pooled output's `pool`
_POOLING = {1: "mean", 2: "first", 3: "last"}


def _bert_outputs(m: Meta) -> list[dict]:
    """The embedding llama.cpp gives for `bert.pooling_type` (the sentence-transformers pooling
    the converter read): mean, the first token's or the last's hidden state, unprojected. None
    (0, or no key): no pooled output. Rank (4): the classifier's logits (cls tensors required)."""
    kind = m.raw("bert.pooling_type")
    if kind in (None, 0):
        return []
    if kind == 4 and m.has("cls.output.weight"):
        return []
    if kind not in _POOLING:
        why = ("rank pooling without a classification head (cls.output.weight)" if kind == 4
               else "not one of llama.cpp's pooling types specc pools with (0 none, 1 mean, 2 cls, 3 last)")
        m.refuse("bert.pooling_type", f"{str(kind)[:40]}: {why}")
    return [{"kind": "pooled", "name": "sentence_embedding", "pool": _POOLING[kind]}]


_BERT = {"attn_q": "attention.self.query", "attn_k": "attention.self.key", "attn_v": "attention.self.value",
         "attn_output": "attention.output.dense", "attn_output_norm": "attention.output.LayerNorm",
         "ffn_up": "intermediate.dense", "ffn_down": "output.dense", "layer_output_norm": "output.LayerNorm"}
_BERT_TOP = {"token_embd": "embeddings.word_embeddings", "token_types": "embeddings.token_type_embeddings",
             "position_embd": "embeddings.position_embeddings", "token_embd_norm": "embeddings.LayerNorm",
             "cls": "pooler.dense", "cls.output": "classifier"}

REGISTERED = Registered(
    BERT,
    gguf={"bert": Arch("bert", "BertModel", _bert_config, _BERT, _BERT_TOP, prefix="encoder.layer.{i}.",
                       outputs=_bert_outputs, tokenizer=False)},
)
