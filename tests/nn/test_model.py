"""The compiled module: every kind builds and runs; names and counts match the contract; the KV
cache reproduces a full pass; weights load strictly; padding does not leak; training works."""
from __future__ import annotations

import hashlib
import math

import pytest
import torch

import specc
from specc.errors import WeightsError
from specc.spec.costs import inspect_spec, parameter_shapes
from specc.spec import resolve
from specc.weights import save_module

from tests.helpers.speclib import DECODER_KINDS, KINDS, TORCH_DECODER_KINDS, TORCH_KINDS, tiny

ALL_KINDS = {**KINDS, **TORCH_KINDS}


def _inputs(model, b=2, t=7, seed=0):
    g = torch.Generator().manual_seed(seed)
    r = model.resolved
    ids = torch.randint(0, r.vocab.size, (b, t), generator=g)
    if r.architecture == "encoder-decoder":
        dec = torch.randint(0, r.target_vocab_size, (b, 5), generator=g)
        return {"input_ids": ids, "attention_mask": torch.ones_like(ids), "decoder_input_ids": dec}
    return {"input_ids": ids}


@pytest.mark.parametrize("kind", list(ALL_KINDS))
def test_every_kind_builds_runs_and_matches_the_name_contract(kind):
    spec = tiny(ALL_KINDS[kind])
    model = specc.to_torch(spec, seed=0)
    r = resolve(spec)
    # the parameter-name contract (docs/weights.md) is exactly the module's parameters
    assert {n: tuple(p.shape) for n, p in model.named_parameters()} == dict(parameter_shapes(r))
    assert inspect_spec(r)["parameters"] == sum(p.numel() for p in model.parameters())
    with torch.no_grad():
        out = model(**_inputs(model))
    for sig in r.graphs[-1].outputs:
        if sig.name.startswith("present."):
            continue
        assert sig.name in out
        got = tuple(out[sig.name].shape)
        assert all(isinstance(d, str) or d == g for d, g in zip(sig.dims, got)), (sig, got)
        assert torch.isfinite(out[sig.name]).all()


@pytest.mark.parametrize("kind", list(ALL_KINDS))
def test_fused_attention_computes_what_the_written_out_form_does(kind, monkeypatch):
    """Eager attention takes torch's scaled_dot_product_attention where it can; torch.export records
    the op-by-op form. Both give the same outputs in every verification case of every kind (left
    padding with its fully masked rows, caches, one token, the longest), and the fused kernel is
    really taken for the dot-product scores."""
    from specc.export.verify import reference_outputs
    from specc.nn import attention

    r = resolve(tiny(ALL_KINDS[kind]))
    model = specc.to_torch(r, seed=0)
    calls = []
    fused = attention.Attention._fused_attention
    monkeypatch.setattr(attention.Attention, "_fused_attention", lambda self, *a: calls.append(1) or fused(self, *a))
    got = reference_outputs(r, model)
    monkeypatch.setattr(attention.Attention, "_fused", lambda self, q, rel_k: False)
    want = reference_outputs(r, model)
    stacks = [st for st in (r.encoder, r.decoder) if st is not None]
    attentions = [a for st in stacks for layer in st.layers for a in (layer.attention, layer.cross_attention) if a]
    # the fused kernel takes a dot-product score with nothing added to it but the mask: no soft cap,
    # no sinks, and (self-attention) no positions in the scores
    eligible = any(a.score != "additive" and a.softcap is None and not a.sinks
                   and (a.cross or r.position.kind not in ("relative", "alibi", "bucketed")) for a in attentions)
    assert bool(calls) == eligible, (kind, len(calls))
    assert got.keys() == want.keys()
    for key in want:
        for name in want[key]:
            torch.testing.assert_close(torch.from_numpy(got[key][name]), torch.from_numpy(want[key][name]),
                                       rtol=1e-5, atol=1e-5, msg=lambda m: f"{kind} {key} {name}: {m}")


