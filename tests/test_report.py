"""Reports: aligned plain text when piped, rich tables on a terminal, the numbers of --json."""
from __future__ import annotations

import io
import json
import re

import pytest
from click.testing import CliRunner

from specc.cli import main
from specc.report import Table, build_report, fusions, inspect_report, render

pytestmark = pytest.mark.xdist_group("test_report")  # one worker: the module's shared builds are made once

ANSI = re.compile(r"\x1b\[")
CELL = re.compile(r"\S+(?: \S+)*")  # cells are separated by two or more spaces


def _tables(text: str, headers: dict[str, str]) -> dict[str, list[list[tuple[int, int, str]]]]:
    """{title: [row cells as (start, end, text)]}: the header line and the rows after it, up to
    the first line that does not have the header's cell count."""
    lines = text.splitlines()
    out = {}
    for title, first in headers.items():
        i = next(k for k, l in enumerate(lines) if l.startswith(first) and k > 0 and lines[k - 1].startswith(title))
        header = [(m.start(), m.end(), m.group()) for m in CELL.finditer(lines[i])]
        rows = [header]
        for line in lines[i + 1:]:
            cells = [(m.start(), m.end(), m.group()) for m in CELL.finditer(line)]
            if len(cells) != len(header) or line.startswith(" "):
                break
            rows.append(cells)
        out[title] = rows
    return out


def _assert_aligned(rows):
    """The first column starts at 0 in every row; every other column ends at the same offset."""
    assert len(rows) > 1
    header = rows[0]
    for cells in rows[1:]:
        assert cells[0][0] == 0
        for col in range(1, len(header)):
            assert cells[col][1] == header[col][1], (cells, header)


def _n(text: str) -> int:
    return int(text.replace(",", ""))


@pytest.fixture(scope="module")
def runner():
    return CliRunner()


@pytest.mark.parametrize("spec", ["tiny-gpt2", "tiny-transformer"])
def test_inspect_piped_is_aligned_plain_text_with_the_json_numbers(runner, spec):
    text = runner.invoke(main, ["inspect", spec])
    assert text.exit_code == 0, text.output
    facts = json.loads(runner.invoke(main, ["inspect", spec, "--json"]).output)
    out = text.output
    assert not ANSI.search(out)
    assert not any(ch in out for ch in "│┃━─")
    assert out.splitlines()[0] == f"{spec}: {facts['parameters']:,} parameters"
    tables = _tables(out, {f"{spec}:": "component", "layers": "layer"})
    for rows in tables.values():
        _assert_aligned(rows)
    components = {r[0][2]: _n(r[1][2]) for r in tables[f"{spec}:"][1:]}
    assert components == facts["parameters_by_component"]
    layers = tables["layers"][1:]
    assert len(layers) == len(facts["layers"])
    for cells, layer in zip(layers, facts["layers"]):
        assert cells[0][2] == f"{layer['stack']}.{layer['index']}"
        assert _n(cells[1][2]) == layer["parameters"]
        assert _n(cells[2][2]) == layer["flops_per_token"]
    assert f"FLOPs per token at length {facts['length']}: {facts['flops_per_token']:,}" in out


def test_inspect_on_a_terminal_is_a_rich_table():
    from rich.console import Console

    from specc.spec.costs import inspect_spec
    from specc.spec import load_spec, resolve

    facts = inspect_spec(resolve(load_spec("tiny-gpt2")), None)
    buf = io.StringIO()
    render(inspect_report(facts), Console(file=buf, force_terminal=True, width=200))
    out = buf.getvalue()
    assert ANSI.search(out)  # styled
    assert "┃" in out or "│" in out  # boxed
    plain = re.sub(r"\x1b\[[0-9;]*m", "", out)
    for name, n in facts["parameters_by_component"].items():
        assert re.search(rf"{re.escape(name)}\s*│\s*{re.escape(f'{n:,}')}\s*│", plain)
    assert "layers" in plain


@pytest.fixture(scope="module")
def built(runner, tmp_path_factory):
    out_dir = tmp_path_factory.mktemp("report") / "tiny-gpt2"
    res = runner.invoke(main, ["build", "tiny-gpt2", "-o", str(out_dir)])
    assert res.exit_code == 0, res.output
    manifest = json.loads((out_dir / "manifest.json").read_text())
    return res.output, manifest, out_dir


