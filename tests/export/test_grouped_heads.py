"""Grouped key-value heads (GQA) in the exported graph: each kv head's cached keys and values go
into the attention products as they are, broadcast over its query heads, never repeated
H/Hkv times (a copy of the whole cache every decode step; what that cost: docs/benchmarks.md).
The computation itself is checked by every GQA build's verification and the Hugging Face import
tests (LLaMA, Qwen2, Mistral, Gemma with grouped heads)."""
from __future__ import annotations

import onnx
import pytest

import specc
from specc.spec.load import loads_spec

pytest.importorskip("onnxruntime")


@pytest.mark.parametrize("text", [
    "extends: tiny-llama",  # 4 query heads over 2 kv heads
    "extends: tiny-llama\ndecoder: {attention: {score: bilinear}}",
])
def test_a_gqa_decoder_reads_its_cache_into_the_products_unrepeated(tmp_path, text):
    result = specc.build(loads_spec(f"specc: 1\nname: g\n{text}\n"), tmp_path / "b")
    assert result.verification["passed"] is True
    graph = onnx.load(str(result.out_dir / "model.onnx")).graph
    assert not [n for n in graph.node if n.op_type in ("Expand", "Tile")]
    readers = {}
    for n in graph.node:
        for i in n.input:
            readers.setdefault(i, []).append(n.op_type)
    layers = sum(1 for o in graph.output if o.name.startswith("present.") and o.name.endswith(".value"))
    assert layers == 2
    for i in range(layers):
        # [B,Hkv,1,S,d]: a view for the products, broadcast over each kv head's query heads
        assert readers[f"present.{i}.value"] == ["Unsqueeze"] and readers[f"present.{i}.key"] == ["Unsqueeze"]
        (value,) = [n for n in graph.node if n.op_type == "Unsqueeze" and n.input[0] == f"present.{i}.value"]
        (key,) = [n for n in graph.node if n.op_type == "Unsqueeze" and n.input[0] == f"present.{i}.key"]
        assert readers[value.output[0]] == ["MatMul"]
        assert readers[key.output[0]] == ["Transpose"]  # k^T; onnxruntime folds it into its MatMul


def test_grouped_heads_with_projected_keys_verify(tmp_path):
    """Linformer projects the keys of each query head: its kv heads are repeated first, once."""
    spec = loads_spec("specc: 1\nname: g\nextends: tiny-bert\n"
                      "encoder: {attention: {heads: 4, kv_heads: 2, pattern: {kind: linformer, k: 8}}}\n")
    assert specc.build(spec, tmp_path / "b").verification["passed"] is True


@pytest.mark.parametrize("text", [
    "extends: tiny-gpt2\ndecoder: {attention: {score: bilinear}}",  # one kv head per head: written as before
    "extends: tiny-llama\ndecoder: {attention: {score: additive}}",  # additive scores: the heads repeated
])
def test_other_attention_forms_still_verify(tmp_path, text):
    assert specc.build(loads_spec(f"specc: 1\nname: g\n{text}\n"), tmp_path / "b").verification["passed"] is True
