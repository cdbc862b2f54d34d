"""Loading a spec: YAML with positions, ``extends:``, the catalog, and located errors.

    text --parse_yaml--> Located (data + positions) --extends: merge--> Located
         --pydantic + rules--> ModelSpec, or SpecError listing every issue at FILE:LINE:COL
"""
from __future__ import annotations

import difflib
import inspect
import os
import typing
from pathlib import Path
from typing import Any

from pydantic import BaseModel, ValidationError

from specc.errors import Issue, SpecError
from specc.spec.schema import ModelSpec
from specc.spec.yamlio import MAX_SPEC_BYTES, Located, parse_yaml

MAX_EXTENDS_DEPTH = 16
FILE_KEYS = ("weights", "tokenizer")  # top-level keys naming a path relative to the file that sets them


# --- the catalog ----------------------------------------------------------------------------


def catalog_dir() -> Path:
    """specs/ of a source checkout, or the copy shipped inside an installed package."""
    packaged = Path(__file__).resolve().parents[1] / "catalog"
    if packaged.is_dir() and any(packaged.glob("*.yaml")):
        return packaged
    return Path(__file__).resolve().parents[2] / "specs"


def catalog_names() -> list[str]:
    return sorted(p.stem for p in catalog_dir().glob("*.yaml"))


def catalog_path(name: str) -> Path | None:
    path = catalog_dir() / f"{name}.yaml"
    return path if path.is_file() else None


def _is_path_like(ref: str) -> bool:
    return "/" in ref or os.sep in ref or ref.endswith((".yaml", ".yml"))


def find_spec(ref: str | os.PathLike) -> Path:
    """A spec file from a path, or from a catalog name (``gpt2-small``)."""
    path = Path(ref)
    if path.is_file():
        return path
    if not _is_path_like(str(ref)) and catalog_path(str(ref)):
        return catalog_path(str(ref))
    hint = _suggest(str(ref), catalog_names())
    raise SpecError(Issue(f"no such spec file or catalog name{hint}", file=str(ref)))


# --- extends --------------------------------------------------------------------------------


def _read(path: Path, shown: str) -> str:
    try:
        size = path.stat().st_size
        if size > MAX_SPEC_BYTES:
            raise SpecError(Issue(f"spec file is {size} bytes, over the {MAX_SPEC_BYTES}-byte limit; refused", file=shown))
        raw = path.read_bytes()
    except OSError as exc:
        raise SpecError(Issue(f"cannot read spec file: {exc.strerror or exc}", file=shown)) from None
    try:
        return raw.decode("utf-8")
    except UnicodeDecodeError as exc:
        line = raw.count(b"\n", 0, exc.start) + 1
        column = exc.start - (raw.rfind(b"\n", 0, exc.start) + 1) + 1
        raise SpecError(Issue(f"spec file is not UTF-8 text ({exc.reason})", file=shown, line=line, column=column)) from None


def _field_default_kind(model: Any, key: str) -> str | None:
    """The kind a mapping at `key` of `model` has when it names none: its field's default's (the
    stack's attention multi_head, its ffn dense, ...); None where the field has no such default."""
    if not (inspect.isclass(model) and issubclass(model, BaseModel)):
        return None
    info = next((f for n, f in model.model_fields.items() if (f.alias or n) == key), None)
    return getattr(info.default, "kind", None) if info is not None and isinstance(info.default, BaseModel) else None


