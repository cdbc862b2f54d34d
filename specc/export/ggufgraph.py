"""`--precision gguf`: an exported fp32 graph's weights replaced by the GGUF file's own blocks.

Contract: `quantize_gguf(model, sig, source)` rewrites, in place, every MatMul whose constant
weight (specc/export/quantize.py's _matmul_weight: an initializer, or a tied head's table read
through a Transpose) is one of the file's quantized matrices into onnxruntime's MatMulNBits on
that matrix's blocks (specc/export/ggufblocks.py) at fp32 compute (ACCURACY_LEVEL), with the
blocks' offsets, where the format has minima, added outside the kernel as the block sums of the
input times the offsets (codes wider than the kernel takes at that level, KERNEL_BITS: two
4-bit MatMulNBits on the codes' high and low nibbles, added); and a Gather
of such a table (the token embedding) into a Gather of its packed rows, dequantized in the graph
by the same arithmetic. A graph weight is taken to be a GGUF matrix only where its values are the
values the import wrote for it, bit for bit (`GGUFSource` indexes the file's matrices by a hash of
their dequantized values, the import's own, with the row order the importer's fix gives them), so
no name mapping can pair the wrong tensors; a weight that matches none (a float tensor in the
file, or one the import computed from several) stays fp32 and is counted. The file's matrices
are read and dequantized one at a time; no more than one weight's blocks exist at once.
"""
from __future__ import annotations

import hashlib
from pathlib import Path

import numpy as np

from specc.errors import BuildError, first_line
from specc.export import ggufblocks
from specc.export.quantize import _matmul_weight, block_sums
from specc.spec.io import is_past
from specc.spec.targets import ACTIVATION_LEVELS, PRECISIONS

# MatMulNBits' accuracy level in every graph (unless serving.activations says int8): the precision's
# own activations, fp32 compute (specc/spec/targets.py). At 4 (int8 compute: the kernel
# rounds its input to int8 per block, as llama.cpp's dot products do) SmolLM2's Q4_1 graph kept
# 96.5% of transformers' next tokens on the same weights; at 1 every one of them (docs/import.md,
# docs/benchmarks_quality.md "GGUF blocks kept")
ACCURACY_LEVEL = ACTIVATION_LEVELS[PRECISIONS["gguf"].activations]
# the widest codes MatMulNBits takes at each accuracy level: at fp32 compute onnxruntime's 8-bit
# path dequantizes the whole weight at every call, so a matrix of 8-bit codes is written as two
# 4-bit MatMulNBits on its codes' high and low nibbles (ggufblocks.Blocks.planes: the high plane
# at 16 x the scales, a Mul the session folds at load; the low plane read about a zero point of
# 0) whose outputs are added: one byte a weight and the scales, as the file holds it
KERNEL_BITS = {1: 4, 4: 8}


def _digest(a: np.ndarray) -> str:
    return hashlib.blake2b(np.ascontiguousarray(a, dtype=np.float32).tobytes(), digest_size=16).hexdigest()


class GGUFSource:
    """A GGUF file's quantized matrices, found by their dequantized values: `find(w)` gives the
    (name, row order) of the matrix whose rows, so ordered, are w's ([N, K]), or None; `blocks(name,
    rows)` its Blocks in that row order. `row_order(reader, where)`: the importer's
    (specc.importers.gguf.row_order), the order its fix gives each matrix's rows."""

    def __init__(self, path: str | Path, row_order):
        from gguf import GGUFReader, quants

        self.path = Path(path)
        try:
            self.reader = GGUFReader(self.path)
        except (ValueError, OSError, IndexError) as exc:
            raise BuildError(f"{self.path}: not a GGUF file gguf can read ({exc})") from None
        self.tensors = {t.name: t for t in self.reader.tensors}
        self.index: dict[str, tuple[str, np.ndarray | None]] = {}
        orders = row_order(self.reader, str(self.path))
        for t in self.reader.tensors:
            qtype = t.tensor_type.name
            if qtype in ggufblocks.FLOAT_TYPES or len(t.shape) != 2:
                continue
            if not ggufblocks.readable(qtype):
                raise ggufblocks.refuse(t.name, qtype)
            n, k = int(t.shape[1]), int(t.shape[0])
            w = quants.dequantize(t.data, t.tensor_type).reshape(n, k)
            rows = orders(t.name, n)
            if isinstance(rows, str):  # the import changed more than the row order: not this file's blocks
                continue
            self.index[_digest(w if rows is None else w[rows])] = (t.name, rows)

    def find(self, w: np.ndarray) -> tuple[str, np.ndarray | None] | None:
        return self.index.get(_digest(w))

    def blocks(self, name: str, rows: np.ndarray | None) -> ggufblocks.Blocks:
        t = self.tensors[name]
        n, k = int(t.shape[1]), int(t.shape[0])
        b = ggufblocks.blocks(name, t.tensor_type.name, np.asarray(t.data).reshape(n, -1), k)
        if rows is None:
            return b
        return ggufblocks.Blocks(b.bits, b.block, b.codes[rows], b.scales[rows],
                                 None if b.offsets is None else b.offsets[rows])


