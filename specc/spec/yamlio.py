"""Safe YAML with positions.

The text is composed into YAML nodes by ruamel.yaml and constructed here, by hand, into plain
dicts, lists and scalars, so that:
  * only the core schema's tags are accepted; ``!!python/...`` and every other tag is an error,
    never executed;
  * every value and every key keeps its file, line and column (1-based) for error messages;
  * duplicate keys are errors;
  * aliases cannot expand exponentially ("billion laughs"): the number of constructed nodes and
    the nesting depth are bounded.
"""
from __future__ import annotations

import io
import math
import re
from dataclasses import dataclass, field
from typing import Any

from ruamel.yaml import YAML
from ruamel.yaml.error import MarkedYAMLError, YAMLError
from ruamel.yaml.nodes import MappingNode, Node, ScalarNode, SequenceNode

from specc.errors import Issue, SpecError

MAX_INT_DIGITS = 20  # past int64: no size, count or id in a spec is that large
MAX_SPEC_BYTES = 1 << 20  # a spec is a page of YAML; 1 MiB is far beyond any real one
MAX_NODES = 50_000  # constructed values, aliases expanded
MAX_DEPTH = 48

_CORE = "tag:yaml.org,2002:"
_INT = re.compile(r"^[-+]?(0|[1-9][0-9_]*)$")
_INT_BASE = re.compile(r"^(0o[0-7_]+|0x[0-9a-fA-F_]+)$")

Pos = tuple[str, int, int]  # file, line, column (1-based)


@dataclass
class Located:
    """Plain data plus where each part of it was written."""

    data: Any
    values: dict[tuple, Pos] = field(default_factory=dict)  # path -> position of the value
    keys: dict[tuple, Pos] = field(default_factory=dict)  # path -> position of the key

    def where(self, path: tuple, key: bool = False) -> Pos | None:
        """Position of ``path``, or of its nearest ancestor that was written."""
        table = self.keys if key else self.values
        for cut in range(len(path), -1, -1):
            pos = table.get(path[:cut]) or (self.values.get(path[:cut]) if key else None)
            if pos:
                return pos
        return None


def _issue(file: str, mark, message: str, key: str = "") -> Issue:
    return Issue(message=message, key=key, file=file, line=mark.line + 1, column=mark.column + 1)


class _Builder:
    def __init__(self, file: str):
        self.file = file
        self.count = 0
        self.out = Located(data=None)

    def pos(self, node: Node) -> Pos:
        return (self.file, node.start_mark.line + 1, node.start_mark.column + 1)

    def fail(self, node: Node, message: str, path: tuple) -> None:
        raise SpecError(_issue(self.file, node.start_mark, message, ".".join(map(str, path))))

    def build(self, node: Node, path: tuple = (), depth: int = 0) -> Any:
        self.count += 1
        if self.count > MAX_NODES:
            self.fail(node, f"the YAML expands to more than {MAX_NODES} values (aliases included); refused", path)
        if depth > MAX_DEPTH:
            self.fail(node, f"nesting deeper than {MAX_DEPTH} levels; refused", path)
        self.out.values[path] = self.pos(node)
        tag = node.tag or ""
        if isinstance(node, MappingNode):
            if tag != _CORE + "map":
                self.fail(node, f"YAML tag {tag!r} is not allowed in a spec (plain mappings only)", path)
            result: dict[str, Any] = {}
            for knode, vnode in node.value:
                if knode.tag == _CORE + "merge":
                    self.fail(knode, "YAML merge keys (<<) are not supported; use extends:", path)
                if not isinstance(knode, ScalarNode) or knode.tag != _CORE + "str":
                    self.fail(knode, "mapping keys must be plain strings", path)
                key = knode.value
                if key in result:
                    first = self.out.keys[path + (key,)]
                    self.fail(knode, f"duplicate key {key!r} (first at line {first[1]})", path + (key,))
                self.out.keys[path + (key,)] = self.pos(knode)
                result[key] = self.build(vnode, path + (key,), depth + 1)
            return result
        if isinstance(node, SequenceNode):
            if tag != _CORE + "seq":
                self.fail(node, f"YAML tag {tag!r} is not allowed in a spec (plain lists only)", path)
            return [self.build(item, path + (i,), depth + 1) for i, item in enumerate(node.value)]
        return self.scalar(node, path)

    def scalar(self, node: ScalarNode, path: tuple) -> Any:
        tag, text = node.tag or "", node.value
        kind = tag[len(_CORE):] if tag.startswith(_CORE) else None
        if kind == "str":
            return text
        if kind == "null":
            return None
        if kind == "bool":
            return text.lower() == "true"
        if kind == "int":
            digits = text.replace("_", "")
            if len(digits.lstrip("+-")) > MAX_INT_DIGITS:
                self.fail(node, f"an integer of {len(digits.lstrip('+-'))} digits is beyond any size a spec takes", path)
            if _INT.match(text):
                return int(digits)
            if _INT_BASE.match(text):
                return int(digits, 0)
            self.fail(node, f"cannot read {text!r} as an integer", path)
        if kind == "float":
            low = text.lower().replace("_", "")
            if low in (".inf", "+.inf"):
                return math.inf
            if low == "-.inf":
                return -math.inf
            if low == ".nan":
                return math.nan
            try:
                return float(low)
            except ValueError:
                self.fail(node, f"cannot read {text!r} as a number", path)
        self.fail(node, f"YAML tag {tag!r} is not allowed in a spec (only plain values); it was not executed", path)


def parse_yaml(text: str, file: str) -> Located:
    """Parse one YAML document into plain data with positions. Raises SpecError, located."""
    if len(text.encode("utf-8", "surrogatepass")) > MAX_SPEC_BYTES:
        raise SpecError(Issue(f"spec file is larger than {MAX_SPEC_BYTES} bytes; refused", file=file))
    yaml = YAML(typ="safe", pure=True)
    try:
        node = yaml.compose(text)
    except MarkedYAMLError as exc:
        mark = exc.problem_mark or exc.context_mark
        message = " ".join(p for p in (exc.context, exc.problem) if p) or "invalid YAML"
        if mark is None:
            raise SpecError(Issue(f"invalid YAML: {message}", file=file)) from None
        raise SpecError(_issue(file, mark, f"invalid YAML: {message}")) from None
    except RecursionError:
        raise SpecError(Issue(f"nesting deeper than {MAX_DEPTH} levels; refused", file=file)) from None
    except YAMLError as exc:  # e.g. several documents in one file
        raise SpecError(Issue(f"invalid YAML: {exc}", file=file)) from None
    builder = _Builder(file)
    if node is None:
        raise SpecError(Issue("the spec file is empty", file=file, line=1, column=1))
    builder.out.data = builder.build(node)
    if not isinstance(builder.out.data, dict):
        raise SpecError(_issue(file, node.start_mark, "a spec is a YAML mapping (key: value lines)"))
    return builder.out


def dump_yaml(data: Any) -> str:
    """Plain data to block-style YAML, keys in the order given."""
    yaml = YAML(typ="safe", pure=True)
    yaml.default_flow_style = False
    yaml.sort_base_mapping_type_on_output = False
    buf = io.StringIO()
    yaml.dump(data, buf)
    return buf.getvalue()


def kind_first(data: Any) -> Any:
    """Put `kind:` first in every mapping, the way people write specs."""
    if isinstance(data, dict):
        items = sorted(data.items(), key=lambda kv: kv[0] != "kind")
        return {k: kind_first(v) for k, v in items}
    if isinstance(data, list):
        return [kind_first(v) for v in data]
    return data
