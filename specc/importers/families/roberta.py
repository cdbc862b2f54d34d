"""RoBERTa: BERT's layers, positions counted from the padding id + 1. Its GGUF files are read by
BERT's row (llama.cpp's converter writes them as bert)."""
from __future__ import annotations

from dataclasses import replace

from specc.importers.families.bert import BERT
from specc.importers.table import INT, INT_OR_NULL, Name, Registered, has_tensor, linear, norm, read, set_key


def _roberta_extra(spec: dict, cfg: dict) -> None:
    """Positions count from `pad_token_id` + 1 (transformers' create_position_ids_from_input_ids):
    with the padding id 1, position p reads row p + 2 of the table, and `position.max_length` is
    `max_position_embeddings` - 2. Another padding id is refused. A padded position's own output
    differs (transformers gives it the padding row; specc the next position's), never a real
    token's."""
    pad = read(cfg, "pad_token_id", INT_OR_NULL, 1)
    if pad != 1:
        raise ValueError(f"pad_token_id {pad}: RoBERTa's positions are imported for the padding id 1 (rows from 2)")
    set_key(spec, "position.max_length", read(cfg, "max_position_embeddings", INT) - 2)


def _roberta_heads_model(cfg: dict, tensors: dict) -> list:
    outs = [{"kind": "hidden", "name": "last_hidden_state"}]
    if has_tensor(tensors, "pooler.dense.weight", ("roberta.", "")):
        outs.append({"kind": "pooled", "name": "pooler_output", "pool": "first", "pooler": "tanh"})
    return outs


ROBERTA = replace(
    BERT,
    model_types=("roberta",),
    heads={"RobertaModel": _roberta_heads_model,
           "RobertaForMaskedLM": lambda cfg, t: [{"kind": "hidden", "name": "last_hidden_state"},
                                                 {"kind": "mlm", "name": "logits"}]},
    names=tuple(
        Name(n.specc, ("embeddings.position_embeddings.weight",), "offset2") if n.specc == "encoder.positions.weight" else n
        for n in BERT.names if not n.hf[0].startswith("cls.")) + (
        *linear("heads.{head}.transform", "lm_head.dense"),
        *norm("heads.{head}.norm", "lm_head.layer_norm"),
        Name("heads.{head}.bias", ("lm_head.bias", "lm_head.decoder.bias")),
        Name("heads.{head}.proj.weight", ("lm_head.decoder.weight",)),
    ),
    prefixes=("roberta.", ""),
    extra=_roberta_extra,
    sources={"position.max_length": "max_position_embeddings"},
)

REGISTERED = Registered(ROBERTA)