def level_for(sig, activations: str | None = None) -> int:
    """The accuracy level of a graph: ACCURACY_LEVEL, or where it takes a KV cache (it decodes a
    token at a time) that of serving.activations where the spec sets it."""
    return ACTIVATION_LEVELS[activations] if activations and any(is_past(t.name) for t in sig.inputs) else ACCURACY_LEVEL


def quantize_gguf(model, sig, source: GGUFSource, activations: str | None = None) -> dict:
    """Rewrite an onnx_ir Model's MatMuls (and the token embedding's Gather) on the file's blocks,
    at level_for(sig, activations); returns facts for the manifest."""
    try:
        level = level_for(sig, activations)
        facts = _rewrite(model.graph, source, level)
    except BuildError:
        raise
    except Exception as exc:  # onnx_ir's and numpy's own errors on a graph this module does not expect
        raise BuildError(f"writing the {sig.name} graph on {source.path.name}'s blocks failed: "
                         f"{first_line(exc) or type(exc).__name__}") from None
    if not (facts["matmuls"] or facts["gathers"]) and source.index:
        raise BuildError(f"{source.path}: none of its quantized matrices is a weight of the {sig.name} graph "
                         "(was the file changed after `specc import gguf` read it?)")
    model.opset_imports.setdefault("com.microsoft", 1)
    ops: dict[str, int] = {}
    for n in model.graph:
        ops[n.op_type] = ops.get(n.op_type, 0) + 1
    return {"graph": sig.name, "precision": "gguf", "file": source.path.name, "float_matmuls_left": ops.get("MatMul", 0)
            - facts["offset_matmuls"], "quantized_ops": {"MatMulNBits": facts["matmuls"] + facts["split"]},
            "split_codes": facts["split"], "gathers": facts["gathers"], "formats": facts["formats"],
            "accuracy_level": level}


def describe(activations: str | None = None) -> dict:
    """What a gguf build writes (decoding in serving.activations), as the manifest's options record
    it (and the cache key hashes)."""
    level = ACTIVATION_LEVELS[activations] if activations else ACCURACY_LEVEL
    return {"op": "MatMulNBits", "weights": "the GGUF file's blocks", "formats": list(ggufblocks.FORMATS),
            "offsets": "block sums x offsets, outside the kernel", "accuracy_level": level,
            "kernel_bits": KERNEL_BITS[level], "wider_codes": "two 4-bit MatMulNBits on their nibbles, added",
            "embedding": "Gather of packed rows"}


