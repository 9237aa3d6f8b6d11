"""The private torch names of the CUDA path (overlap_pass/torch_compat.py) against the installed torch.

The CUDA path runs only on GPU machines with one torch version; users install others. Here each
entry of PRIVATE_NAMES must resolve in the installed torch and take the arguments the project
passes: through inspect.signature, or an op's schema, or a pybind function's docstring; a C
function with none of those is checked by name only. A name missing from this build because it
is a CPU build (torch.version.cuda is None), or one its callers can do without, is skipped with
that reason. And lowering/ and templates/ must take every private torch name from torch_compat.
"""

import ast
import dataclasses
import importlib
import inspect
import pathlib
import re
import types

import pytest
import torch

from overlap_pass import torch_compat
from overlap_pass.torch_compat import PRIVATE_NAMES, PrivateName

ROOT = pathlib.Path(__file__).resolve().parents[2]
SCANNED = ("lowering", "templates")  # the CUDA path's folders
_P = inspect.Parameter


@dataclasses.dataclass
class Finding:
    record: PrivateName
    status: str  # "ok", "missing", "mismatch", or "unavailable" (absent for a stated reason)
    how: str = ""  # what the arguments were checked against: signature, schema, docstring, name
    detail: str = ""


def _resolve(dotted: str):
    """The object ``dotted`` names, importing modules on the way; LookupError naming the first
    part that is not there."""
    if dotted.startswith("torch.ops.symm_mem."):
        importlib.import_module("torch.distributed._symmetric_memory")  # registers the fused ops
    parts = dotted.split(".")
    obj, path = importlib.import_module(parts[0]), parts[0]
    for part in parts[1:]:
        path = f"{path}.{part}"
        try:
            obj = getattr(obj, part)
            continue
        except AttributeError:
            if not isinstance(obj, types.ModuleType):
                raise LookupError(path) from None
        try:
            obj = importlib.import_module(path)
        except ImportError:
            raise LookupError(path) from None
    return obj


def _schema_signature(schema) -> inspect.Signature:
    params = []
    for arg in schema.arguments:
        kind = _P.KEYWORD_ONLY if arg.kwarg_only else _P.POSITIONAL_OR_KEYWORD
        params.append(_P(arg.name, kind, default=None if arg.has_default_value() else _P.empty))
    return inspect.Signature(params)


def _top_level_split(text: str) -> list[str]:
    pieces, depth, start = [], 0, 0
    for i, ch in enumerate(text):
        depth += ch in "([{"
        depth -= ch in ")]}"
        if ch == "," and depth == 0:
            pieces.append(text[start:i])
            start = i + 1
    return [p.strip() for p in pieces + [text[start:]] if p.strip()]


def _docstring_signatures(obj) -> list[inspect.Signature]:
    """The signatures a pybind11 function's docstring states ("name(a: T, b: U = 0) -> R", one
    per overload)."""
    name = getattr(obj, "__name__", None)
    found = []
    for line in (getattr(obj, "__doc__", None) or "").splitlines():
        match = re.match(rf"(?:\d+\. )?{re.escape(name or '')}\(", line.strip()) if name else None
        if not match:
            continue
        rest, depth = line.strip()[match.end() :], 1
        for end, ch in enumerate(rest):
            depth += ch in "([{"
            depth -= ch in ")]}"
            if depth == 0:
                break
        params, kind = [], _P.POSITIONAL_OR_KEYWORD
        for piece in _top_level_split(rest[:end]):
            if piece == "*":
                kind = _P.KEYWORD_ONLY
            elif piece == "/":
                params = [p.replace(kind=_P.POSITIONAL_ONLY) for p in params]
            elif piece.startswith("**"):
                params.append(_P(piece[2:].split(":")[0].strip(), _P.VAR_KEYWORD))
            elif piece.startswith("*"):
                params.append(_P(piece[1:].split(":")[0].strip(), _P.VAR_POSITIONAL))
                kind = _P.KEYWORD_ONLY
            else:
                default = None if " = " in piece else _P.empty
                params.append(_P(piece.split(":")[0].split("=")[0].strip(), kind, default=default))
        found.append(inspect.Signature(params))
    return found


