"""The Transformer's Table 3 sweep as specs: parameters of each variant, next to the paper's.

Each row of Table 3 in Vaswani et al. 2017, "Attention Is All You Need" (arXiv:1706.03762) is a
small spec in examples/table3/ that `extends: transformer-base` and sets only the fields the row
changes. This script loads each, lists the fields that differ from the base model, counts the
parameters (no weights are made, nothing is built or trained) and prints the paper's reported count
(Table 3, column "params x 10^6") beside ours.

    python examples/table3_sweep.py          # the table
    python examples/table3_sweep.py --json   # one JSON document

Our counts are a little below the paper's: the vocabulary here is 37000 tokens (Section 5.1 says
"about 37000"), and rows (B) and (C) only vary what the row names.
"""
from __future__ import annotations

import json
import sys
from pathlib import Path

import specc
from specc.spec.costs import inspect_spec

ROWS = Path(__file__).resolve().parent / "table3"
ORDER = ["base", "a1", "a2", "a3", "a4", "b1", "b2", "c1", "c2", "c3", "c4", "c5", "c6", "c7", "d1", "e", "big"]

# Table 3, "params x 10^6"; None where the paper leaves the cell empty.
PAPER_MILLIONS = {"base": 65, "b1": 58, "b2": 60, "c1": 36, "c2": 50, "c3": 80, "c4": 28, "c5": 168,
                  "c6": 53, "c7": 90, "big": 213}


def _flat(data, prefix=""):
    if isinstance(data, dict):
        out = {}
        for k, v in data.items():
            out.update(_flat(v, f"{prefix}{k}."))
        return out
    return {prefix[:-1]: data}


def changed_fields(path: Path) -> list[str]:
    """The fields a row's file sets beyond the base model, as key=value; a value the encoder and
    decoder set alike is named once as stack.KEY."""
    import yaml

    data = yaml.safe_load(path.read_text())
    flat = {k: v for k, v in _flat(data).items() if k not in {"specc", "name", "description", "extends"}}
    out: dict[str, object] = {}
    for key, value in flat.items():
        stack, _, rest = key.partition(".")
        other = {"encoder": "decoder", "decoder": "encoder"}.get(stack)
        if other and flat.get(f"{other}.{rest}", object()) == value:
            out[f"stack.{rest}"] = value
        else:
            out[key] = value
    return [f"{k}={v}" for k, v in out.items()]


def sweep() -> list[dict]:
    rows = []
    for key in ORDER:
        spec = specc.load_spec(ROWS / f"{key}.yaml")
        facts = inspect_spec(specc.resolve(spec))
        rows.append({"row": key, "spec": spec.name, "changed": changed_fields(ROWS / f"{key}.yaml"),
                     "parameters": facts["parameters"], "paper_millions": PAPER_MILLIONS.get(key)})
    return rows


def main(argv: list[str]) -> int:
    rows = sweep()
    if "--json" in argv:
        print(json.dumps({"rows": rows}, indent=2))
        return 0
    table = [["row", "changed fields", "parameters", "x10^6", "paper x10^6", "ours/paper"]]
    for r in rows:
        paper = r["paper_millions"]
        table.append([r["row"], ", ".join(r["changed"]) or "-", f"{r['parameters']:,}", f"{r['parameters'] / 1e6:.1f}",
                      "-" if paper is None else str(paper),
                      "-" if paper is None else f"{r['parameters'] / (paper * 1e6):.3f}"])
    widths = [max(len(line[i]) for line in table) for i in range(len(table[0]))]
    print("Vaswani et al. 2017, Table 3: parameters per variant (no training; paper column from Table 3)")
    for line in table:
        print("  ".join(c.ljust(w) if i < 2 else c.rjust(w) for i, (c, w) in enumerate(zip(line, widths))).rstrip())
    return 0


if __name__ == "__main__":
    sys.exit(main(sys.argv[1:]))