@pytest.mark.fresh_export
def test_attention_is_written_out_while_exporting(monkeypatch):
    """torch.export never records the fused kernel: the ONNX graph holds the op-by-op form."""
    from specc.export import onnx as onnx_export
    from specc.nn import attention

    r = resolve(tiny(KINDS["decoder-default"]))
    model = specc.to_torch(r, seed=0)
    monkeypatch.setattr(attention.Attention, "_fused_attention", lambda *a: pytest.fail("fused while exporting"))
    sig = r.graphs[0]
    program = onnx_export.export_graph(model, sig, onnx_export.example_inputs(r, sig))
    assert any(node.op_type == "Softmax" for node in program.model.graph)


def test_same_seed_same_weights_other_seed_other_weights():
    spec = tiny()
    a, b, c = (specc.to_torch(spec, seed=s) for s in (3, 3, 4))
    sa, sb, sc = a.state_dict(), b.state_dict(), c.state_dict()
    assert all(torch.equal(sa[k], sb[k]) for k in sa)
    assert any(not torch.equal(sa[k], sc[k]) for k in sa if k.endswith("q.weight"))


def test_seeded_weights_follow_the_documented_draws():
    """init_weights, independently: each parameter from its own generator seeded by 64 bits of
    sha256("seed/name"), N(0, 0.02) for weights (0.02 / sqrt(2 x layers) for the projections
    added to the residual stream), zeros for biases, ones for norm weights. The
    default torch initialisation that construction skips leaves nothing behind."""
    model = specc.to_torch(tiny(), seed=11)
    for name, p in sorted(model.named_parameters()):
        gen = torch.Generator().manual_seed(int.from_bytes(hashlib.sha256(f"11/{name}".encode()).digest()[:8], "little"))
        if "norm." in name:
            assert torch.equal(p, torch.full_like(p, 1.0 if name.endswith(".weight") else 0.0)), name
        elif name.endswith(".bias"):
            assert torch.equal(p, torch.zeros_like(p)), name
        elif name.endswith(("attention.o.weight", "ffn.down.weight")):  # GPT-2's scaled residual init
            layers = len(getattr(model, name.split(".")[0]).layers)
            assert torch.equal(p, 0.02 / math.sqrt(2 * layers) * torch.randn(p.shape, generator=gen)), name
        else:
            assert torch.equal(p, 0.02 * torch.randn(p.shape, generator=gen)), name


def test_seeded_experts_follow_the_documented_draws():
    """Routed experts and their router draw as the dense FFN's projections do: the stacked down
    projections and the shared expert's added to the residual stream scaled by 1 / sqrt(2 x layers),
    biases (the experts', the router's, the selection bias) zero, sinks N(0, 0.02)."""
    model = specc.to_torch(tiny(TORCH_KINDS["moe-gpt-oss"]), seed=11)
    shared = specc.to_torch(tiny(TORCH_KINDS["moe-sigmoid-groups-shared"]), seed=11)
    for m in (model, shared):
        layers = len(m.decoder.layers)
        for name, p in sorted(m.named_parameters()):
            gen = torch.Generator().manual_seed(int.from_bytes(hashlib.sha256(f"11/{name}".encode()).digest()[:8], "little"))
            if name.endswith(("_bias", ".bias")) and "norm" not in name:
                assert torch.equal(p, torch.zeros_like(p)), name
            elif name.endswith(("ffn.experts.down", "ffn.shared.down.weight")):
                assert torch.equal(p, 0.02 / math.sqrt(2 * layers) * torch.randn(p.shape, generator=gen)), name
            elif name.endswith(("ffn.experts.up", "router.weight", "attention.sinks")):
                assert torch.equal(p, 0.02 * torch.randn(p.shape, generator=gen)), name


