"""A real chat tokenizer for tiny builds, made here with nothing downloaded: a byte-level BPE
(Hugging Face tokenizers' trainer, on the Python language reference's topics that every CPython
carries) of CHAT_VOCAB tokens, ChatML's special tokens first (<|endoftext|> 0, <|im_start|> 1,
<|im_end|> 2: SmolLM2-Instruct's layout), and a ChatML chat template in tokenizer_config.json
(a default system turn where the conversation has none, as instruct checkpoints' templates do).
Training is deterministic, so a folder made twice is the same tokenizer."""
from __future__ import annotations

import json
from pathlib import Path

CHAT_VOCAB = 1000  # tiny-llama's vocabulary
END_OF_TEXT, IM_START, IM_END = 0, 1, 2
SPECIAL = ["<|endoftext|>", "<|im_start|>", "<|im_end|>"]
DEFAULT_SYSTEM = "You are a careful assistant."
CHATML = (
    "{% for message in messages %}"
    "{% if loop.first and messages[0]['role'] != 'system' %}"
    "{{ '<|im_start|>system\\n" + DEFAULT_SYSTEM + "<|im_end|>\\n' }}"
    "{% endif %}"
    "{{ '<|im_start|>' + message['role'] + '\\n' + message['content'] + '<|im_end|>' + '\\n' }}"
    "{% endfor %}"
    "{% if add_generation_prompt %}{{ '<|im_start|>assistant\\n' }}{% endif %}"
)


def corpus() -> list[str]:
    from pydoc_data.topics import topics

    return [topics[k] for k in sorted(topics)]


def chat_tokenizer(folder: Path) -> Path:
    """tokenizer.json and tokenizer_config.json (with the ChatML template) in `folder`."""
    from tokenizers import Tokenizer, decoders, models, pre_tokenizers, trainers

    folder.mkdir(parents=True, exist_ok=True)
    tok = Tokenizer(models.BPE())
    tok.pre_tokenizer = pre_tokenizers.ByteLevel(add_prefix_space=False)
    tok.decoder = decoders.ByteLevel()
    trainer = trainers.BpeTrainer(vocab_size=CHAT_VOCAB, special_tokens=SPECIAL, show_progress=False,
                                  initial_alphabet=pre_tokenizers.ByteLevel.alphabet())
    tok.train_from_iterator(corpus(), trainer)
    tok.save(str(folder / "tokenizer.json"))
    config = {"bos_token": SPECIAL[IM_START], "eos_token": SPECIAL[IM_END], "pad_token": SPECIAL[END_OF_TEXT],
              "unk_token": SPECIAL[END_OF_TEXT], "chat_template": CHATML,
              "tokenizer_class": "PreTrainedTokenizerFast", "model_max_length": 2048}
    (folder / "tokenizer_config.json").write_text(json.dumps(config, indent=1))
    return folder


def chat_spec(folder: Path, name: str = "tiny-chat", extra: str = "") -> Path:
    """A tiny-llama spec carrying the chat tokenizer (made in folder/tok), eos <|im_end|>; `extra`:
    YAML lines added at the top level."""
    chat_tokenizer(folder / "tok")
    spec = folder / f"{name}.yaml"
    spec.write_text(f"specc: 1\nname: {name}\nextends: tiny-llama\ntokenizer: tok\n"
                    f"tokens: {{bos: {IM_START}, eos: {IM_END}, pad: {END_OF_TEXT}}}\n{extra}")
    return spec


def embedding_spec(folder: Path, name: str = "tiny-embedder") -> Path:
    """A tiny-bert spec carrying the same tokenizer (made in folder/tok), its padding id
    <|endoftext|>, with a `sentence_embedding` output (the mean over the attention mask) beside its
    last hidden state: what /v1/embeddings answers with."""
    chat_tokenizer(folder / "tok")
    spec = folder / f"{name}.yaml"
    spec.write_text(f"specc: 1\nname: {name}\nextends: tiny-bert\ntokenizer: tok\ntokens: {{pad: {END_OF_TEXT}}}\n"
                    "outputs:\n  - {kind: hidden}\n  - {kind: pooled, name: sentence_embedding, pool: mean}\n")
    return spec
