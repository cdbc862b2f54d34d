"""Reports as aligned tables: pure formatting, data in, text or rich tables out.

`inspect_report` and `build_report` turn the facts of `specc inspect` and a build manifest into a
list of blocks (a `Table` or a line of text). `render` writes the blocks to a rich Console: rich
tables on a terminal, plain aligned text (no ANSI codes, no box drawing) otherwise. Nothing here
computes a fact: every number comes from the facts or the manifest, as `--json` prints them.
"""
from __future__ import annotations

from dataclasses import dataclass, field
from typing import Any, Union

from rich.console import Console
from rich.table import Table as RichTable

from specc.show.diff import pct


@dataclass
class Table:
    title: str
    columns: list[str]
    rows: list[list[str]] = field(default_factory=list)

    def plain(self) -> list[str]:
        """Aligned lines: the first column left-justified, the others right-justified."""
        widths = [max(len(str(c)) for c in [col] + [r[i] for r in self.rows]) for i, col in enumerate(self.columns)]
        lines = [self.title]
        for row in [self.columns] + self.rows:
            lines.append("  ".join(str(c).ljust(w) if i == 0 else str(c).rjust(w)
                                   for i, (c, w) in enumerate(zip(row, widths))).rstrip())
        return lines

    def rich(self):
        table = RichTable(title=self.title)
        for i, col in enumerate(self.columns):
            table.add_column(col, justify="left" if i == 0 else "right")
        for row in self.rows:
            table.add_row(*[str(c) for c in row])
        return table


Block = Union[Table, str]


def human_bytes(n: float) -> str:
    for unit in ("B", "KiB", "MiB", "GiB"):
        if n < 1024 or unit == "GiB":
            return f"{n:,.0f} {unit}" if unit == "B" else f"{n:,.1f} {unit}"
        n /= 1024
    return str(n)


def inspect_report(facts: dict[str, Any]) -> list[Block]:
    """The blocks of `specc inspect` from `inspect_spec`'s facts."""
    total = facts["parameters"]
    blocks: list[Block] = [Table(
        f"{facts['name']}: {total:,} parameters",
        ["component", "parameters", "share"],
        [[c, f"{n:,}", f"{100 * n / total:.1f}%"] for c, n in facts["parameters_by_component"].items()],
    )]
    blocks += [f"  {note}" for note in facts.get("shared", [])]
    active = facts.get("active_parameters", total)
    if active != total:
        blocks.append(f"Active parameters (what one token reads: the routed experts it is sent to, and the rest): "
                      f"{active:,} ({100 * active / total:.1f}%)")
    blocks.append(f"FLOPs per token at length {facts['length']}: {facts['flops_per_token']:,}")
    cross = facts.get("cross_kv_cache_bytes_per_source_token") or 0
    blocks.append(f"KV cache per token: {facts['kv_cache_bytes_per_token']:,} bytes"
                  + (f" (+ {cross:,} per source token, cross-attention)" if cross else ""))
    at_length = facts.get("kv_cache_bytes_at_length")
    if at_length is not None and at_length != facts["kv_cache_bytes_per_token"] * facts["length"]:
        blocks.append(f"KV cache of one sequence at length {facts['length']}: {at_length:,} bytes "
                      "(sliding-window layers keep their window)")
    blocks.append("Weights: " + ", ".join(f"{p} {b / 2**20:,.1f} MiB" for p, b in facts["weight_bytes"].items()))
    routed = any(l.get("experts") for l in facts["layers"])  # an experts column where a layer has them
    blocks.append(Table(
        "layers",
        ["layer", "parameters", "FLOPs/token", "heads", "kv", "d_k", "d_v", "pattern", "d_ff", "activation"]
        + (["experts"] if routed else []),
        [[f"{l['stack']}.{l['index']}", f"{l['parameters']:,}", f"{l['flops_per_token']:,}", str(l["heads"]),
          str(l["kv_heads"]), str(l["d_k"]), str(l["d_v"]), str(l["pattern"]), str(l["d_ff"]), str(l["activation"])]
         + ([f"{l['top_k']} of {l['experts']}" if l.get("experts") else "dense"] if routed else [])
         for l in facts["layers"]],
    ))
    return blocks


def optimization_text(o: dict[str, Any], fusions: bool = False) -> str:
    """One optimization entry of the manifest as the build prints it (a graph pass's fusions in
    place of its node counts with `fusions`)."""
    graph = o.get("graph", "?")
    if o.get("pass") == "specc.stitch":
        layers = ", ".join(f"{role} {n}" for role, n in (o.get("layers") or {}).items())
        if o.get("skipped"):
            return f"{graph} traced whole ({layers} layers: {o['skipped']})"
        periods = ", ".join(f"{role} {n}" for role, n in (o.get("periods") or {}).items())
        blocks = f", copied in blocks of {periods}" if periods else ""
        return f"{graph} {layers} layers from {o.get('layers_traced')} traced{blocks} (specc.stitch)"
    if "precision" in o and "quantized_ops" in o:  # specc/export/quantize.py's facts (ggufgraph.py's: "formats")
        ops = ", ".join(f"{n} {op}" for op, n in o["quantized_ops"].items())
        offset = f", {o['offset_form']} in the offset form" if o.get("offset_form") else ""
        if "formats" in o:
            kept = ", ".join(f"{n} {fmt}" for fmt, n in o["formats"].items())
            return f"{graph} {o['precision']}: {ops}, {o.get('gathers', 0)} Gather ({kept} blocks of {o.get('file')})"
        return f"{graph} {o['precision']}: {ops} ({o.get('bits')}-bit blocks of {o.get('block')}{offset})"
    if fusions and "fusions" in o:
        return f"{graph} " + (", ".join(f"{k} x{v}" for k, v in o["fusions"].items()) or "no fusions")
    return (f"{graph} {o.get('nodes_before', '?')} -> {o.get('nodes_after', '?')} nodes"
            + (f" ({o['pass']})" if o.get("pass") else ""))


