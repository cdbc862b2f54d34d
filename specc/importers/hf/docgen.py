"""docs/import.md's mapping tables, printed from the family tables (specc.importers.families).

Contract: `describe()` is Markdown, one section per family in the registry's order, and
docs/import.md contains it verbatim (tests/importers/test_hf_import.py checks); change a table,
then paste describe() there.
"""
from __future__ import annotations

import json

from specc.importers.families import FAMILIES
from specc.importers.table import MISSING


def _flat(data: dict, prefix: str = ""):
    for k, v in data.items():
        if isinstance(v, dict):
            yield from _flat(v, f"{prefix}{k}.")
        else:
            yield f"{prefix}{k}", v


def describe() -> str:
    """The families as Markdown tables (docs/import.md is this text)."""
    lines = []
    for fam in FAMILIES:
        lines.append(f"### {', '.join(fam.model_types)} ({fam.architecture}): {', '.join(fam.heads)}\n")
        lines.append("| spec key | config field | default |")
        lines.append("|---|---|---|")
        for f in fam.fields:
            default = "required" if f.default is MISSING else json.dumps(f.default)
            names = " or ".join(f"`{n}`" for n in (f.name, *f.aliases))
            lines.append(f"| `{f.key}` | {names} | {default} |")
        lines.append("")
        lines.append("Always: " + ", ".join(f"`{k}: {json.dumps(v)}`" for k, v in _flat(fam.fixed)) + ".\n")
        if fam.extra is not None:
            lines.append(" ".join(fam.extra.__doc__.split()) + "\n")
        if fam.refuse:
            lines.append("Refused: " + "; ".join(f"`{r.name}` other than {' / '.join(json.dumps(a) for a in r.allowed)}"
                                                  for r in fam.refuse) + ".\n")
        lines.append("Checkpoint names are tried with the prefixes " + ", ".join(f"`{p}`" if p else "none"
                                                                         for p in fam.prefixes) + ".\n")
        lines.append("| specc parameter | checkpoint tensor | transform |")
        lines.append("|---|---|---|")
        for n in fam.names:
            alts = "".join(f" or `{c}` ({how})" for c, how in n.alt)
            lines.append(f"| `{n.specc}` | {' or '.join(f'`{c}`' for c in n.hf)}{alts} | {n.transform} |")
        lines.append("")
    return "\n".join(lines)

