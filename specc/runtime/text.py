"""Text in and out of a built model, with a Hugging Face tokenizer: the one a build carries in its
root (tokenizer.json and its companions, specc/spec/manifest.py's TOKENIZER_FILES), or a
tokenizer.json given by hand. Read with the `tokenizers` library, imported when a tokenizer is
loaded (an optional dependency, like jinja2 for chat templates).

    tok = Tokenizer.load("build/minilm")           # a folder holding tokenizer.json, or the file
    tok.feeds(["a", "b"], pad_id=0, left=False)     # input_ids, attention_mask (, token_type_ids)
    tok.prompts(["a"])                              # each text's ids, padding dropped
    tok.chat([{"role": "user", "content": "Hi"}])   # the checkpoint's chat template, rendered
    s = tok.stream(); s.push(id) ... s.flush()      # decoded text that is always whole characters

Contracts:

- Encoding honours the tokenizer's own settings in tokenizer.json: truncation, padding (a fixed
  length, a side, a pad id) and its post-processor's special tokens, as transformers'
  tokenizer(texts) does; the attention mask comes with the ids, so padding is never attended.
  Rows the tokenizer leaves unequal are padded by the caller's rule (the build's pad id; left for
  a decoder's prompts), as --ids rows are.
- Decoding skips special tokens (transformers' decode(..., skip_special_tokens=True)).
- StreamDecoder: the concatenation of everything push() and flush() return equals decode() of
  all the pushed ids, and no piece ends inside a character: a token that ends with part of a
  UTF-8 sequence (the replacement character U+FFFD in the decoded text) is held back until a later
  token completes it, or until flush().
- chat(): the template of tokenizer_config.json's `chat_template` (or chat_template.jinja beside
  it, which wins, as transformers reads it) rendered as transformers' apply_chat_template renders
  it: jinja2's immutable sandbox (the template is the checkpoint's, untrusted), trim_blocks and
  lstrip_blocks, loop controls, `raise_exception`, `strftime_now` and a `tojson` filter that
  keeps non-ASCII text, with `messages`, `add_generation_prompt` and the special tokens
  (bos_token, eos_token, ...). Its text is encoded without adding special tokens again.

Every failure is a RunError naming the file.
"""
from __future__ import annotations

import json
from dataclasses import dataclass
from pathlib import Path
from typing import Any, Sequence

import numpy as np

from specc.errors import first_line
from specc.fileio import NotARegularFile, read_bounded
from specc.decoding.text import ChatTemplate, TemplateError, special_tokens_of
from specc.runtime.arrays import pad_rows
from specc.runtime.errors import RunError
from specc.spec.manifest import CHAT_TEMPLATE, MAX_TOKENIZER_BYTES, TOKENIZER_CONFIG, TOKENIZER_JSON

REPLACEMENT = "\ufffd"  # what a decoder gives for an incomplete UTF-8 sequence


@dataclass(frozen=True)
class Feeds:
    """Encoded texts as a batch: [B, T] int64 arrays."""

    input_ids: np.ndarray
    attention_mask: np.ndarray
    token_type_ids: np.ndarray