def _merge(parent: Located, child: Located) -> Located:
    """Deep-merge mappings (the child wins), lists and scalars replace. A mapping whose `kind`
    the child changes is replaced whole: the parent's keys belong to the other kind (a parent's
    mapping that names no kind has its field's default kind, where the field has one; a child's
    that names none keeps the parent's)."""

    def merge(a: Any, b: Any, ann: Any, kind: str | None) -> Any:
        """a and b merged, both mappings of annotation `ann` (of kind `kind`) or anything else."""
        if not (isinstance(a, dict) and isinstance(b, dict)):
            return b
        models = [c for c in _candidates(ann) if inspect.isclass(c) and issubclass(c, BaseModel)]
        model = models[0] if len(models) == 1 else next((c for c in models if _kind_of(c) == kind), None)
        out = dict(a)
        for k, v in b.items():
            if k not in a:
                out[k] = v
                continue
            old, default = a[k], _field_default_kind(model, k)
            kinds = (None, None)
            if isinstance(old, dict) and isinstance(v, dict):  # the child's kind, if it names none, is the parent's
                kinds = (old.get("kind", default), v.get("kind", old.get("kind", default)))
            if None not in kinds and kinds[0] != kinds[1]:
                out[k] = v
            else:
                out[k] = merge(old, v, _step(model, k) if model is not None else None, kinds[1] or kinds[0])
        return out

    data = merge(parent.data, child.data, ModelSpec, None)
    out = Located(data=data)

    def walk(value: Any, path: tuple) -> None:
        for table, src_c, src_p in ((out.values, child.values, parent.values), (out.keys, child.keys, parent.keys)):
            pos = src_c.get(path) or src_p.get(path)
            if pos:
                table[path] = pos
        if isinstance(value, dict):
            for k, v in value.items():
                walk(v, path + (k,))
        elif isinstance(value, list):
            for i, v in enumerate(value):
                walk(v, path + (i,))

    walk(data, ())
    return out


def _load_located(
    path: Path, shown: str, chain: tuple[Path, ...], text: str | None = None
) -> tuple[Located, dict[str, Path]]:
    """Parse ``path`` (or ``text``, as if it were that file) and everything it extends. Returns the
    merged data and, for each of the keys naming a file (FILE_KEYS: `weights:`, `tokenizer:`), the
    directory of the file that set it, which its path is relative to."""
    real = path.resolve()
    if len(chain) >= MAX_EXTENDS_DEPTH:
        raise SpecError(Issue(f"chain longer than {MAX_EXTENDS_DEPTH} files", file=shown, key="extends"))
    located = parse_yaml(_read(path, shown) if text is None else text, shown)
    data = located.data
    dirs = {key: real.parent for key in FILE_KEYS if data.get(key) is not None}
    ref = data.get("extends")
    if ref is None:
        return located, dirs
    _, line, col = located.values[("extends",)]
    if not isinstance(ref, str) or not ref:
        raise SpecError(Issue("must be a catalog name or a relative path", "extends", shown, line, col))
    if _is_path_like(ref):
        parent_path = real.parent / ref
        if not parent_path.is_file():
            raise SpecError(Issue(f"no file {ref!r} (looked for {parent_path})", "extends", shown, line, col))
        parent_shown = os.path.relpath(parent_path) if not os.path.isabs(ref) else ref
    else:
        parent_path = catalog_path(ref)
        if parent_path is None:
            hint = _suggest(ref, catalog_names())
            raise SpecError(Issue(f"no catalog spec named {ref!r}{hint}", "extends", shown, line, col))
        parent_shown = str(parent_path)
    if parent_path.resolve() in chain + (real,):
        names = " -> ".join(p.name for p in chain + (real, parent_path.resolve()))
        raise SpecError(Issue(f"cycle {names}", "extends", shown, line, col))
    try:
        parent, parent_dirs = _load_located(parent_path, parent_shown, chain + (real,))
    except SpecError as exc:
        via = f" (extended by {shown}:{line})"
        raise SpecError([Issue(i.message + via, i.key, i.file, i.line, i.column) for i in exc.issues]) from None
    return _merge(parent, located), {**parent_dirs, **dirs}


# --- pydantic errors to located issues ------------------------------------------------------


def _suggest(word: str, choices: list[str]) -> str:
    close = difflib.get_close_matches(str(word), [str(c) for c in choices], n=1, cutoff=0.6)
    return f"; did you mean {close[0]!r}?" if close else ""


