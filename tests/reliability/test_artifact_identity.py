"""Nothing machine- or moment-specific inside a build's artifacts: no path (DIR, the spec's
folder, the repository, the home directory, the working directory), no host or user name,
no date. Time lives only in the manifest's timings_s, outside every hash.

(Byte-identical graphs and equal manifests across processes: tests/test_pipeline.py.)"""
from __future__ import annotations

import datetime
import getpass
import json
import os
import re
import socket
from pathlib import Path

import onnx
import pytest

import specc
from specc.export.outdir import MANIFEST

from tests.helpers.spectext import DEC

pytestmark = pytest.mark.xdist_group("test_artifact_identity")  # one worker: the module's shared builds are made once

ROOT = Path(__file__).resolve().parents[2]


@pytest.fixture(scope="module")
def build(tmp_path_factory):
    where = tmp_path_factory.mktemp("Zq7uniquefolder")
    spec = where / "spec-Kx9marker.yaml"
    spec.write_text(DEC)
    out = where / "out-Wv3marker"
    old = os.getcwd()
    os.chdir(where)
    try:
        result = specc.build(spec, out)
    finally:
        os.chdir(old)
    return where, spec, out, result


def identities(where: Path) -> set[str]:
    now = datetime.datetime.now(datetime.timezone.utc)
    found = {str(where), where.name, "Kx9marker", "Wv3marker", str(ROOT), str(Path.home()), socket.gethostname(),
             now.strftime("%Y-%m-%d"), now.strftime("%Y%m%d")}
    try:
        found.add(getpass.getuser())
    except Exception:  # no user name in this environment
        pass
    # a short user or host name (e.g. "root", "ci") would match unrelated bytes by chance
    return {s for s in found if len(s) >= 6}


def test_artifact_bytes_name_no_path_host_user_or_date(build):
    where, _, out, result = build
    names = identities(where)
    for a in result.artifacts:
        data = (out / a["path"]).read_bytes()
        for s in names:
            assert s.encode() not in data, f"{s!r} inside {a['path']}"


def test_graph_carries_no_metadata_or_doc_strings(build):
    _, _, out, _ = build
    model = onnx.load(str(out / "model.onnx"), load_external_data=False)
    assert list(model.metadata_props) == []
    assert model.doc_string == "" and model.graph.doc_string == ""
    # the exporter can attach stack traces (source file paths) to nodes
    assert all(not n.doc_string and not list(n.metadata_props) for n in model.graph.node)


def test_time_only_in_timings(build):
    where, _, out, _ = build
    manifest = json.loads((out / MANIFEST).read_text())
    timings = manifest.pop("timings_s")
    assert timings and all(isinstance(v, (int, float)) for v in timings.values())
    text = json.dumps(manifest)
    assert not re.search(r"\d{4}-\d{2}-\d{2}|\d{2}:\d{2}:\d{2}", text), "a date or time outside timings_s"
    for s in identities(where):
        assert s not in text


def test_hashes_do_not_move_with_the_clock(build, tmp_path):
    # another build of the same inputs, later and elsewhere: all content fields agree and the
    # timings (which differ) are the only field allowed to
    _, spec, out, first = build
    second = specc.build(spec, tmp_path / "again", force=True)
    a = json.loads((out / MANIFEST).read_text())
    b = json.loads((tmp_path / "again" / MANIFEST).read_text())
    assert {k for k in a if a[k] != b[k]} <= {"timings_s"}
    assert second.cached is False and a["cache_key"] == b["cache_key"]