class Tokenizer:
    """A Hugging Face tokenizer: tokenizer.json (tokenizers' serialization) and, where they are
    beside it, tokenizer_config.json and chat_template.jinja (see the module's doc)."""

    def __init__(self, backend, config: dict, template: str | None, where: Path):
        self.backend = backend  # a tokenizers.Tokenizer
        self.config = config  # tokenizer_config.json ({} where there is none)
        self.template = template  # the chat template, None where there is none
        self.where = where  # the tokenizer.json it was read from
        self.chat_template = None if template is None else ChatTemplate(template, special_tokens_of(config), jinja)

    @classmethod
    def load(cls, path: str | Path) -> Tokenizer:
        """The tokenizer of a tokenizer.json file, or of a folder (a build's) holding one, with
        the companions beside it."""
        path = Path(path)
        file = path / TOKENIZER_JSON if path.is_dir() else path
        try:
            from tokenizers import Tokenizer as Backend
        except ImportError:
            raise RunError("text needs the `tokenizers` package: pip install tokenizers") from None
        text = _read_text(file)
        try:
            backend = Backend.from_str(text)
        except Exception as exc:  # tokenizers raises its own exception type
            raise RunError(f"{file}: cannot load the tokenizer ({first_line(exc) or type(exc).__name__})") from None
        config: dict = {}
        if (file.parent / TOKENIZER_CONFIG).exists():
            try:
                config = json.loads(_read_text(file.parent / TOKENIZER_CONFIG))
            except ValueError as exc:
                raise RunError(f"{file.parent / TOKENIZER_CONFIG}: not JSON ({exc})") from None
            if not isinstance(config, dict):
                raise RunError(f"{file.parent / TOKENIZER_CONFIG}: not a JSON object")
        template = _template(config, file.parent)
        return cls(backend, config, template, file)

    # --- encoding -------------------------------------------------------------------------------

    def encode(self, texts: Sequence[str], add_special_tokens: bool = True) -> list:
        """tokenizers' encodings of `texts`, with the tokenizer's truncation and padding."""
        if isinstance(texts, str) or not all(isinstance(t, str) for t in texts):
            raise RunError("texts: expected a list of strings")
        return self.backend.encode_batch(list(texts), add_special_tokens=add_special_tokens)

    def feeds(self, texts: Sequence[str], *, pad_id: int, left: bool, add_special_tokens: bool = True) -> Feeds:
        """`texts` as one batch for Session.run: the tokenizer's ids, attention mask and token
        types; rows it leaves of unequal lengths padded with `pad_id` on the left (left=True) or
        the right, their mask 0 there."""
        encs = self.encode(texts, add_special_tokens)
        if len({len(e.ids) for e in encs}) == 1:
            return Feeds(np.array([e.ids for e in encs], dtype=np.int64),
                         np.array([e.attention_mask for e in encs], dtype=np.int64),
                         np.array([e.type_ids for e in encs], dtype=np.int64))
        rows = [_attended(e.ids, e.attention_mask) for e in encs]
        ids, mask = pad_rows(rows, pad_id, left)
        types, _ = pad_rows([_attended(e.type_ids, e.attention_mask) for e in encs], 0, left)
        return Feeds(ids, mask, types)

    def prompts(self, texts: Sequence[str], add_special_tokens: bool = True) -> list[list[int]]:
        """Each text's ids (truncated as the tokenizer truncates), its padding dropped: prompts for
        generation, which pads them its own way."""
        return [_attended(e.ids, e.attention_mask) for e in self.encode(texts, add_special_tokens)]

    # --- decoding -------------------------------------------------------------------------------

    def decode(self, ids: Sequence[int]) -> str:
        """The text of `ids`, special tokens skipped."""
        return self.backend.decode(list(ids), skip_special_tokens=True)

    def stream(self) -> StreamDecoder:
        return StreamDecoder(self)

    # --- chat -----------------------------------------------------------------------------------

    def chat(self, messages: list[dict[str, Any]], add_generation_prompt: bool = True) -> str:
        """The chat template rendered for `messages` (see the module's doc; the renderer is
        decoding's ChatTemplate, the one both serving hosts use)."""
        if self.chat_template is None:
            raise RunError(f"{self.where.parent}: the tokenizer has no chat template (no {CHAT_TEMPLATE}, no "
                           f"chat_template in {TOKENIZER_CONFIG}); --chat needs one")
        try:
            return self.chat_template.render(messages, add_generation_prompt)
        except TemplateError as exc:
            raise RunError(f"{self.where.parent}: the chat template fails: {exc}") from None

    def special_tokens(self) -> dict[str, str]:
        """bos_token, eos_token, ... as tokenizer_config.json names them (a string, or an added
        token's content)."""
        return special_tokens_of(self.config)

    def templated(self, text: str) -> bool:
        """Whether TEXT holds one of the tokenizer's special tokens (`<|im_start|>`, `[CLS]`, ...):
        a prompt already put in a template by hand, rather than a user's plain words."""
        marks = set(self.special_tokens().values())
        marks.update(t.content for t in self.backend.get_added_tokens_decoder().values() if t.special)
        return any(m and m in text for m in marks)


class StreamDecoder:
    """Decoded text of a growing list of ids, a piece at a time, never ending inside a character
    (see the module's doc). Each piece is the text of the ids from `start` on, less that of the
    ids from `start` to `shown`: decoding a window with a token before the new ones keeps the
    spaces a tokenizer writes as part of a token (SentencePiece's leading "▁")."""

    def __init__(self, tokenizer: Tokenizer):
        self.tokenizer = tokenizer
        self.ids: list[int] = []
        self.start = 0  # the window's first id
        self.shown = 0  # ids up to here have been given out as text

    def push(self, token: int) -> str:
        """The text `token` completes: "" while it ends inside a character."""
        self.ids.append(int(token))
        before = self.tokenizer.decode(self.ids[self.start:self.shown])
        text = self.tokenizer.decode(self.ids[self.start:])
        if len(text) <= len(before) or text.endswith(REPLACEMENT):
            return ""
        self.start, self.shown = self.shown, len(self.ids)
        return text[len(before):]

    def flush(self) -> str:
        """What is still held back (an incomplete character at the end, as decode() gives it)."""
        if self.shown == len(self.ids):
            return ""
        before = self.tokenizer.decode(self.ids[self.start:self.shown])
        text = self.tokenizer.decode(self.ids[self.start:])
        self.start = self.shown = len(self.ids)
        return text[len(before):]


def _attended(values: list[int], mask: list[int]) -> list[int]:
    return [v for v, m in zip(values, mask) if m]


def _read_text(path: Path) -> str:
    try:
        return read_bounded(path, MAX_TOKENIZER_BYTES).decode("utf-8")
    except NotARegularFile as exc:
        raise RunError(str(exc)) from None
    except UnicodeDecodeError as exc:
        raise RunError(f"{path}: cannot load the tokenizer ({exc})") from None
    except OSError as exc:
        raise RunError(f"{path}: {exc.strerror or exc}") from None


def _template(config: dict, folder: Path) -> str | None:
    """chat_template.jinja beside tokenizer.json, else tokenizer_config.json's chat_template (a
    string, or a list of named templates: the one named "default"): ChatTemplate.of's rule."""
    text = _read_text(folder / CHAT_TEMPLATE) if (folder / CHAT_TEMPLATE).exists() else None
    found = ChatTemplate.of(config, text, jinja)
    return None if found is None else found.source


def jinja():
    """The jinja2 package, for chat templates (an optional dependency; ImportError where missing)."""
    import jinja2.sandbox

    return jinja2
