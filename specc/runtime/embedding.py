"""Sentence embeddings from a build: one vector per text (or row of token ids), the build's
`sentence_embedding` output, which the OpenAI-compatible API's /v1/embeddings answers with
(openai_api.py).

Contract: `Embedder.of(session)` is None unless the build's main graph has an output named
`sentence_embedding` (an encoder's, or a decoder's without its cache; docs/import.md names the
imports that write one: a sentence-transformers folder, a GGUF file with a pooling type).
`embed(texts=...)` encodes the texts with the build's tokenizer as `Session.encode` does (its own
truncation and padding, its attention mask), `embed(ids=...)` takes the ids as they are, each row
padded on the right with the build's pad id; either way the rows run in batches of at most
serving.batch.max, one batch at a time (the graph's IO binding is not shared between threads),
and the answer is the vectors [N, D] (float32) and the count of real tokens (the mask's ones).
Inputs the graph refuses (a row past serving.length.max, an id past the vocabulary) raise
RunError naming them, as Session.run does.
"""
from __future__ import annotations

import threading
from dataclasses import dataclass
from typing import Sequence

import numpy as np

from specc.runtime.arrays import pad_rows
from specc.runtime.errors import RunError
from specc.runtime.session import Session
from specc.spec.io import ATTENTION_MASK, INPUT_IDS

SENTENCE_EMBEDDING = "sentence_embedding"


@dataclass(frozen=True)
class Embedded:
    vectors: np.ndarray  # [N, D] float32, in the order asked
    tokens: int  # the real tokens run, all rows together


class Embedder:
    """The `sentence_embedding` output of a build, run on texts or token ids (the module's doc)."""

    def __init__(self, session: Session):
        if SENTENCE_EMBEDDING not in session.output_names:
            raise RunError(f"{session.dir}: the build has no {SENTENCE_EMBEDDING} output "
                           f"(its outputs: {', '.join(session.output_names)})")
        self.session = session
        self.rows = session.info.batch.max
        self._lock = threading.Lock()

    @classmethod
    def of(cls, session: Session) -> Embedder | None:
        """The build's embedder, or None where it has no sentence_embedding output."""
        return cls(session) if SENTENCE_EMBEDDING in session.output_names else None

    @property
    def has_tokenizer(self) -> bool:
        return self.session.has_tokenizer

    def embed(self, *, texts: Sequence[str] | None = None, ids: Sequence[Sequence[int]] | None = None) -> Embedded:
        """The vectors of TEXTS (the build's tokenizer) or of IDS (rows of token ids), one of the two."""
        if (texts is None) == (ids is None):
            raise RunError("embed() takes texts or ids, one of the two")
        items = list(texts if texts is not None else ids)
        vectors, tokens = [], 0
        for start in range(0, len(items), self.rows):
            chunk = items[start:start + self.rows]
            if texts is not None:
                feeds = self.session.encode(chunk)
            else:
                ids_, mask = pad_rows([list(r) for r in chunk], self.session.info.pad_id, left=False)
                feeds = {INPUT_IDS: ids_, ATTENTION_MASK: mask}
            with self._lock:
                out = self.session.run(**feeds)[SENTENCE_EMBEDDING]
            vectors.append(np.asarray(out, dtype=np.float32))
            tokens += int(np.asarray(feeds[ATTENTION_MASK]).sum())
        return Embedded(np.concatenate(vectors) if vectors else np.zeros((0, 0), np.float32), tokens)