def fusions(manifest: dict[str, Any]) -> dict[str, int]:
    """Graph-pass fusions that fired, {name: count} summed over graphs, from the manifest's
    `fusions` key (top level or per optimization entry); empty when none fired."""
    total: dict[str, int] = {}
    sources = [manifest.get("fusions")] + [o.get("fusions") for o in manifest.get("optimizations") or []]
    for src in sources:
        for name, count in (src or {}).items():
            if count:
                total[name] = total.get(name, 0) + int(count)
    return total


def case_max_abs(case: dict[str, Any]) -> float:
    """The largest |onnxruntime - torch| over one verification case's outputs."""
    return max((o["max_abs"] for o in (case.get("outputs") or {}).values()), default=0.0)


def _judged(v: dict[str, Any]) -> str:
    """What a build's outputs were held to: a float precision's tolerance, or an integer one's
    quality bar and what it compared with (specc/export/verify.py)."""
    if "tolerance" in v:
        return f"tolerance {v['tolerance']['atol']:g} + {v['tolerance']['rtol']:g} x |torch|"
    bar = v["quality_bar"]
    against = "the graph's dequantized weights" if v.get("compared_with") == "dequantized" else "fp32"
    return (f"row cosine mean >= {bar['cosine_mean']:g}, worst >= {bar['cosine_min']:g}, "
            f"KL <= {bar['kl_mean']:g}, against {against}")


def build_report(manifest: dict[str, Any], out_dir: str, cached: bool = False) -> list[Block]:
    """The summary printed at the end of `specc build`, from the manifest."""
    v = manifest["verification"]
    judged = _judged(v)
    blocks: list[Block] = [Table(
        f"{manifest['name']} -> {out_dir}" + (" (cached)" if cached else ""),
        ["artifact", "size", "sha256"],
        [[a["path"], human_bytes(a["bytes"]), a["sha256"][:12]] for a in manifest["artifacts"]],
    )]
    blocks.append(f"parameters: {manifest['parameters']:,}")
    segments = [c for c in v.get("segments") or [] if isinstance(c, dict)]
    if segments:  # a streamed build verified a layer at a time (specc/export/segments.py)
        worst = max(segments, key=case_max_abs)
        count = len({c.get("segment") for c in segments})
        blocks.append(f"verified a layer at a time: {count} segments x {len(segments) // max(count, 1)} cases, "
                      f"max |onnxruntime - torch| {v['max_abs_diff']:.2e} (at {worst.get('segment')}, case "
                      f"{worst.get('case')}; {judged}, {v['target']} {v['precision']})")
    else:
        blocks.append(f"verified: {len(v['cases'])} cases, max |onnxruntime - torch| {v['max_abs_diff']:.2e} "
                      f"({judged}, {v['target']} {v['precision']})")
    length = v.get("length") or {}
    if length.get("verified") is not None and length.get("serving") is not None:
        if length["verified"] < length["serving"]:
            blocks.append(f"verified up to {length['verified']} positions of serving.length.max {length['serving']} "
                          "(longer inputs run the same graph, not verified at their length)")
        else:
            blocks.append(f"verified up to serving.length.max ({length['serving']} positions)")
    cases = [c for c in v["cases"] if isinstance(c, dict)]
    if cases:
        blocks.append(Table("verification", ["graph", "case", "max abs diff", "judged by"], [
            [str(c.get("graph", "")), str(c.get("case", "")), f"{case_max_abs(c):.2e}", judged] for c in cases]))
    timings = manifest.get("timings_s") or {}
    if timings:
        blocks.append(Table("timings", ["stage", "seconds"], [[s, f"{t:.2f}"] for s, t in timings.items()]))
    opts = manifest.get("optimizations") or []
    if opts:
        blocks.append("optimizations: " + ", ".join(optimization_text(o) for o in opts))
    fired = fusions(manifest)
    blocks.append("fusions: " + (", ".join(f"{n} x{c}" for n, c in sorted(fired.items())) if fired else "none"))
    return blocks


def diff_report(facts: dict[str, Any], label_a: str, label_b: str) -> list[Block]:
    """The blocks of `specc diff` from `diff_specs`' facts."""
    diffs = facts["differences"]
    blocks: list[Block] = [Table(f"{len(diffs)} differing fields", ["key", f"A: {label_a}", f"B: {label_b}"],
                                 [[d["key"], str(d["a"]), str(d["b"])] for d in diffs])
                           if diffs else "no differences"]
    p, f, n = facts["parameters"], facts["flops_per_token"], facts["length"]
    blocks.append(f"parameters: {p['a']:,} -> {p['b']:,} ({pct(p['a'], p['b'])})")
    blocks.append(f"FLOPs per token: {f['a']:,} -> {f['b']:,} ({pct(f['a'], f['b'])})"
                  + (f" (length {n['a']})" if n["a"] == n["b"] else f" (lengths {n['a']} and {n['b']})"))
    return blocks


def render(blocks: list[Block], console=None) -> None:
    """Write blocks to console (default: stdout): rich tables on a terminal, plain aligned text
    otherwise."""
    console = console or Console()
    for block in blocks:
        if isinstance(block, Table):
            if console.is_terminal:
                console.print(block.rich())
            else:
                for line in block.plain():
                    console.file.write(line + "\n")
        else:
            if console.is_terminal:
                console.print(block, highlight=False, markup=False)
            else:
                console.file.write(block + "\n")
    console.file.flush()