def _candidates(ann: Any) -> list[Any]:
    """The types an annotation may hold: Annotated, Optional and Union unwrapped."""
    origin = typing.get_origin(ann)
    if origin is typing.Annotated:
        return _candidates(typing.get_args(ann)[0])
    if origin in (typing.Union, getattr(__import__("types"), "UnionType", None)):
        return [c for a in typing.get_args(ann) for c in _candidates(a)]
    return [ann]


def _fields(model: type[BaseModel]) -> dict[str, Any]:
    return {(f.alias or name): f.annotation for name, f in model.model_fields.items()}


def _kind_of(model: type[BaseModel]) -> str | None:
    f = model.model_fields.get("kind")
    return f.default if f is not None else None


def _step(ann: Any, part: Any) -> Any:
    for c in _candidates(ann):
        if inspect.isclass(c) and issubclass(c, BaseModel):
            if part in _fields(c):
                return _fields(c)[part]
            if part in (_kind_of(c), c.__name__):
                return c
        elif typing.get_origin(c) in (list, tuple) and isinstance(part, int):
            return typing.get_args(c)[0]
    return None


def _type_at(loc: tuple) -> Any:
    ann: Any = ModelSpec
    for part in loc:
        ann = _step(ann, part)
        if ann is None:
            return None
    return ann


def _is_tag(ann: Any, part: Any) -> bool:
    """Is ``part`` a union member's name that pydantic put into loc (a kind, or a type name)?"""
    for c in _candidates(ann):
        if inspect.isclass(c) and part in (c.__name__, _kind_of(c) if issubclass(c, BaseModel) else None):
            return True
    return isinstance(part, str) and part.startswith(("literal[", "function-"))


def _data_path(data: Any, loc: tuple) -> tuple:
    """pydantic's loc mapped onto the data: union tags (which are not keys) are skipped, a
    missing key is kept at the end."""
    path: list = []
    ann: Any = ModelSpec
    for part in loc:
        nxt = _step(ann, part) if ann is not None else None
        if isinstance(data, dict) and part in data or (
            isinstance(data, list) and isinstance(part, int) and 0 <= part < len(data)
        ):
            data = data[part]
            path.append(part)
        elif not isinstance(data, (dict, list)):
            break
        elif not _is_tag(ann, part):
            path.append(part)  # a missing key
            data = None
        ann = nxt
    return tuple(path)


def _message(err: dict, loc: tuple) -> str:
    kind, msg, ctx = err["type"], err["msg"], err.get("ctx") or {}
    if kind == "extra_forbidden":
        key = loc[-1]
        model = next((c for c in _candidates(_type_at(loc[:-1])) if inspect.isclass(c)), None)
        allowed = list(_fields(model)) if model else []
        owner_kind = _kind_of(model) if model else None
        text = f"unknown key {key!r}" + (f" for kind {owner_kind!r}" if owner_kind else "")
        siblings = [
            _kind_of(c)
            for c in _candidates(_type_at(loc[:-2]) if len(loc) >= 2 else None)
            if inspect.isclass(c) and issubclass(c, BaseModel) and key in _fields(c) and _kind_of(c)
        ]
        if owner_kind and siblings:
            return text + f" (it belongs to kind {' / '.join(repr(s) for s in siblings)})"
        hint = _suggest(key, allowed)
        return text + (hint or (f" (allowed: {', '.join(allowed)})" if allowed else ""))
    if kind == "missing":
        return f"missing required key {loc[-1]!r}"
    if kind == "union_tag_not_found":
        model = _type_at(loc)
        kinds = [_kind_of(c) for c in _candidates(model) if inspect.isclass(c)]
        return "missing 'kind'" + (f" (one of: {', '.join(k for k in kinds if k)})" if kinds else "")
    if kind == "union_tag_invalid":
        expected = [e.strip(" '") for e in str(ctx.get("expected_tags", "")).split(",")]
        return f"kind {ctx.get('tag')!r} is not one of {', '.join(expected)}" + _suggest(ctx.get("tag", ""), expected)
    if kind == "literal_error":
        expected = [e.strip(" '") for e in str(ctx.get("expected", "")).replace(" or ", ",").split(",")]
        got = err.get("input")
        return f"{got!r} is not one of {', '.join(e for e in expected if e)}" + _suggest(str(got), expected)
    if kind == "value_error":
        return msg.removeprefix("Value error, ")
    if kind == "bool_parsing" or kind == "bool_type":
        return "should be true or false"
    return msg[0].lower() + msg[1:] if msg else kind