def test_default_initialisation_is_skipped_only_while_constructing():
    from specc.nn.blocks import default_init_skipped

    reset = torch.nn.Linear.reset_parameters
    with pytest.raises(RuntimeError, match="inside"):
        with default_init_skipped():
            assert torch.nn.Linear.reset_parameters is not reset
            raise RuntimeError("inside")
    assert torch.nn.Linear.reset_parameters is reset
    torch.manual_seed(0)
    assert torch.nn.Linear(64, 64).weight.abs().max() > 0.01  # torch's own kaiming-uniform draw


def _greedy_step_check(model, ids):
    """Max |one full pass - token by token with the cache| of the logits; each step gets the mask
    over the whole sequence so far (a window cache alone does not say the sequence's length)."""
    with torch.no_grad():
        full = model(input_ids=ids)["logits"]
        past, steps = {}, []
        for t in range(ids.shape[1]):
            mask = torch.ones(ids.shape[0], t + 1, dtype=torch.long)
            out = model(input_ids=ids[:, t : t + 1], attention_mask=mask, use_cache=True, **past)
            steps.append(out["logits"])
            past = {k.replace("present", "past_key_values", 1): v for k, v in out.items() if k.startswith("present.")}
    return (full - torch.cat(steps, 1)).abs().max().item()


# LongRoPE picks its frequencies by the sequence's length at each call: a cache filled within the
# original length keeps the short set's keys (tests/nn/test_rotary_scaling.py checks it apart)
@pytest.mark.parametrize("kind", [k for k in DECODER_KINDS + TORCH_DECODER_KINDS
                                  if k not in ("outputs-decoder", "rotary-longrope")])
def test_incremental_decoding_equals_one_full_pass(kind):
    model = specc.to_torch(tiny(ALL_KINDS[kind]), seed=1)
    ids = torch.randint(0, 61, (2, 11), generator=torch.Generator().manual_seed(0))
    assert _greedy_step_check(model, ids) <= 1e-5


@pytest.mark.parametrize("position", ["sinusoidal", "learned", "relative", "rotary", "alibi", "none"])
def test_incremental_decoding_encoder_decoder(position):
    model = specc.to_torch(tiny({**KINDS["encdec-default"], "position": {"kind": position}}), seed=2)
    g = torch.Generator().manual_seed(1)
    src = torch.randint(0, 61, (2, 6), generator=g)
    mask = torch.ones_like(src)
    mask[1, 4:] = 0
    tgt = torch.randint(0, 61, (2, 8), generator=g)
    with torch.no_grad():
        full = model(input_ids=src, attention_mask=mask, decoder_input_ids=tgt)["logits"]
        enc = model.encode(input_ids=src, attention_mask=mask)
        past = {k.replace("present", "past_key_values", 1): v for k, v in enc.items() if k.startswith("present.")}
        steps = []
        for t in range(tgt.shape[1]):
            out = model.decode(input_ids=tgt[:, t : t + 1], encoder_attention_mask=mask, **past)
            steps.append(out["logits"])
            past.update({k.replace("present", "past_key_values", 1): v for k, v in out.items() if k.startswith("present.")})
    assert (full - torch.cat(steps, 1)).abs().max().item() <= 1e-5


