"""Text in and out of the generate endpoint: a build's tokenizer.json (Hugging Face tokenizers,
loaded by the host: `specc serve` hash-checks it against the build's manifest first, the Triton
model reads the repository's), its chat template (ChatTemplate: one renderer for `specc generate
--chat`, the generate endpoint's `chat` field and the OpenAI-compatible chat endpoint), and the
new text of a sequence streamed piece by piece with its stop strings.
"""
from __future__ import annotations

import json
from datetime import datetime
from typing import Any, Callable, Mapping, Sequence

from .errors import DecodingError, first_line

# the special tokens a template may name, as tokenizer_config.json names them
SPECIAL_TOKENS = ("bos_token", "eos_token", "unk_token", "sep_token", "pad_token", "cls_token", "mask_token")


class TemplateError(DecodingError):
    """A chat template that cannot be rendered for the messages given (its own raise_exception, a
    Jinja error), or no jinja2 to render it with: one line; each host says whose template it is."""


class ChatTemplate:
    """A checkpoint's chat template (Jinja), rendered as transformers' apply_chat_template renders
    it: jinja2's immutable sandbox (the template is the checkpoint's, untrusted), trim_blocks and
    lstrip_blocks, loop controls, `raise_exception`, `strftime_now` and a `tojson` filter that
    keeps non-ASCII text, with `messages`, `add_generation_prompt` and the special tokens
    (bos_token, eos_token, ...). jinja2 is an optional dependency the host imports, as it imports
    `tokenizers`: `jinja` returns the jinja2 package (with jinja2.sandbox imported; ImportError
    where it is missing), asked when a template is first rendered. Compiled once; rendering is
    safe from any thread."""

    def __init__(self, source: str, special_tokens: Mapping[str, str] | None, jinja: Callable[[], Any]):
        self.source = source
        self.special_tokens = dict(special_tokens or {})
        self.jinja = jinja
        self._compiled = None

    @classmethod
    def of(cls, config: Mapping[str, Any], text: str | None, jinja: Callable[[], Any]) -> ChatTemplate | None:
        """The template of a tokenizer's files: `text` (chat_template.jinja's, which wins, as
        transformers reads it), else tokenizer_config.json's chat_template (`config`: a string, or
        a list of named templates: the one named "default"); None where there is none."""
        value = text
        if value is None:
            value = config.get("chat_template")
            if isinstance(value, list):
                value = next((t.get("template") for t in value if isinstance(t, dict) and t.get("name") == "default"),
                             None)
        return cls(value, special_tokens_of(config), jinja) if isinstance(value, str) else None

    def render(self, messages: Sequence[Mapping[str, Any]], add_generation_prompt: bool = True) -> str:
        """The template's text for `messages` ({"role", "content"} each); TemplateError with the
        template's own words where it refuses them."""
        try:
            jinja2 = self.jinja()
        except ImportError:
            raise TemplateError("a chat template needs the `jinja2` package: pip install jinja2") from None
        try:
            if self._compiled is None:
                self._compiled = _environment(jinja2).from_string(self.source)
            return self._compiled.render(messages=list(messages), add_generation_prompt=add_generation_prompt,
                                         **self.special_tokens)
        except jinja2.TemplateError as exc:
            raise TemplateError(first_line(exc) or type(exc).__name__) from None


def special_tokens_of(config: Mapping[str, Any]) -> dict[str, str]:
    """bos_token, eos_token, ... as tokenizer_config.json names them (a string, or an added
    token's content)."""
    out = {}
    for key in SPECIAL_TOKENS:
        value = config.get(key)
        if isinstance(value, dict):
            value = value.get("content")
        if isinstance(value, str):
            out[key] = value
    return out


def _environment(jinja2):
    """transformers' environment for chat templates, of the jinja2 package given."""

    def raise_exception(message):
        raise jinja2.TemplateError(message)

    def strftime_now(fmt):
        return datetime.now().strftime(fmt)

    def tojson(x, ensure_ascii=False, indent=None, separators=None, sort_keys=False):
        return json.dumps(x, ensure_ascii=ensure_ascii, indent=indent, separators=separators, sort_keys=sort_keys)

    env = jinja2.sandbox.ImmutableSandboxedEnvironment(trim_blocks=True, lstrip_blocks=True,
                                                       extensions=["jinja2.ext.loopcontrols"])
    env.filters["tojson"] = tojson
    env.globals.update(raise_exception=raise_exception, strftime_now=strftime_now)
    return env


class Codec:
    """A tokenizers.Tokenizer, for a prompt's text in and the new tokens' text out (special tokens
    added on encoding and skipped on decoding, the library's defaults), and the tokenizer's chat
    template where it has one."""

    def __init__(self, tokenizer, template: ChatTemplate | None = None):
        self.tokenizer = tokenizer
        self.template = template

    def encode(self, text: str) -> list[int]:
        return list(self.tokenizer.encode(text).ids)

    def chat(self, messages: Sequence[Mapping[str, Any]]) -> list[int]:
        """The ids of `messages` in the chat template with the assistant's turn opened, encoded
        without special tokens added again (the template writes them): what `specc generate
        --chat` feeds. TemplateError where there is no template or it refuses the messages."""
        if self.template is None:
            raise TemplateError("the tokenizer has no chat template")
        return list(self.tokenizer.encode(self.template.render(messages), add_special_tokens=False).ids)

    def decode(self, ids: list[int]) -> str:
        return self.tokenizer.decode(ids)


class TextStream:
    """The new text of a sequence, piece by piece as its tokens come: each piece is what the
    decoded text grew by, held back while it ends in an incomplete UTF-8 character (the
    tokenizer's U+FFFD) or could be the start of a stop string. feed() returns (piece, stopped):
    at a stop string the text ends before it."""

    def __init__(self, codec: Codec, stops: tuple[str, ...]):
        self.codec, self.stops = codec, stops
        self.ids: list[int] = []
        self.sent = 0  # characters of the text handed out

    def feed(self, token: int) -> tuple[str, bool]:
        self.ids.append(token)
        text = self.codec.decode(self.ids)
        for stop in self.stops:
            at = text.find(stop, max(self.sent - len(stop), 0))
            if at >= 0:
                piece, self.sent = text[self.sent:at], max(at, self.sent)
                return piece, True
        end = len(text)
        if text.endswith("\ufffd"):
            end -= 1
        for stop in self.stops:  # a suffix that may grow into a stop string waits
            for k in range(min(len(stop) - 1, end - self.sent), 0, -1):
                if text[end - k:end] == stop[:k]:
                    end -= k
                    break
        piece = text[self.sent:end] if end > self.sent else ""
        self.sent = max(self.sent, end)
        return piece, False

    def rest(self) -> str:
        """What is held back, once the sequence has ended without a stop string."""
        text = self.codec.decode(self.ids)
        piece, self.sent = text[self.sent:], len(text)
        return piece