def _locate(located: Located, path: tuple, message: str, key_pos: bool) -> Issue:
    pos = located.where(path, key=key_pos)
    file, line, col = pos if pos else (None, None, None)
    return Issue(message=message, key=".".join(map(str, path)), file=file, line=line, column=col)


def _issues_from_validation(exc: ValidationError, located: Located) -> list[Issue]:
    grouped: dict[tuple, list] = {}
    for err in exc.errors():
        loc = tuple(err["loc"])
        path = _data_path(located.data, loc)
        if err["type"] == "union_tag_invalid":
            path += ("kind",)  # point at the kind: line, not the mapping
        msg = _message(err, loc)
        key_pos = err["type"] == "extra_forbidden"
        grouped.setdefault((path, key_pos), [])
        if msg not in grouped[(path, key_pos)]:
            grouped[(path, key_pos)].append(msg)
    # an error at a path that has a more specific error below it is noise from a union branch
    deeper = {p[:n] for p, _ in grouped for n in range(len(p))}
    issues = [
        _locate(located, path, "; or ".join(msgs), key_pos)
        for (path, key_pos), msgs in grouped.items()
        if path not in deeper
    ]
    return sorted(issues, key=lambda i: (i.line or 0, i.column or 0))


# --- entry points ---------------------------------------------------------------------------


def validate_data(located: Located) -> ModelSpec:
    """Validate merged data; raise SpecError with every structural and rule issue found."""
    rule_issues: list = []
    try:
        spec = ModelSpec.model_validate(located.data, context={"rule_issues": rule_issues})
    except ValidationError as exc:
        raise SpecError(_issues_from_validation(exc, located)) from None
    if rule_issues:
        issues = [_locate(located, tuple(path), msg, False) for path, msg in rule_issues]
        raise SpecError(sorted(issues, key=lambda i: (i.line or 0, i.column or 0)))
    return spec


def load_spec(ref: str | os.PathLike) -> ModelSpec:
    """Load and validate a spec file (or a catalog name). Raises SpecError listing every issue."""
    path = find_spec(ref)
    shown = str(ref) if Path(ref).is_file() else str(path)
    located, dirs = _load_located(path, shown, ())
    try:
        spec = validate_data(located)
    except SpecError as exc:
        # an issue located in a parent file names the file that extends it
        raise SpecError([
            i if i.file in (shown, None) else Issue(i.message + f" (extended by {shown})", i.key, i.file, i.line, i.column)
            for i in exc.issues
        ]) from None
    spec._path = str(path.resolve())
    _file_paths(spec, dirs, path.resolve().parent)
    return spec


def loads_spec(text: str, file: str = "<string>", base_dir: str | os.PathLike | None = None) -> ModelSpec:
    """Load a spec from YAML text. ``extends:`` paths, ``weights:`` and ``tokenizer:`` resolve
    against base_dir (default: the current directory)."""
    base = Path(base_dir or ".").resolve()
    located, dirs = _load_located(base / (file.strip("<>") or "string"), file, (), text=text)
    spec = validate_data(located)
    _file_paths(spec, dirs, base)
    return spec


def _file_paths(spec: ModelSpec, dirs: dict[str, Path], base: Path) -> None:
    """The absolute paths of the spec's `weights:` and `tokenizer:`, each taken relative to the
    file that set it (`dirs`, from _load_located), else to `base`."""
    if spec.weights is not None:
        spec._weights_path = str((Path(dirs.get("weights", base)) / spec.weights).resolve())
    if spec.tokenizer is not None:
        spec._tokenizer_path = str((Path(dirs.get("tokenizer", base)) / spec.tokenizer).resolve())