def test_build_summary_piped_is_aligned_with_the_manifest_numbers(runner, built):
    out, manifest, out_dir = built
    assert not ANSI.search(out)
    # a cache hit prints the same summary; its --json is the manifest's facts
    facts = json.loads(runner.invoke(main, ["build", "tiny-gpt2", "-o", str(out_dir), "--json"]).output)
    assert facts["cached"] and facts["parameters"] == manifest["parameters"]
    assert facts["verification"] == manifest["verification"]
    summary = out[out.index("tiny-gpt2 -> "):]
    tables = _tables(summary, {"tiny-gpt2 -> ": "artifact", "verification": "graph", "timings": "stage"})
    for rows in tables.values():
        _assert_aligned(rows)
    assert [r[0][2] for r in tables["tiny-gpt2 -> "][1:]] == [a["path"] for a in manifest["artifacts"]]
    assert f"parameters: {manifest['parameters']:,}" in summary
    v = manifest["verification"]
    assert f"max |onnxruntime - torch| {v['max_abs_diff']:.2e}" in summary
    cases = tables["verification"][1:]
    assert [(c[0][2], c[1][2]) for c in cases] == [(c["graph"], c["case"]) for c in v["cases"]]
    for cells, case in zip(cases, v["cases"]):
        assert float(cells[2][2]) == pytest.approx(max(o["max_abs"] for o in case["outputs"].values()), rel=1e-2)
    assert max(float(c[2][2]) for c in cases) == pytest.approx(v["max_abs_diff"], rel=1e-2)
    stages = {r[0][2]: float(r[1][2]) for r in tables["timings"][1:]}
    assert stages.keys() == manifest["timings_s"].keys()
    for stage, seconds in manifest["timings_s"].items():
        assert stages[stage] == pytest.approx(seconds, abs=0.006)
    # no graph pass fused anything in this build: said explicitly
    assert fusions(manifest) == {}
    assert "fusions: none" in summary.splitlines()
    assert "optimizations: model" in summary


def test_build_summary_lists_the_fusions_the_manifest_records(built):
    _, manifest, out_dir = built
    later = {**manifest, "fusions": {"attention": 2, "gelu": 0},
             "optimizations": [{**manifest["optimizations"][0], "fusions": {"layer_norm": 3}}]}
    buf = io.StringIO()
    from rich.console import Console

    render(build_report(later, str(out_dir)), Console(file=buf, force_terminal=False))
    lines = buf.getvalue().splitlines()
    assert "fusions: attention x2, layer_norm x3" in lines
    assert "fusions: none" not in lines


def test_build_summary_on_a_terminal_is_a_rich_table(built):
    from rich.console import Console

    _, manifest, out_dir = built
    buf = io.StringIO()
    render(build_report(manifest, str(out_dir)), Console(file=buf, force_terminal=True, width=200))
    out = re.sub(r"\x1b\[[0-9;]*m", "", buf.getvalue())
    assert ANSI.search(buf.getvalue())
    assert "│" in out or "┃" in out
    for a in manifest["artifacts"]:
        assert a["sha256"][:12] in out
    assert "fusions: none" in out


def test_plain_table_pads_to_the_widest_cell():
    t = Table("t", ["name", "n"], [["a", "1"], ["longer name", "12,345"]])
    assert t.plain() == ["t", "name              n", "a                 1", "longer name  12,345"]


@pytest.mark.parametrize("compared_with, says", [("dequantized", "against the graph's dequantized weights"), ("fp32", "against fp32")])
def test_build_summary_of_an_integer_build_names_its_quality_bar(built, compared_with, says):
    """An integer build's verification has a quality bar instead of a tolerance (the summary of a
    7B int4 build stopped on a KeyError before)."""
    from rich.console import Console

    _, manifest, out_dir = built
    v = {k: val for k, val in manifest["verification"].items() if k != "tolerance"}
    v.update(precision="int4", quality_bar={"cosine_mean": 0.999, "cosine_min": 0.99, "kl_mean": 0.005},
             compared_with=compared_with)
    buf = io.StringIO()
    render(build_report({**manifest, "verification": v}, str(out_dir)), Console(file=buf, force_terminal=False))
    assert f"row cosine mean >= 0.999, worst >= 0.99, KL <= 0.005, {says}, onnx int4" in buf.getvalue()


def test_a_stitch_says_how_many_layers_were_traced_and_in_what_blocks():
    from specc.report import optimization_text

    plain = {"graph": "model", "pass": "specc.stitch", "layers": {"decoder": 12}, "layers_traced": 2}
    assert optimization_text(plain) == "model decoder 12 layers from 2 traced (specc.stitch)"
    periodic = {**plain, "layers": {"decoder": 26}, "layers_traced": 12, "periods": {"decoder": 6}}
    assert optimization_text(periodic) == "model decoder 26 layers from 12 traced, copied in blocks of decoder 6 (specc.stitch)"
    whole = {**plain, "layers_traced": None, "skipped": "decoder layers 0 and 1 differ"}
    assert optimization_text(whole) == "model traced whole (decoder 12 layers: decoder layers 0 and 1 differ)"
