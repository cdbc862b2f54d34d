"""`specc import hf` holds one tensor at a time: a sharded bf16 checkpoint is read through the
shards' headers and memory maps, converted tensor by tensor and written by a streaming
safetensors writer whose bytes are safetensors' own."""
from __future__ import annotations

import subprocess
import sys
import textwrap
from pathlib import Path

import pytest
import torch
from safetensors.torch import load_file, save_file

from specc.importers.hf import import_hf
from specc.weights.io import SafetensorsFile, write_safetensors

from tests.helpers import shards


def test_the_streaming_writer_writes_safetensors_own_bytes(tmp_path):
    g = torch.Generator().manual_seed(0)
    tensors = {"b.w": torch.randn(2, 3, generator=g), "a.w": torch.randn(3, generator=g).to(torch.bfloat16),
               "h": torch.randn(5, generator=g).half(), "d": torch.randn(7, generator=g, dtype=torch.float64),
               "empty": torch.zeros(0), "i": torch.arange(4)}
    save_file(tensors, str(tmp_path / "lib.safetensors"), metadata={"format": "pt"})
    asked = []
    write_safetensors({k: v.to("meta") for k, v in tensors.items()}, lambda n: asked.append(n) or tensors[n],
                      tmp_path / "ours.safetensors")
    assert (tmp_path / "ours.safetensors").read_bytes() == (tmp_path / "lib.safetensors").read_bytes()
    assert sorted(asked) == sorted(tensors)  # each made once
    lazy = SafetensorsFile(tmp_path / "ours.safetensors")
    assert lazy.meta("a.w").dtype == torch.bfloat16 and tuple(lazy.meta("b.w").shape) == (2, 3)
    assert torch.equal(lazy["d"], tensors["d"])


def test_a_tensor_unlike_its_header_leaves_no_file(tmp_path):
    from specc.errors import WeightsError

    with pytest.raises(WeightsError, match="came as"):
        write_safetensors({"x": torch.empty(3, device="meta")}, lambda n: torch.zeros(4), tmp_path / "x.safetensors")
    assert list(tmp_path.iterdir()) == []


def test_a_sharded_bf16_checkpoint_imports_tensor_by_tensor(tmp_path):
    ckpt = tmp_path / "ckpt"
    shards.write_llama(ckpt, layers=2, d=64, heads=4, kv_heads=2, ff=96, vocab=300, shard_bytes=40_000)
    assert len(list(ckpt.glob("model-*-of-*.safetensors"))) >= 3
    spec, weights = import_hf(ckpt, tmp_path / "m.yaml")
    got = load_file(str(weights))
    assert got["embeddings.tokens.weight"].dtype == torch.bfloat16  # the checkpoint's dtype, not widened
    names = dict(shards.llama_names(2, 64, 32, 96, 300))
    want = {n: shards.tensor(n, s, torch.bfloat16) for n, s in names.items()}
    assert torch.equal(got["embeddings.tokens.weight"], want["model.embed_tokens.weight"])
    assert torch.equal(got["decoder.layers.1.ffn.down.weight"], want["model.layers.1.mlp.down_proj.weight"])
    assert torch.equal(got["decoder.layers.0.attention.k.weight"], want["model.layers.0.self_attn.k_proj.weight"])
    assert sum(t.numel() for t in got.values()) == sum(t.numel() for t in want.values())


def _peak_mib(code: str) -> float:
    """The peak resident memory of a fresh Python running `code` (VmHWM, its own: exec resets it)."""
    script = textwrap.dedent(code) + textwrap.dedent("""
        for line in open("/proc/self/status"):
            if line.startswith("VmHWM:"):
                print(int(line.split()[1]) / 1024)
    """)
    out = subprocess.run([sys.executable, "-c", script], capture_output=True, text=True, check=True,
                         cwd=Path(__file__).parent)
    return float(out.stdout.strip().splitlines()[-1])


@pytest.mark.skipif(not Path("/proc/self/status").exists(), reason="reads VmHWM from /proc")
def test_import_memory_grows_with_the_largest_tensor_not_the_checkpoint(tmp_path):
    ckpt = tmp_path / "ckpt"
    size = shards.write_llama(ckpt, layers=4, d=1024, heads=8, kv_heads=8, ff=2816, vocab=32000,
                              shard_bytes=100 << 20)
    largest = 32000 * 1024 * 2
    base = _peak_mib("import torch, specc.importers.hf, specc.weights.io")
    peak = _peak_mib(f"from specc.importers.hf import import_hf; import_hf({str(ckpt)!r}, {str(tmp_path / 'm.yaml')!r})")
    grew = peak - base
    # whole, the checkpoint is 232 MiB; one tensor at a time, the import holds the largest (62.5
    # MiB) and the tied-alias and header work beside it
    assert grew < (size / 2**20) / 2, (grew, base, size / 2**20)
    assert grew < 3 * largest / 2**20, (grew, largest / 2**20)


@pytest.mark.slow
@pytest.mark.skipif(not Path("/proc/self/status").exists(), reason="reads VmHWM from /proc")
def test_a_7b_shaped_checkpoint_imports_within_6_gib(tmp_path):
    """Llama-2-7B's shape in bf16 (13.5 GB in 5 GB shards, as Hugging Face writes it), written a
    tensor at a time, imported by a fresh process whose peak resident memory stays under the
    streamed build's bound (the streamed-build issue: 6 GiB)."""
    ckpt = tmp_path / "llama-2-7b"
    size = shards.write_llama(ckpt, layers=32, d=4096, heads=32, kv_heads=32, ff=11008, vocab=32000,
                              shard_bytes=5 << 30)
    assert size > 13e9
    peak = _peak_mib(f"from specc.importers.hf import import_hf; import_hf({str(ckpt)!r}, {str(tmp_path / 'm.yaml')!r})")
    assert peak < 6 * 1024, peak
    lazy = SafetensorsFile(tmp_path / "m.safetensors")
    assert len(lazy) == 32 * 9 + 3 and lazy.meta("embeddings.tokens.weight").dtype == torch.bfloat16
    assert torch.equal(lazy["decoder.layers.31.ffn.down.weight"],
                       shards.tensor("model.layers.31.mlp.down_proj.weight", (4096, 11008), torch.bfloat16))
