"""The rules of the house that no linter checks (docs/architecture.md draws the layers):

- the runtime (specc/runtime/) imports neither nn/ nor export/ nor anything that does, not even
  lazily, and opening it loads no torch;
- a module imports at its top; an import inside a function is of a heavy or optional dependency
  (HEAVY, or a specc module that imports one at its top), or in the CLI's start-up path
  (specc/cli.py, where each command imports what it alone needs, and the package's own
  specc/__init__.py, which `import specc` runs), or one of LAZY_FOR_A_REASON;
- nothing in the repository links to a path outside it;
- no top-level module of specc is named after a standard-library module;
- the decoding engine (specc/decoding/), which `--target triton` copies into a repository beside
  specc/spec/io.py, imports of specc its own modules and the IO contract alone, relatively, and
  of the rest the standard library and numpy; spec/io.py the standard library alone;
- no test changes the import path: tests import their helpers from the tests package
  (tests.helpers.NAME) and the benchmarks they check as benchmarks.NAME.

Static checks read the source with ast, so a lazy import counts as much as a top-level one.
"""
from __future__ import annotations

import ast
import fnmatch
import inspect
import json
import os
import re
import subprocess
import sys
import textwrap
from functools import cache
from pathlib import Path

import pytest

ROOT = Path(__file__).resolve().parent.parent
PACKAGE = ROOT / "specc"
# third-party modules that are slow to import, or that only some environments have
HEAVY = {"torch", "onnx", "onnxscript", "onnx_ir", "onnxruntime", "transformers", "tensorrt", "tritonclient",
         "pytriton", "safetensors", "matplotlib", "graphviz", "gguf",
         "tokenizers", "jinja2",  # optional: text (specc/runtime/text.py)
         "sh"}  # PyTriton's, in the serve environment only (specc/runtime/pytriton_patch.py)
LAZY_ANYWHERE = {"specc/cli.py", "specc/__init__.py"}
# (file, module): why it is imported inside a function
LAZY_FOR_A_REASON = {
    ("specc/spec/schema.py", "specc.spec.rules"): "the rule table is written against the schema; "
                                                   "ModelSpec's validator runs it once both exist",
}
RUNTIME_MAY_NOT_REACH = ("specc.nn", "specc.export", "specc.builder", "specc.importers.hf")


def module_name(path: Path) -> str:
    parts = path.relative_to(ROOT).with_suffix("").parts
    return ".".join(parts[:-1] if parts[-1] == "__init__" else parts)


@cache
def modules() -> dict[str, Path]:
    return {module_name(p): p for p in PACKAGE.rglob("*.py")}


def imports(path: Path, top_only: bool = False) -> list[tuple[str, int, bool]]:
    """(module, line, at top level) for every import in a file; `from X import y` counts as X.y
    where X.y is a specc module, else as X."""
    tree = ast.parse(path.read_text(), filename=str(path))
    name = module_name(path)
    package = name if path.name == "__init__.py" else name.rpartition(".")[0]
    found = []

    def visit(node, top: bool) -> None:
        for child in ast.iter_child_nodes(node):
            inner = top and not isinstance(child, (ast.FunctionDef, ast.AsyncFunctionDef, ast.Lambda))
            if isinstance(child, ast.Import):
                found.extend((a.name, child.lineno, top) for a in child.names)
            elif isinstance(child, ast.ImportFrom):
                base = child.module or ""
                if child.level:
                    anchor = package.split(".")[: len(package.split(".")) - (child.level - 1)]
                    base = ".".join(anchor + ([base] if base else []))
                if base == "__future__":
                    continue
                for a in child.names:
                    full = f"{base}.{a.name}"
                    found.append((full if full in modules() else base, child.lineno, top))
            elif isinstance(child, ast.If) and _is_type_checking(child.test):
                continue  # annotations only
            else:
                visit(child, inner)

    visit(tree, True)
    return [f for f in found if not top_only or f[2]]


def _is_type_checking(test) -> bool:
    return (isinstance(test, ast.Name) and test.id == "TYPE_CHECKING") or \
        (isinstance(test, ast.Attribute) and test.attr == "TYPE_CHECKING")


def specc_targets(name: str) -> list[str]:
    """The specc modules an import of `name` runs: the module and its parent packages."""
    parts = name.split(".")
    return [m for m in (".".join(parts[:i]) for i in range(1, len(parts) + 1)) if m in modules()]


@cache
def heavy(name: str) -> bool:
    """Whether importing module `name` imports a HEAVY module at some top level on the way."""
    if name.split(".")[0] in HEAVY:
        return True
    if name not in modules():
        return False
    heavy.seen = getattr(heavy, "seen", set())
    if name in heavy.seen:
        return False  # a cycle: decided by its other members
    heavy.seen.add(name)
    try:
        return any(heavy(t) for imp, _, _ in imports(modules()[name], top_only=True)
                   for t in ([imp] if imp.split(".")[0] != "specc" else specc_targets(imp)))
    finally:
        heavy.seen.discard(name)