def _signatures(obj, record: PrivateName) -> tuple[list[inspect.Signature], str]:
    """What the installed torch says ``obj`` takes, and from where."""
    if record.kind == "op":
        return [_schema_signature(getattr(obj, o)._schema) for o in obj.overloads()], "schema"
    try:
        return [inspect.signature(obj)], "signature"
    except (TypeError, ValueError):
        pass
    if record.schema_of:
        packet = _resolve(record.schema_of)
        return [_schema_signature(getattr(packet, o)._schema) for o in packet.overloads()], "schema"
    found = _docstring_signatures(obj)
    return found, ("docstring" if found else "name")


def _call_problem(signature: inspect.Signature, record: PrivateName) -> str | None:
    """Why ``signature`` does not take the project's call (positional arguments by name and
    place, keywords by name), or None."""
    params = list(signature.parameters.values())
    if record.kind == "method":
        params = params[1:]  # self
    for place, name in enumerate(record.positional):
        param = params[place] if place < len(params) else None
        if param is not None and param.kind == _P.VAR_POSITIONAL:
            if param.name != name:
                return f"argument {place} is *{param.name}, the project passes {name}"
            break
        if param is None or param.kind not in (_P.POSITIONAL_ONLY, _P.POSITIONAL_OR_KEYWORD):
            return f"takes no argument {place} by position, the project passes {name} there"
        if param.name != name:
            return f"argument {place} is {param.name}, the project passes {name}"
    try:
        signature.replace(parameters=params).bind(
            *[None] * len(record.positional), **{k: None for k in record.keywords}
        )
    except TypeError as error:
        return f"does not take the project's call: {error}"
    return None


def check_name(record: PrivateName) -> Finding:
    try:
        obj = _resolve(record.name)
    except LookupError as error:
        if record.cuda_only and torch.version.cuda is None:
            detail = f"only in CUDA builds; torch {torch.__version__} is a CPU build"
            return Finding(record, "unavailable", detail=detail)
        if not record.required:
            return Finding(record, "unavailable", detail=f"not in torch {torch.__version__}; its callers do without")
        return Finding(record, "missing", detail=f"torch {torch.__version__} has no {error}")
    if record.kind == "class" and not isinstance(obj, type):
        return Finding(record, "mismatch", detail=f"{type(obj).__name__}, not a class")
    if record.kind == "op" and not hasattr(obj, "overloads"):
        return Finding(record, "mismatch", detail=f"{type(obj).__name__}, not an op")
    if record.kind not in ("function", "method", "op"):
        return Finding(record, "ok", "name")
    if not callable(obj):
        return Finding(record, "mismatch", detail=f"{type(obj).__name__} is not callable")
    signatures, how = _signatures(obj, record)
    if not signatures:
        return Finding(record, "ok", how, "callable; torch states no parameters for it")
    problems = [_call_problem(s, record) for s in signatures]
    if None in problems:
        return Finding(record, "ok", how)
    return Finding(record, "mismatch", how, "; ".join(problems))


def check_names(records) -> list[Finding]:
    return [check_name(r) for r in records]


@pytest.mark.parametrize("record", PRIVATE_NAMES, ids=lambda r: r.name)
def test_the_installed_torch_has_each_private_name_and_takes_the_projects_call(record):
    finding = check_name(record)
    if finding.status == "unavailable":
        pytest.skip(f"{record.name}: {finding.detail}")
    assert finding.status == "ok", f"{record.name} ({record.callers}): {finding.detail}"


def _changed(name: str, changes: dict) -> list[PrivateName]:
    """PRIVATE_NAMES with the entry ``name`` changed."""
    return [dataclasses.replace(r, **changes) if r.name == name else r for r in PRIVATE_NAMES]


_C10D = "torch.distributed.distributed_c10d._resolve_process_group"
_GATHER = "torch.ops.symm_mem.fused_all_gather_matmul"
_BUFFER = "torch._C._distributed_c10d._SymmetricMemory.get_buffer"
_SCALED_MM = "torch._scaled_mm"
_WRONG = {
    "name": (_C10D, dict(name="torch.distributed.distributed_c10d._resolve_process_groups"), "missing"),
    "op argument": (_GATHER, dict(positional=("A", "Bs", "gather_dim", "group")), "mismatch"),
    "op": (_GATHER, dict(name="torch.ops.symm_mem.fused_all_gather_matmul_v2"), "missing"),
    "argument order": (_BUFFER, dict(positional=("rank", "dtype", "sizes")), "mismatch"),
    "keyword": (_BUFFER, dict(keywords=("offset",)), "mismatch"),
    "schema keyword": (_SCALED_MM, dict(keywords=("out_dtype", "fast_accum")), "mismatch"),
    "signature keyword": (f"{torch_compat._TREES}.get_manager", dict(keywords=("create",)), "mismatch"),
}


