"""`specc import gguf`: small LLaMA- and Qwen2-shaped models written as GGUF files the way
llama.cpp's converter writes them (q/k rows permuted for llama, fp32 or Q8_0 blocks), imported,
built and run: an fp32 file gives the Hugging Face model's logits, a Q8_0 file gives what
transformers' own GGUF loading computes from it (both within 1e-4), and greedy tokens match."""
from __future__ import annotations

import numpy as np
import pytest
import torch

import specc
from specc.cli import main as cli
from specc.importers.gguf import import_gguf
from specc.importers.hf import CheckpointError
from specc.runtime import Session

transformers = pytest.importorskip("transformers")
gguf = pytest.importorskip("gguf", reason="the gguf package (make install-real-models)")

PROMPT = [5, 7, 9, 11, 3]
THETA = 500.0
LAYER = {"input_layernorm": "attn_norm", "self_attn.q_proj": "attn_q", "self_attn.k_proj": "attn_k",
         "self_attn.v_proj": "attn_v", "self_attn.o_proj": "attn_output", "post_attention_layernorm": "ffn_norm",
         "mlp.gate_proj": "ffn_gate", "mlp.up_proj": "ffn_up", "mlp.down_proj": "ffn_down"}
TOP = {"model.embed_tokens": "token_embd", "model.norm": "output_norm", "lm_head": "output"}


def _hf(arch: str):
    torch.manual_seed(0)
    common = dict(vocab_size=99, hidden_size=32, num_hidden_layers=2, num_attention_heads=4, num_key_value_heads=2,
                  intermediate_size=64, rope_theta=THETA, initializer_range=0.5, bos_token_id=1, eos_token_id=2,
                  max_position_embeddings=64, tie_word_embeddings=False)
    if arch == "llama":
        return transformers.LlamaForCausalLM(transformers.LlamaConfig(**common)).eval()
    model = transformers.Qwen2ForCausalLM(transformers.Qwen2Config(**common)).eval()
    with torch.no_grad():  # Hugging Face starts q/k/v biases at zero; checkpoints do not
        for name, p in model.named_parameters():
            if name.endswith(".bias"):
                p.normal_(0.0, 0.5)
    return model


def _gguf_name(hf: str) -> str:
    base, kind = hf.rsplit(".", 1)
    if base in TOP:
        return f"{TOP[base]}.{kind}"
    _, _, i, rest = base.split(".", 3)
    return f"blk.{i}.{LAYER[rest]}.{kind}"