class _Values:
    """One matrix's packed initializers, made from the file when they are written (the last
    matrix's blocks kept, so its codes, scales and offsets are read once)."""

    def __init__(self, source: GGUFSource):
        self.source = source
        self._last: tuple[str, ggufblocks.Blocks] | None = None
        self._planes: tuple[np.ndarray, np.ndarray] | None = None  # the last matrix's, where asked

    def get(self, name: str, rows) -> ggufblocks.Blocks:
        if self._last is None or self._last[0] != name:
            self._last = self._planes = None
            self._last = (name, self.source.blocks(name, rows))
        return self._last[1]

    def field(self, name: str, rows, field: str) -> np.ndarray:
        """One initializer's values: a Blocks field, or "high" / "low", its codes' planes (made
        once for both)."""
        b = self.get(name, rows)
        if field not in ("high", "low"):
            return getattr(b, field)
        if self._planes is None:
            self._planes = b.planes()
        return self._planes[field == "low"]

    def initializers(self, graph, name: str, prefix: str, rows, shapes: dict) -> dict:
        """The initializers PREFIX.codes (or .high and .low), .scales (and .offsets) of the file's
        matrix NAME."""
        import onnx_ir as ir

        values = {}
        for field, (dtype, shape) in shapes.items():
            full = f"{prefix}.{field}"
            tensor = ir.LazyTensor(lambda f=field, full=full: ir.tensor(np.ascontiguousarray(
                self.field(name, rows, f)).reshape(shapes[f][1]), name=full),
                dtype=ir.DataType.from_numpy(np.dtype(dtype)), shape=ir.Shape(shape), name=full)
            values[field] = ir.Value(name=full, shape=ir.Shape(shape), type=ir.TensorType(tensor.dtype),
                                     const_value=tensor)
            graph.register_initializer(values[field])
        return values


def _split(fmt: ggufblocks.Format, level: int) -> bool:
    """Whether the format's codes are wider than MatMulNBits takes at the level (two planes)."""
    return fmt.bits > KERNEL_BITS.get(level, 8)