def reach(start: str) -> set[str]:
    """Every specc module importing `start` may run, lazy imports included. A package that is
    imported only as the parent of a module runs its top level alone (specc/__init__.py's lazy
    imports belong to its own functions, which the child never calls)."""
    seen, todo = {}, [(start, True)]
    while todo:
        name, whole = todo.pop()
        if name not in modules() or seen.get(name, False) or (name in seen and not whole):
            continue
        seen[name] = whole
        for imp, _, top in imports(modules()[name]):
            if imp.split(".")[0] == "specc" and (whole or top):
                *parents, target = specc_targets(imp)
                todo.extend([(p, False) for p in parents] + [(target, True)])
    return set(seen)


# --- the runtime -------------------------------------------------------------------------------


def test_the_runtime_reaches_neither_nn_nor_export():
    runtime = [m for m in modules() if m == "specc.runtime" or m.startswith("specc.runtime.")]
    assert len(runtime) > 2
    for start in runtime:
        bad = sorted(m for m in reach(start) if m.startswith(RUNTIME_MAY_NOT_REACH))
        assert bad == [], f"{start} reaches {bad}"


def test_opening_the_runtime_loads_no_torch():
    script = ("import sys, json, pkgutil, importlib, specc.runtime\n"
              "for m in pkgutil.iter_modules(specc.runtime.__path__):\n"
              "    if m.name != 'serve': importlib.import_module('specc.runtime.' + m.name)\n"
              "print(json.dumps(sorted(m for m in sys.modules if m.split('.')[0] in ('torch', 'onnx', 'onnxscript')"
              " or m.startswith(('specc.nn', 'specc.export')))))")
    out = subprocess.run([sys.executable, "-c", script], capture_output=True, text=True, timeout=120)
    assert out.returncode == 0, out.stderr
    assert json.loads(out.stdout.splitlines()[-1]) == []


def test_the_reach_check_can_fail():
    """pipeline.py does import export/: the same walk finds it."""
    assert any(m.startswith("specc.export") for m in reach("specc.builder.pipeline"))


# --- the IO contract is spelled in one place -----------------------------------------------------

# string literals that only specc/spec/io.py may hold: the cache prefixes and the symbolic dims
CONTRACT = re.compile(r"^(past_key_values|present)(\.|$)|^(past_sequence|total_sequence|encoder_sequence)$")


def literals(path: Path) -> list[tuple[int, str]]:
    """The string constants of a file that are not docstrings (f-string parts included)."""
    tree = ast.parse(path.read_text())
    docs = {id(n.body[0].value) for n in ast.walk(tree)
            if isinstance(n, (ast.Module, ast.ClassDef, ast.FunctionDef, ast.AsyncFunctionDef))
            and n.body and isinstance(n.body[0], ast.Expr) and isinstance(n.body[0].value, ast.Constant)}
    return [(n.lineno, n.value) for n in ast.walk(tree)
            if isinstance(n, ast.Constant) and isinstance(n.value, str) and id(n) not in docs]


def test_only_spec_io_spells_the_io_contract():
    owner = PACKAGE / "spec" / "io.py"
    files = [p for p in [*PACKAGE.rglob("*.py"), *(ROOT / "benchmarks").rglob("*.py")] if p != owner]
    spelled = [f"{p.relative_to(ROOT)}:{line}: {text!r}" for p in files for line, text in literals(p)
               if CONTRACT.search(text)]
    assert spelled == []
    assert any(CONTRACT.search(text) for _, text in literals(owner))  # the check sees a spelling


# --- the decoding engine travels -----------------------------------------------------------------

DECODING = PACKAGE / "decoding"
DECODING_MAY_IMPORT = {"numpy"}  # beside the standard library: what a Triton Python backend has


def _outside(name: str) -> bool:
    """Whether a module outside specc is neither the standard library's nor one decoding may import."""
    top = name.split(".")[0]
    return top not in sys.stdlib_module_names and top not in DECODING_MAY_IMPORT


