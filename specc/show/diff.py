"""`specc diff A B`: two resolved specs side by side, the fields that differ only, and how the
parameter count and FLOPs per token change (how Table 3's variants differ from the base model).

Both specs are compared in their explicit form (what `specc resolve` prints: extends merged,
every default written out, keys new to the language included), flattened to dotted keys (`decoder.attention.heads`,
`outputs[1].classes`); lists are compared by index. `name` and `description` identify the two
specs and are not differences.
"""
from __future__ import annotations

from typing import Any

from specc.spec.costs import inspect_spec
from specc.spec.dump import spec_to_data
from specc.spec.resolve import ResolvedSpec

IDENTITY = ("name", "description", "extends")


def flatten(data: Any, prefix: str = "") -> dict[str, Any]:
    out: dict[str, Any] = {}
    if isinstance(data, dict) and data:
        for k, v in data.items():
            out.update(flatten(v, f"{prefix}.{k}" if prefix else str(k)))
    elif isinstance(data, list) and data:
        for i, v in enumerate(data):
            out.update(flatten(v, f"{prefix}[{i}]"))
    else:
        out[prefix] = data
    return out


def differences(a: ResolvedSpec, b: ResolvedSpec) -> list[dict[str, Any]]:
    """[{"key", "a", "b"}] for every leaf that differs (None where one side lacks it), in the
    order the keys appear in A then B."""
    fa, fb = flatten(spec_to_data(a.spec, every_key=True)), flatten(spec_to_data(b.spec, every_key=True))
    keys = list(fa) + [k for k in fb if k not in fa]
    return [{"key": k, "a": fa.get(k), "b": fb.get(k)} for k in keys
            if k.split(".")[0] not in IDENTITY and fa.get(k) != fb.get(k)]


def diff_specs(a: ResolvedSpec, b: ResolvedSpec) -> dict[str, Any]:
    """The facts `specc diff` prints (JSON keys in docs/cli.md)."""
    ia, ib = inspect_spec(a), inspect_spec(b)
    return {
        "names": {"a": a.name, "b": b.name},
        "differences": differences(a, b),
        "parameters": {"a": ia["parameters"], "b": ib["parameters"]},
        "flops_per_token": {"a": ia["flops_per_token"], "b": ib["flops_per_token"]},
        "length": {"a": ia["length"], "b": ib["length"]},
    }


def highlighted_nodes(diffs: list[dict[str, Any]]) -> set[str]:
    """The diagram nodes (see specc.show.graph) that the differing keys belong to."""
    nodes: set[str] = set()
    for d in diffs:
        parts = d["key"].replace("[", ".[").split(".")
        top = parts[0]
        if top in ("encoder", "decoder"):
            sub = parts[1] if len(parts) > 1 else ""
            nodes |= {
                "layers": {f"{top}_layers"},
                "attention": {f"{top}_attn"},
                "cross_attention": {f"{top}_cross"},
                "ffn": {f"{top}_ffn"},
            }.get(sub, {f"{top}_layers"})
        elif top == "vocab":
            nodes |= {"encoder_embed", "decoder_embed"}
        elif top == "position":
            nodes |= {"encoder_pos", "decoder_pos"}
        elif top == "norm":
            nodes |= {f"{s}_{k}_{n}" for s in ("encoder", "decoder") for k in ("attn", "cross", "ffn")
                      for n in ("norm", "norm2")} | {"encoder_final_norm", "decoder_final_norm"}
        elif top == "d_model":
            nodes |= {"encoder_embed", "decoder_embed"}
        elif top.startswith("outputs"):
            nodes.add("outputs")
    return nodes


def pct(a: int, b: int) -> str:
    if a == 0:
        return "n/a" if b else "+0.0%"
    return f"{100 * (b - a) / a:+.1f}%"
