"""`specc export-weights` and `specc.save_weights`: weights out of specc and back into a build
(`specc import hf` from the command line is tests/importers/test_hf_import.py's)."""
from __future__ import annotations

import numpy as np
import torch
from click.testing import CliRunner

import specc
from specc.cli import main
from specc.runtime import Session

from tests.helpers.spectext import DEC


def test_export_weights_writes_what_the_build_uses(tmp_path):
    spec = tmp_path / "dec.yaml"
    spec.write_text(DEC)
    res = CliRunner().invoke(main, ["export-weights", str(spec), "-o", str(tmp_path / "w.safetensors"), "--seed", "3"])
    assert res.exit_code == 0, res.output
    from safetensors.torch import load_file

    got = load_file(str(tmp_path / "w.safetensors"))
    want = dict(specc.to_torch(spec, seed=3).named_parameters())
    assert got.keys() == want.keys()
    assert all(torch.equal(got[k], want[k].detach()) for k in got)
    other = dict(specc.to_torch(spec, seed=4).named_parameters())
    assert not all(torch.equal(got[k], other[k].detach()) for k in got)


def test_export_weights_refuses_other_suffixes_and_missing_dirs(tmp_path):
    spec = tmp_path / "dec.yaml"
    spec.write_text(DEC)
    res = CliRunner().invoke(main, ["export-weights", str(spec), "-o", str(tmp_path / "w.bin")])
    assert res.exit_code == 2 and ".safetensors" in res.output
    res = CliRunner().invoke(main, ["export-weights", str(spec), "-o", str(tmp_path / "nope" / "w.safetensors")])
    assert res.exit_code == 1 and "no such directory" in res.output
    assert "Traceback" not in res.output


def test_a_model_trained_in_torch_is_saved_and_rebuilt(tmp_path):
    """Train a few steps from specc.to_torch, save_weights, build with --weights: onnxruntime
    computes the trained model, not the initial one."""
    spec = tmp_path / "dec.yaml"
    spec.write_text(DEC)
    model = specc.to_torch(spec, seed=0).train()
    initial = {k: v.detach().clone() for k, v in model.named_parameters()}
    opt = torch.optim.AdamW(model.parameters(), lr=1e-2)
    ids = torch.randint(0, 50, (4, 12), generator=torch.Generator().manual_seed(0))
    for _ in range(5):
        logits = model(input_ids=ids[:, :-1])["logits"]
        loss = torch.nn.functional.cross_entropy(logits.reshape(-1, logits.shape[-1]), ids[:, 1:].reshape(-1))
        opt.zero_grad()
        loss.backward()
        opt.step()
    model.eval()
    specc.save_weights(model, tmp_path / "trained.safetensors")
    res = CliRunner().invoke(main, ["build", str(spec), "-o", str(tmp_path / "out"), "--weights",
                                    str(tmp_path / "trained.safetensors"), "--quiet"])
    assert res.exit_code == 0, res.output
    probe = [[3, 1, 4, 1, 5, 9]]
    got = Session(tmp_path / "out").run(input_ids=probe)["logits"]
    with torch.no_grad():
        trained = model(input_ids=torch.tensor(probe))["logits"].numpy()
        fresh = specc.to_torch(spec, seed=0)
        for k, p in fresh.named_parameters():
            assert torch.equal(p, initial[k])
        untrained = fresh(input_ids=torch.tensor(probe))["logits"].numpy()
    assert float(np.abs(got - trained).max()) < 1e-4
    assert float(np.abs(got - untrained).max()) > 1e-2