def decoding_imports_wrong(files: dict[str, str], contract: str) -> list[str]:
    """The imports of decoding's files (name -> text) and of the IO contract (its text) that break
    the rule of the test below, one line each."""
    own = {name.removesuffix(".py") for name in files}
    wrong = []
    for name, text in sorted(files.items()):
        for node in ast.walk(ast.parse(text)):
            where = f"specc/decoding/{name}:{getattr(node, 'lineno', 0)}"
            if isinstance(node, ast.Import):
                wrong += [f"{where}: import {a.name}" for a in node.names if _outside(a.name)]
            elif isinstance(node, ast.ImportFrom):
                names = [a.name for a in node.names]
                shown = f"{where}: from {'.' * node.level}{node.module or ''} import {', '.join(names)}"
                if node.level == 0:
                    wrong += [shown] if _outside(node.module or "") else []
                elif node.level == 1:
                    wrong += [shown] if (node.module or "") not in own else []
                elif (node.level, node.module, names) != (2, "spec", ["io"]):
                    wrong.append(shown)
    for node in ast.walk(ast.parse(contract)):
        if isinstance(node, (ast.Import, ast.ImportFrom)):
            modules = [a.name for a in node.names] if isinstance(node, ast.Import) else [node.module or "."]
            wrong += [f"specc/spec/io.py:{node.lineno}: {m}" for m in modules
                      if getattr(node, "level", 0) or m.split(".")[0] not in sys.stdlib_module_names]
    return wrong


def test_decoding_imports_only_the_io_contract_and_itself_relatively():
    """specc/decoding/ runs in two places: inside specc, and copied into a Triton repository as
    the package specc_decoding beside its own spec/io.py (specc/export/triton.py's engine_files).
    So each of its imports of specc is relative and names one of its own modules (`from .graphs
    import ...`) or the IO contract (`from ..spec import io`), and every other import is the
    standard library's or numpy; the IO contract imports the standard library alone."""
    files = {p.name: p.read_text() for p in DECODING.glob("*.py")}
    assert {"engine.py", "stores.py", "request.py", "sampling.py", "graphs.py", "facts.py"} <= set(files)
    assert decoding_imports_wrong(files, (PACKAGE / "spec" / "io.py").read_text()) == []


def test_the_decoding_check_can_fail():
    files = {"a.py": "import numpy\nfrom .b import x\n", "b.py": "from ..spec import io\nimport json\n"}
    assert decoding_imports_wrong(files, "import re\n") == []
    bad = {"a.py": "from specc.spec import io\nfrom .c import x\nimport onnxruntime\n",
           "b.py": "from ..spec import manifest\nfrom ...runtime import graph\n"}
    assert decoding_imports_wrong(bad, "import numpy\n") == [
        "specc/decoding/a.py:1: from specc.spec import io", "specc/decoding/a.py:2: from .c import x",
        "specc/decoding/a.py:3: import onnxruntime", "specc/decoding/b.py:1: from ..spec import manifest",
        "specc/decoding/b.py:2: from ...runtime import graph", "specc/spec/io.py:1: numpy"]


# --- the layers of docs/architecture.md ---------------------------------------------------------


def layers() -> tuple[dict[str, str], dict[str, set[str]]]:
    """(module prefix -> layer, layer -> the layers it may import) from docs/architecture.md."""
    text = (ROOT / "docs" / "architecture.md").read_text()
    table = text.split("<!-- layers: name | modules | may import -->", 1)[1].split("<!-- /layers -->", 1)[0]
    owner, allowed = {}, {}
    for row in table.strip().splitlines()[2:]:
        layer, mods, may = (c.strip() for c in row.strip().strip("|").split("|"))
        for m in re.findall(r"`([\w.]+)`", mods):
            owner[m] = layer
        allowed[layer] = {w.strip() for w in may.split(",")} | {layer}
    return owner, allowed


def layer_of(name: str, owner: dict[str, str]) -> str:
    best = max((p for p in owner if name == p or name.startswith(p + ".")), key=len, default=None)
    assert best is not None, f"{name} is in no layer of docs/architecture.md"
    return owner[best]


def test_every_import_stays_within_the_layers_of_the_architecture_doc():
    owner, allowed = layers()
    assert {"base", "spec", "nn", "export", "runtime", "root"} <= set(allowed)
    wrong = []
    for name, path in sorted(modules().items()):
        mine = layer_of(name, owner)
        if "everything" in allowed[mine]:
            continue
        for imp, line, _ in imports(path):
            if imp.split(".")[0] != "specc":
                continue
            targets = specc_targets(imp)
            theirs = layer_of(targets[-1], owner) if targets else "root"
            if theirs not in allowed[mine]:
                wrong.append(f"{path.relative_to(ROOT)}:{line}: {mine} imports {imp} ({theirs})")
    assert wrong == []


# --- where imports go --------------------------------------------------------------------------


def test_imports_are_at_the_top_unless_heavy_or_in_the_cli():
    lazy = []
    for name, path in sorted(modules().items()):
        rel = path.relative_to(ROOT).as_posix()
        if rel in LAZY_ANYWHERE:
            continue
        for imp, line, top in imports(path):
            if top:
                continue
            targets = specc_targets(imp) if imp.split(".")[0] == "specc" else [imp]
            if not any(heavy(t) for t in targets) and (rel, imp) not in LAZY_FOR_A_REASON:
                lazy.append(f"{rel}:{line}: {imp}")
    assert lazy == [], "imports inside functions of light modules (move them to the top):\n" + "\n".join(lazy)