def _shapes(fmt: ggufblocks.Format, n: int, k: int, level: int) -> dict:
    blocks = k // fmt.block
    if _split(fmt, level):
        plane = (np.uint8, (n, blocks, fmt.block // 2))
        shapes = {"high": plane, "low": plane}
    else:
        shapes = {"codes": (np.uint8, (n, blocks, fmt.block * fmt.bits // 8))}
    shapes["scales"] = (np.float32, (n * blocks,))
    if fmt.offsets:
        shapes["offsets"] = (np.float32, (n, blocks))
    return shapes


def _rewrite(graph, source: GGUFSource, level: int) -> dict:
    import onnx_ir as ir

    values = _Values(source)
    packed: dict[str, tuple[str, dict]] = {}  # initializer name (.T for a transposed read) -> (gguf name, values)
    facts = {"matmuls": 0, "offset_matmuls": 0, "gathers": 0, "split": 0, "formats": {}}
    summed: dict = {}
    constants: dict = {}

    def zeros(n: int, blocks: int):
        """The low planes' zero points (0, two a byte), one initializer for each shape."""
        key = ("zeros", n, blocks)
        if key not in constants:
            v = ir.Value(name=f"gguf.zero_points.{n}x{blocks}", const_value=ir.tensor(np.zeros(n * ((blocks + 1) // 2), np.uint8)))
            v.shape, v.type = v.const_value.shape, ir.TensorType(ir.DataType.UINT8)
            graph.register_initializer(v)
            constants[key] = v
        return constants[key]

    def sixteen():
        if "16" not in constants:
            v = ir.Value(name="gguf.sixteen", const_value=ir.tensor(np.float32(16)))
            v.shape, v.type = v.const_value.shape, ir.TensorType(ir.DataType.FLOAT)
            graph.register_initializer(v)
            constants["16"] = v
        return constants["16"]

    def high_scales(made: dict):
        """16 x the matrix's scales, the high plane's (a Mul of constants, once per matrix)."""
        if "scales16" not in made:
            mul = ir.node("Mul", [made["scales"], sixteen()], name=f"{made['scales'].name}.x16")
            mul.outputs[0].name = f"{made['scales'].name}.x16"
            _first(graph, [mul])
            made["scales16"] = mul.outputs[0]
        return made["scales16"]

    def pack_for(value, transposed: bool):
        key = f"{value.name}.T" if transposed else value.name
        if key in packed:
            return packed[key]
        w = value.const_value.numpy()
        found = source.find(w if transposed else w.T)  # the matrix as [N, K] rows
        del w
        if found is None:
            packed[key] = None
            return None
        name, rows = found
        t = source.tensors[name]
        fmt = ggufblocks.FORMATS[t.tensor_type.name]
        n, k = int(t.shape[1]), int(t.shape[0])
        made = values.initializers(graph, name, f"{value.name}_gguf", rows, _shapes(fmt, n, k, level))
        facts["formats"][t.tensor_type.name] = facts["formats"].get(t.tensor_type.name, 0) + 1
        packed[key] = (name, fmt, n, k, made)
        return packed[key]

    for node in list(graph):
        weight = _matmul_weight(graph, node)
        if weight is not None:
            got = pack_for(weight.value, weight.transposed)
            if got is None:
                continue
            _, fmt, n, k, made = got
            read = node.inputs[1]
            x, y = node.inputs[0], node.outputs[0]
            attributes = {"K": k, "N": n, "bits": fmt.bits, "block_size": fmt.block, "accuracy_level": level}
            if _split(fmt, level):  # y = x @ (16 scales (high - 8)) + x @ (scales low)
                attributes["bits"] = 4
                high = ir.node("MatMulNBits", [x, made["high"], high_scales(made)], attributes=attributes,
                               domain="com.microsoft", name=f"{node.name}.high")
                high.outputs[0].name = f"{y.name}.high"
                low = ir.node("MatMulNBits", [x, made["low"], made["scales"], zeros(n, k // fmt.block)],
                              attributes=attributes, domain="com.microsoft", name=f"{node.name}.low")
                low.outputs[0].name = f"{y.name}.low"
                matmul = ir.node("Add", [high.outputs[0], low.outputs[0]], name=f"{node.name}.planes")
                new = [high, low, matmul]
                facts["split"] += 1
            else:
                matmul = ir.node("MatMulNBits", [x, made["codes"], made["scales"]], attributes=attributes,
                                 domain="com.microsoft", name=node.name)
                new = [matmul]
            if "offsets" in made:  # y = x @ ((codes - mid) * scales) + (block sums of x) @ offsets
                matmul.outputs[0].name = f"{y.name}.codes"
                sums = summed.get((x.name, k, fmt.block))
                if sums is None:
                    ones = ir.Value(name=f"{x.name}.block_sums{k}x{fmt.block}.ones",
                                    const_value=ir.tensor(block_sums(k, fmt.block)))
                    ones.shape, ones.type = ones.const_value.shape, ir.TensorType(ir.DataType.FLOAT)
                    graph.register_initializer(ones)
                    total = ir.node("MatMul", [x, ones], name=f"{node.name}.block_sums")
                    total.outputs[0].name = f"{x.name}.block_sums{k}x{fmt.block}"
                    new.append(total)
                    sums = summed[(x.name, k, fmt.block)] = total.outputs[0]
                    facts["offset_matmuls"] += 1
                transposed = _transposed_offsets(graph, made, n, k // fmt.block)
                offsets = ir.node("MatMul", [sums, transposed], name=f"{node.name}.offsets")
                offsets.outputs[0].name = f"{y.name}.offsets"
                add = ir.node("Add", [matmul.outputs[0], offsets.outputs[0]], name=f"{node.name}.add")
                new += [offsets, add]
                facts["offset_matmuls"] += 1
            ir.convenience.replace_nodes_and_values(graph, node, [node], new, [y], [new[-1].outputs[0]])
            facts["matmuls"] += 1
            if weight.transposed and not read.uses():
                graph.remove(read.producer(), safe=True)
            if not weight.value.uses() and weight.value.name in graph.initializers:
                graph.initializers.pop(weight.value.name)

    for node in list(graph):  # after the MatMuls: a tied head is found by the Gather that reads its table
        table = _gathered_table(graph, node)
        if table is not None:
            got = pack_for(table, True)
            if got is None:
                continue
            _, fmt, n, k, made = got
            new, out = _gather_nodes(graph, node, made, fmt, k)
            ir.convenience.replace_nodes_and_values(graph, node, [node], new, [node.outputs[0]], [out])
            facts["gathers"] += 1
            if not table.uses() and table.name in graph.initializers:
                graph.initializers.pop(table.name)
    return facts


def _first(graph, nodes: list) -> None:
    """Nodes computing constants of the graph (folded when onnxruntime loads it), at its start."""
    graph.insert_before(graph.node(0), nodes) if len(graph) else graph.extend(nodes)


def _transposed_offsets(graph, made: dict, n: int, blocks: int):
    """The offsets [N, blocks] as the [blocks, N] the MatMul after the block sums multiplies by
    (a Transpose node, once per matrix: the initializer stays in the Gather's [N, blocks] rows)."""
    import onnx_ir as ir

    if "offsets.T" not in made:
        node = ir.node("Transpose", [made["offsets"]], attributes={"perm": [1, 0]},
                       name=f"{made['offsets'].name}.transpose")
        node.outputs[0].name = f"{made['offsets'].name}.T"
        _first(graph, [node])
        made["offsets.T"] = node.outputs[0]
    return made["offsets.T"]


def _gathered_table(graph, node):
    """The 2-D fp32 initializer a Gather on axis 0 reads (the token embedding), or None."""
    import onnx_ir as ir

    if node.op_type != "Gather" or node.domain != "" or node.attributes.get_int("axis", 0) != 0:
        return None
    value = node.inputs[0]
    if (value is None or value.name not in graph.initializers or value.const_value is None
            or value.const_value.dtype != ir.DataType.FLOAT or len(value.const_value.shape) != 2):
        return None
    return value


def _gather_nodes(graph, node, made: dict, fmt: ggufblocks.Format, k: int):
    """A Gather of the table's packed rows, dequantized as MatMulNBits reads them:
    ((codes - mid) * scale) + offset, each block, in fp32. Returns (nodes, output)."""
    ids = node.inputs[1]
    return _dequantized(graph, node.name or node.outputs[0].name, made, fmt, k, ids)


def _dequantized(graph, base: str, made: dict, fmt: ggufblocks.Format, k: int, ids):
    """Nodes computing the matrix's rows at IDS ([B, S] -> [B, S, K]) in fp32 from its packed
    initializers, by MatMulNBits' arithmetic. Returns (nodes, output)."""
    import onnx_ir as ir

    new = []

    def const(name, array):
        if f"{base}.{name}" in graph.initializers:
            return graph.initializers[f"{base}.{name}"]
        v = ir.Value(name=f"{base}.{name}", const_value=ir.tensor(np.asarray(array)))
        v.shape, v.type = v.const_value.shape, ir.TensorType(v.const_value.dtype)
        graph.register_initializer(v)
        return v

    def op(kind, inputs, **attributes):
        n = ir.node(kind, inputs, attributes=attributes, name=f"{base}.{kind.lower()}{len(new)}")
        n.outputs[0].name = f"{base}.{kind.lower()}{len(new)}"
        new.append(n)
        return n.outputs[0]

    def rows(value):
        return op("Gather", [value, ids], axis=0)

    blocks = k // fmt.block

    def unpacked(packed):  # 4-bit codes two a byte [..., blocks, block / 2] -> one a byte [..., blocks, block]
        low = op("BitwiseAnd", [packed, const("low_mask", np.uint8(15))])
        high = op("BitShift", [packed, const("shift", np.uint8(4))], direction="RIGHT")
        both = op("Concat", [op("Unsqueeze", [low, const("last", np.array([-1], np.int64))]),
                             op("Unsqueeze", [high, const("last2", np.array([-1], np.int64))])], axis=-1)
        return op("Reshape", [both, const("block_shape", np.array([0, 0, blocks, fmt.block], np.int64))])

    if "high" in made:  # 8-bit codes kept as their planes: 16 high + low
        high = op("BitShift", [unpacked(rows(made["high"])), const("shift", np.uint8(4))], direction="LEFT")
        codes = op("BitwiseOr", [high, unpacked(rows(made["low"]))])
    elif fmt.bits == 4:
        codes = unpacked(rows(made["codes"]))
    else:
        codes = rows(made["codes"])  # [..., blocks, block]
    centred = op("Sub", [op("Cast", [codes], to=ir.DataType.FLOAT), const("mid", np.float32(1 << (fmt.bits - 1)))])
    scales = op("Reshape", [made["scales"], const("scale_rows", np.array([-1, blocks], np.int64))])
    w = op("Mul", [centred, op("Unsqueeze", [rows(scales), const("axis", np.array([-1], np.int64))])])
    if "offsets" in made:
        w = op("Add", [w, op("Unsqueeze", [rows(made["offsets"]), const("axis2", np.array([-1], np.int64))])])
    out = op("Reshape", [w, const("rows", np.array([0, 0, k], np.int64))])
    return new, out