@pytest.mark.parametrize("case", list(_WRONG))
def test_the_check_reports_exactly_the_one_wrong_name_or_argument(case):
    name, changes, status = _WRONG[case]
    findings = check_names(_changed(name, changes))
    wrong = [(f.record.name, f.status) for f in findings if f.status in ("missing", "mismatch")]
    assert wrong == [(changes.get("name", name), status)]


def _is_private(dotted: str) -> bool:
    parts = dotted.split(".")
    if parts[0] != "torch":
        return False
    if dotted.startswith(("torch.ops.symm_mem", "torch.ops._c10d_functional")):
        return True
    return any(p.startswith("_") and not (p.startswith("__") and p.endswith("__")) for p in parts[1:])


def private_torch_uses(source: str) -> list[tuple[int, str]]:
    """(line, dotted name) of every private torch name ``source`` imports or reaches through an
    attribute chain from torch or a name imported from it."""
    tree = ast.parse(source)
    aliases, uses = {}, []
    for node in ast.walk(tree):
        if isinstance(node, ast.Import):
            for alias in node.names:
                top = alias.name.split(".")[0]  # what a plain "import torch.x" binds
                aliases[alias.asname or top] = alias.name if alias.asname else top
                if _is_private(alias.name):
                    uses.append((node.lineno, alias.name))
        elif isinstance(node, ast.ImportFrom) and node.module and not node.level:
            for alias in node.names:
                full = f"{node.module}.{alias.name}"
                aliases[alias.asname or alias.name] = full
                if _is_private(full):
                    uses.append((node.lineno, full))
    inner = {id(node.value) for node in ast.walk(tree) if isinstance(node, ast.Attribute)}
    for node in ast.walk(tree):
        if not isinstance(node, ast.Attribute) or id(node) in inner:
            continue
        parts, base = [], node
        while isinstance(base, ast.Attribute):
            parts.append(base.attr)
            base = base.value
        if isinstance(base, ast.Name) and base.id in aliases:
            dotted = ".".join([aliases[base.id], *reversed(parts)])
            if _is_private(dotted):
                uses.append((node.lineno, dotted))
    return sorted(set(uses))


def test_the_scan_finds_private_names_however_reached():
    source = (
        "import torch\nimport torch.distributed as dist\nimport torch.distributed._symmetric_memory as sm\n"
        "from torch._inductor import cudagraph_trees\nfrom torch.distributed.distributed_c10d import _x\n"
        "torch._C._f(torch.cuda.current_stream(), torch.__version__)\ndist._y.z\ncudagraph_trees.get_manager\n"
        "torch.ops.symm_mem.fused(1)\ntorch.ops.overlap.all_gather_matmul\n"
    )
    assert [name for _, name in private_torch_uses(source)] == [
        "torch.distributed._symmetric_memory", "torch._inductor.cudagraph_trees",
        "torch.distributed.distributed_c10d._x", "torch._C._f", "torch.distributed._y.z",
        "torch._inductor.cudagraph_trees.get_manager", "torch.ops.symm_mem.fused",
    ]  # fmt: skip


def test_the_cuda_path_takes_private_torch_names_from_torch_compat():
    outside = [
        f"{path.relative_to(ROOT)}:{line}: {name}"
        for folder in SCANNED
        for path in sorted((ROOT / folder).glob("*.py"))
        if path.name != "torch_compat.py"
        for line, name in private_torch_uses(path.read_text())
    ]
    assert not outside, "use overlap_pass/torch_compat.py for these:\n" + "\n".join(outside)


def test_torch_compat_lists_every_private_name_it_reaches():
    listed = [r.name for r in PRIVATE_NAMES]
    source = pathlib.Path(torch_compat.__file__).read_text()
    unlisted = [
        f"line {line}: {name}"
        for line, name in private_torch_uses(source)
        if not any(entry == name or entry.startswith(name + ".") for entry in listed)
    ]
    assert not unlisted, "not in PRIVATE_NAMES:\n" + "\n".join(unlisted)