def test_the_heavy_check_sees_torch_through_specc():
    assert heavy("specc.nn") and heavy("torch.nn")
    assert not heavy("specc.spec.resolve") and not heavy("json")


# --- the repository speaks of itself -----------------------------------------------------------

OUTSIDE = "../" + "shared"  # the steering folder beside a checkout (spelled so this file does not match)
TEXT = ("*.py", "*.md", "*.toml", "*.yaml", "*.txt", "Makefile", "*.cfg")
LINK = re.compile(r"\]\(([^)#\s]+)")


def repository_files() -> list[Path]:
    """The repository's text files, not walking into the environments, builds and caches (a walk
    of everything and a filter after took 14 s on a machine with its environments installed)."""
    skip = {".git", ".venv", ".venv-serve", ".venv-bench", ".venv-clients", "build", ".pytest_cache"}
    out = []
    for folder, dirs, files in os.walk(ROOT):
        dirs[:] = sorted(d for d in dirs if d not in skip and not d.endswith(".egg-info"))
        out += [Path(folder) / f for f in sorted(files) if any(fnmatch.fnmatch(f, pattern) for pattern in TEXT)]
    return out


def test_nothing_links_outside_the_repository():
    outside = []
    for path in repository_files():
        text = path.read_text(errors="replace")
        for i, line in enumerate(text.splitlines(), 1):
            if OUTSIDE in line:
                outside.append(f"{path.relative_to(ROOT)}:{i}: {line.strip()}")
        if path.suffix == ".md":
            for target in LINK.findall(text):
                if "://" in target or target.startswith("mailto:"):
                    continue
                resolved = (path.parent / target).resolve()
                if ROOT not in resolved.parents and resolved != ROOT:
                    outside.append(f"{path.relative_to(ROOT)}: link to {target}")
    assert outside == []


def test_no_top_level_module_is_named_after_the_standard_library():
    names = {p.stem for p in PACKAGE.glob("*.py")} | {p.name for p in PACKAGE.iterdir() if (p / "__init__.py").is_file()}
    assert sorted(names & set(sys.stdlib_module_names)) == []


@pytest.mark.parametrize("name", ["inspect", "io"])
def test_the_stdlib_check_knows_the_names(name):
    assert name in sys.stdlib_module_names


# --- tests import their helpers from the tests package ------------------------------------------

# code that changes the import path: sys.path's mutators, an item or slice set, an assignment
SYS_PATH = re.compile(r"\bsys\.path\s*(\.\s*(insert|append|extend|remove|pop|clear)\b|\[|\+?=)")


def test_no_test_changes_the_import_path():
    """tests/ is a package (tests/__init__.py): pytest puts the repository root on the path, and a
    test imports its helpers as tests.helpers.NAME, a benchmark as benchmarks.NAME, a sibling test's
    helpers as tests.FOLDER.test_NAME. So does the code a test runs in a child process (started
    from the repository root), which this text scan reads too."""
    changed = [f"{path.relative_to(ROOT)}:{i}: {line.strip()}"
               for path in sorted((ROOT / "tests").rglob("*.py"))
               for i, line in enumerate(path.read_text().splitlines(), 1) if SYS_PATH.search(line)]
    assert changed == []


def test_the_import_path_check_can_fail():
    path = "sys" + ".path"  # spelled so this file does not match
    changes = [f"{path}.insert(0, str(EXAMPLES))", f"    {path}.append(here)", f"{path}[:0] = [d]",
               f"{path} = [d, *{path}]", f"{path} += [d]", f"{path}.pop(0)"]
    assert all(SYS_PATH.search(line) for line in changes)
    assert not SYS_PATH.search("pytest puts that root first on sys.path, as it does")
    assert not any(SYS_PATH.search(line) for line in ("parts = sys.path_hooks", "x = sys.path_importer_cache"))


def test_the_engines_first_line_is_specc_errors_own():
    """specc/decoding/errors.py's first_line, which a Triton repository runs without specc, is
    specc.errors.first_line to the statement (docstrings apart): one behaviour, two copies."""
    from specc import errors
    from specc.decoding import errors as engine

    def body(fn) -> str:
        node = ast.parse(textwrap.dedent(inspect.getsource(fn))).body[0]
        return ast.dump(ast.Module(body=node.body[1:], type_ignores=[]))

    assert body(errors.first_line) == body(engine.first_line)
    assert body(errors.first_line) != body(errors.SpecError.__init__)  # the comparison can tell them apart