def _permute(w: np.ndarray, heads: int) -> np.ndarray:
    """llama.cpp's converter: each head's halves of q/k rows interleaved (its rotary layout)."""
    rows, cols = w.shape
    return w.reshape(heads, 2, rows // heads // 2, cols).swapaxes(1, 2).reshape(rows, cols)


def write_gguf(model, arch: str, path, qtype: str = "F32") -> None:
    """MODEL as a GGUF file as llama.cpp's converter writes one (a placeholder vocabulary)."""
    cfg = model.config
    w = gguf.GGUFWriter(path, arch)
    w.add_context_length(cfg.max_position_embeddings)
    w.add_embedding_length(cfg.hidden_size)
    w.add_block_count(cfg.num_hidden_layers)
    w.add_feed_forward_length(cfg.intermediate_size)
    w.add_head_count(cfg.num_attention_heads)
    w.add_head_count_kv(cfg.num_key_value_heads)
    w.add_rope_freq_base(THETA)
    w.add_layer_norm_rms_eps(cfg.rms_norm_eps)
    tokens = ["<unk>", "<s>", "</s>", *(f"t{i}" for i in range(3, cfg.vocab_size))]
    w.add_tokenizer_model("llama")
    w.add_token_list(tokens)
    w.add_token_scores([0.0] * len(tokens))
    w.add_token_types([2, 3, 3] + [1] * (len(tokens) - 3))
    w.add_bos_token_id(1)
    w.add_eos_token_id(2)
    for name, t in model.state_dict().items():
        t = t.numpy().astype(np.float32)
        if arch == "llama" and name.endswith(("q_proj.weight", "k_proj.weight")):
            t = _permute(t, cfg.num_attention_heads if "q_proj" in name else cfg.num_key_value_heads)
        if qtype == "Q8_0" and t.ndim == 2:
            w.add_tensor(_gguf_name(name), gguf.quants.quantize(t, gguf.GGMLQuantizationType.Q8_0),
                         raw_dtype=gguf.GGMLQuantizationType.Q8_0)
        else:
            w.add_tensor(_gguf_name(name), t)
    w.write_header_to_file()
    w.write_kv_data_to_file()
    w.write_tensors_to_file()
    w.close()


def _logits(model, ids: list[int]) -> np.ndarray:
    with torch.no_grad():
        return model(input_ids=torch.tensor([ids])).logits.numpy()


def _greedy(model, ids: list[int], new: int = 8) -> list[int]:
    with torch.no_grad():
        out = model.generate(input_ids=torch.tensor([ids]), attention_mask=torch.ones(1, len(ids), dtype=torch.long),
                             max_new_tokens=new, do_sample=False, pad_token_id=0)
    return out[0, len(ids):].tolist()


@pytest.mark.parametrize("arch,qtype", [("llama", "F32"), ("llama", "Q8_0"), ("qwen2", "F32")])
def test_a_gguf_file_imports_to_the_model_it_holds(tmp_path, arch, qtype):
    model = _hf(arch)
    path = tmp_path / f"tiny-{arch}-{qtype}.gguf"
    write_gguf(model, arch, path, qtype)
    # fp32: the model itself; Q8_0: what transformers' own GGUF loading computes from the file
    ref = model if qtype == "F32" else transformers.AutoModelForCausalLM.from_pretrained(
        tmp_path, gguf_file=path.name).eval()
    spec, weights = import_gguf(path, tmp_path / "m.yaml")
    out = tmp_path / "build"
    specc.build(spec, out, progress=None)
    s = Session(out)
    got = s.run(input_ids=[PROMPT])["logits"]
    assert np.abs(got - _logits(ref, PROMPT)).max() <= 1e-4
    want = _greedy(ref, PROMPT)
    assert len(set(want)) > 2
    assert s.generate(PROMPT, max_new_tokens=8).new_ids[0] == want


def test_what_cannot_be_imported_is_refused_naming_it(tmp_path):
    w = gguf.GGUFWriter(tmp_path / "x.gguf", "gpt2")
    w.add_tensor("token_embd.weight", np.zeros((8, 4), np.float32))
    w.write_header_to_file()
    w.write_kv_data_to_file()
    w.write_tensors_to_file()
    w.close()
    with pytest.raises(CheckpointError, match="general.architecture 'gpt2' has no importer; specc import gguf reads"):
        import_gguf(tmp_path / "x.gguf", tmp_path / "m.yaml")
    (tmp_path / "y.gguf").write_bytes(b"not a gguf file at all")
    with pytest.raises(CheckpointError, match="y.gguf: not a GGUF file"):
        import_gguf(tmp_path / "y.gguf", tmp_path / "m.yaml")
    assert not list(tmp_path.glob("m.*"))


def test_cli_import_gguf(tmp_path, capsys):
    path = tmp_path / "tiny.gguf"
    write_gguf(_hf("llama"), "llama", path)
    with pytest.raises(SystemExit) as done:
        cli(["import", "gguf", str(path), "-o", str(tmp_path / "m.yaml"), "--json"])
    assert done.value.code in (0, None)
    assert '"weights"' in capsys.readouterr().out
    with pytest.raises(SystemExit) as done:  # exists: refused without --force
        cli(["import", "gguf", str(path), "-o", str(tmp_path / "m.yaml")])
    assert done.value.code != 0