@pytest.mark.parametrize("kind", ["local", "overrides", "moe-gpt-oss", "latent-direct-q-window-sinks"])
def test_sliding_layers_keep_a_window_cache(kind):
    """A sliding layer's present is its window (2 or 3 positions) once the sequence is longer, a
    global one's the whole sequence; a left-padded prompt longer than the window then a step from
    that cut cache give the unpadded full pass's logits. (A latent attention's cache, its latent
    and rotary key, is cut alike.)"""
    model = specc.to_torch(tiny(ALL_KINDS[kind]), seed=1)
    first = model.resolved.cache_pair[0]  # key, or latent
    windows = [layer.attention.spec.cache_window for layer in model.decoder.layers]
    ids = torch.randint(1, 61, (1, 7), generator=torch.Generator().manual_seed(2))
    padded = torch.cat([torch.zeros(1, 2, dtype=torch.long), ids[:, :6]], 1)
    mask = torch.cat([torch.zeros(1, 2, dtype=torch.long), torch.ones(1, 6, dtype=torch.long)], 1)
    with torch.no_grad():
        full = model(input_ids=ids)["logits"]
        pre = model(input_ids=padded, attention_mask=mask, use_cache=True)
        assert [pre[f"present.{i}.{first}"].shape[2] for i in range(len(windows))] == [w or 8 for w in windows]
        past = {k.replace("present", "past_key_values", 1): v for k, v in pre.items() if k.startswith("present.")}
        step = model(input_ids=ids[:, 6:], attention_mask=torch.cat([mask, torch.ones(1, 1, dtype=torch.long)], 1), **past)
    assert torch.allclose(pre["logits"][:, 2:], full[:, :6], atol=1e-5)
    assert torch.allclose(step["logits"][:, -1], full[:, -1], atol=1e-5)
    # without a mask: the length from a whole cache, or (every cache a full window) refused
    with torch.no_grad():
        pre = model(input_ids=ids[:, :6], use_cache=True)
        past = {k.replace("present", "past_key_values", 1): v for k, v in pre.items() if k.startswith("present.")}
        if all(windows):
            with pytest.raises(TypeError, match="give attention_mask"):
                model(input_ids=ids[:, 6:], **past)
        else:
            assert torch.allclose(model(input_ids=ids[:, 6:], **past)["logits"][:, -1], full[:, -1], atol=1e-5)


def test_prefill_then_decode_step_with_cache():
    model = specc.to_torch(tiny(KINDS["rotary"]), seed=0)
    ids = torch.randint(0, 61, (1, 10))
    with torch.no_grad():
        full = model(input_ids=ids)["logits"]
        pre = model(input_ids=ids[:, :9], use_cache=True)
        past = {k.replace("present", "past_key_values", 1): v for k, v in pre.items() if k.startswith("present.")}
        step = model(input_ids=ids[:, 9:], **past)["logits"]
    assert torch.allclose(step[:, -1], full[:, -1], atol=1e-5)


@pytest.mark.parametrize("kind", ["decoder-default", "rotary", "alibi", "relative", "sinusoidal"])
def test_left_padding_does_not_change_real_tokens(kind):
    """A left-padded row computes what the unpadded sequence computes (positions count real tokens)."""
    model = specc.to_torch(tiny(KINDS[kind]), seed=0)
    ids = torch.randint(1, 61, (1, 6))
    padded = torch.cat([torch.zeros(1, 3, dtype=torch.long), ids], 1)
    mask = torch.cat([torch.zeros(1, 3, dtype=torch.long), torch.ones(1, 6, dtype=torch.long)], 1)
    with torch.no_grad():
        alone = model(input_ids=ids)["logits"]
        pad = model(input_ids=padded, attention_mask=mask)["logits"][:, 3:]
    assert torch.allclose(alone, pad, atol=1e-5)


def test_encoder_padding_does_not_change_real_tokens():
    model = specc.to_torch(tiny(KINDS["outputs-encoder"]), seed=0)
    ids = torch.randint(1, 61, (1, 5))
    padded = torch.cat([ids, torch.zeros(1, 4, dtype=torch.long)], 1)
    mask = (torch.arange(9) < 5).long().unsqueeze(0)
    with torch.no_grad():
        a = model(input_ids=ids)
        b = model(input_ids=padded, attention_mask=mask)
    assert torch.allclose(a["last_hidden_state"], b["last_hidden_state"][:, :5], atol=1e-5)
    for name in ("cls_mean", "cls_last", "cls", "pooler_output"):
        assert torch.allclose(a[name], b[name], atol=1e-5), name


def test_unknown_input_is_a_clear_error():
    model = specc.to_torch(tiny())
    with pytest.raises(TypeError, match="unexpected input"):
        model(input_ids=torch.zeros(1, 2, dtype=torch.long), decoder_input_ids=torch.zeros(1, 2, dtype=torch.long))


