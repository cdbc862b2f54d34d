"""ELECTRA (the discriminator's body): BERT's layers, no pooler."""
from __future__ import annotations

from dataclasses import replace

from specc.importers.families.bert import BERT
from specc.importers.table import INT, Registered, read


def _electra_extra(spec: dict, cfg: dict) -> None:
    """An `embedding_size` other than `hidden_size` (ELECTRA-small's 128 into 256, through
    embeddings_project) is refused: specc's embeddings are d_model wide."""
    size = read(cfg, "embedding_size", INT, 128)
    if size != read(cfg, "hidden_size", INT):
        raise ValueError(f"embedding_size {size}: embeddings narrower than hidden_size, projected up, are not expressible")


ELECTRA = replace(
    BERT,
    model_types=("electra",),
    heads={"ElectraModel": lambda cfg, t: [{"kind": "hidden", "name": "last_hidden_state"}]},
    names=tuple(n for n in BERT.names if not n.specc.startswith("heads.")),
    prefixes=("electra.", ""),
    extra=_electra_extra,
    sources={},
)

REGISTERED = Registered(ELECTRA)
