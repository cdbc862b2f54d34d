"""The family registry (specc/importers/families/): every family module is registered once, each of
its three parts is keyed where its reader looks it up, and a family module is data (no torch, no
reader imported). The registry's order is docs/import.md's (test_hf_import.py's docs test); what
each family computes is test_hf_import.py's and test_gguf_import.py's."""
from __future__ import annotations

import json
import subprocess
import sys
from collections import Counter
from pathlib import Path

from specc.importers import families
from specc.importers.table import Registered

FOLDER = Path(families.__file__).parent


def test_every_family_module_is_registered_once():
    names = sorted(p.stem for p in FOLDER.glob("*.py") if p.stem != "__init__")
    listed = [m.__name__.rpartition(".")[2] for m in families.MODULES]
    assert sorted(listed) == names  # a module left out of MODULES is imported by nothing
    assert len(set(listed)) == len(listed)
    assert all(isinstance(m.REGISTERED, Registered) for m in families.MODULES)
    assert len({id(r.table) for r in families.REGISTERED}) == len(families.REGISTERED)


def test_no_model_type_and_no_gguf_architecture_is_registered_twice():
    types = Counter(mt for fam in families.FAMILIES for mt in fam.model_types)
    assert [mt for mt, n in types.items() if n > 1] == []
    assert set(families.BY_TYPE) == set(types)
    archs = Counter(arch for r in families.REGISTERED for arch in (*r.gguf, *r.gguf_refused))
    assert [arch for arch, n in archs.items() if n > 1] == []


def test_each_part_is_keyed_by_what_its_reader_looks_up():
    for r in families.REGISTERED:
        # as_config tries INVERSE[model_type] for the table's own model types only
        assert set(r.inverse) <= set(r.table.model_types), r.table.model_types
        for arch, row in r.gguf.items():
            # the GGUF row writes a config.json that this family's table reads
            assert families.BY_TYPE[row.model_type] is r.table, arch
            assert row.head in r.table.heads, arch


def test_the_families_are_data_that_load_no_torch_and_no_reader():
    script = ("import sys, json, specc.importers.families\n"
              "print(json.dumps(sorted(m for m in sys.modules if m.split('.')[0] in ('torch', 'gguf', 'transformers')"
              " or m.startswith(('specc.importers.hf', 'specc.importers.gguf.', 'specc.nn', 'specc.export'))"
              " or m == 'specc.importers.gguf')))")
    out = subprocess.run([sys.executable, "-c", script], capture_output=True, text=True, timeout=120)
    assert out.returncode == 0, out.stderr
    assert json.loads(out.stdout.splitlines()[-1]) == []