def test_weights_roundtrip_and_strict_checks(tmp_path):
    spec = tiny(KINDS["gqa"])
    model = specc.to_torch(spec, seed=5)
    path = tmp_path / "w.safetensors"
    save_module(model, path)
    again = specc.to_torch(spec, weights=path, seed=0)
    assert all(torch.equal(a, b) for a, b in zip(model.state_dict().values(), again.state_dict().values()))

    other = specc.to_torch(tiny(KINDS["mqa"]), seed=0)  # k/v shapes differ
    bad = tmp_path / "bad.safetensors"
    save_module(other, bad)
    with pytest.raises(WeightsError, match="wrong shape"):
        specc.to_torch(spec, weights=bad)
    extra = specc.to_torch(tiny(KINDS["no-bias"]), seed=0)
    missing = tmp_path / "missing.safetensors"
    save_module(extra, missing)
    with pytest.raises(WeightsError, match="missing"):
        specc.to_torch(spec, weights=missing)
    truncated = tmp_path / "trunc.safetensors"
    truncated.write_bytes(path.read_bytes()[:200])
    with pytest.raises(WeightsError, match="cannot read"):
        specc.to_torch(spec, weights=truncated)
    (tmp_path / "w.bin").write_bytes(b"not read")
    with pytest.raises(WeightsError, match="must be a .safetensors file"):
        specc.to_torch(spec, weights=tmp_path / "w.bin")


def test_spec_weights_key_is_relative_to_the_spec(tmp_path):
    spec = tiny()
    model = specc.to_torch(spec, seed=9)
    save_module(model, tmp_path / "trained.safetensors")
    text = (tmp_path / "m.yaml")
    from specc.spec.dump import spec_to_yaml

    text.write_text(spec_to_yaml(spec.model_copy(update={"weights": "trained.safetensors"})))
    loaded = specc.to_torch(str(text))
    assert torch.equal(loaded.state_dict()["decoder.layers.0.attention.q.weight"], model.state_dict()["decoder.layers.0.attention.q.weight"])


@pytest.mark.parametrize("kind", list(ALL_KINDS))
def test_training_backpropagates_through_every_kind(kind):
    spec = tiny({**ALL_KINDS[kind], "dropout": 0.1})
    model = specc.to_torch(spec, seed=0).train()
    inputs = _inputs(model, b=2, t=8)
    out = model(**inputs)
    loss = sum(v.float().pow(2).mean() for k, v in out.items() if not k.startswith("present."))
    loss.backward()
    for name, p in model.named_parameters():
        if name.endswith("router.selection_bias"):  # it moves the choice of experts alone: no gradient
            assert p.grad is None, name           # reaches it (DeepSeek-V3 updates it by a balancing rule)
            continue
        assert p.grad is not None, f"{name} got no gradient"
        assert torch.isfinite(p.grad).all(), name


def test_a_few_steps_of_training_lower_the_loss():
    model = specc.to_torch(tiny(KINDS["rotary"]), seed=0).train()
    ids = torch.randint(0, 61, (4, 12), generator=torch.Generator().manual_seed(0))
    opt = torch.optim.AdamW(model.parameters(), lr=3e-3)
    losses = []
    for _ in range(40):
        logits = model(input_ids=ids[:, :-1])["logits"]
        loss = torch.nn.functional.cross_entropy(logits.reshape(-1, 61), ids[:, 1:].reshape(-1))
        opt.zero_grad()
        loss.backward()
        opt.step()
        losses.append(loss.item())
    assert losses[-1] < 0.5 * losses[0]


def test_module_is_in_eval_mode_and_deterministic():
    model = specc.to_torch(tiny({"dropout": 0.5}))
    assert not model.training
    ids = torch.randint(0, 61, (1, 6))
    with torch.no_grad():
        assert torch.equal(model(input_ids=ids)["logits"], model(input_ids=ids)["logits"])
