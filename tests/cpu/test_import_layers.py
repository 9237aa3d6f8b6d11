"""The project's imports go one way: no circle among its modules, counting the imports written
inside functions, and in the product each layer imports only the layers below it.

A function-level import of the product's own modules is allowed only where the module it
imports needs an optional dependency (triton: the lowering and the kernels, which a CPU install
need not have), so that importing overlap_pass does not need it; a circle is never allowed.

    python3 -m tests.cpu.test_import_layers      # prints every module's layer and imports
"""

import ast
import dataclasses
import os
import sys

ROOT = os.path.dirname(os.path.dirname(os.path.dirname(os.path.abspath(__file__))))

# folder -> the module name it installs as (setup.py's package_dir); tools, benchmarks and tests
# import as themselves from the repository root
PACKAGES = {
    "overlap_pass": "overlap_pass",
    "lowering": "overlap_pass.lowering",
    "templates": "overlap_pass.templates",
    "tools": "tools",
    "benchmarks": "benchmarks",
    "tests": "tests",
}
PRODUCT = ("overlap_pass",)

# The product's layers, bottom first: a module imports from its own layer or those below. A
# module takes the layer of the longest prefix here that names it.
LAYERS = (
    ("overlap_pass.config", "overlap_pass.torch_compat"),
    ("overlap_pass.ops.schedule", "overlap_pass.ops.matmul_ops", "overlap_pass.ops.scaled_ops",
     "overlap_pass.ops.all_reduce_op", "overlap_pass.ops"),
    ("overlap_pass.templates",),
    ("overlap_pass.lowering",),
    ("overlap_pass.ops.registry",),
    ("overlap_pass.graph",),
    ("overlap_pass.shapes.size_ranges",),
    ("overlap_pass.normalize", "overlap_pass.regions", "overlap_pass.fusion"),
    ("overlap_pass.pipeline",),
    ("overlap_pass.shapes.new_counts",),
    ("overlap_pass.backend", "overlap_pass.launch", "overlap_pass"),
)  # fmt: skip

# third-party packages a CPU install of the product may lack
OPTIONAL = ("triton",)


@dataclasses.dataclass(frozen=True)
class Import:
    source: str
    target: str
    line: int
    deferred: bool  # written inside a function (or class body), not at module level


def module_files(root: str = ROOT) -> dict[str, str]:
    """Every project module's name -> its file."""
    found = {}
    for folder, package in PACKAGES.items():
        for where, dirs, files in os.walk(os.path.join(root, folder)):
            dirs[:] = [d for d in dirs if not d.startswith((".", "__"))]
            for name in files:
                if not name.endswith(".py"):
                    continue
                relative = os.path.relpath(os.path.join(where, name), os.path.join(root, folder))[:-3]
                parts = [p for p in relative.split(os.sep) if p != "__init__"]
                found[".".join([package, *parts])] = os.path.join(where, name)
    return found


def _imported_names(module: str, path: str, node, modules: dict) -> list[str]:
    """The modules an import statement names (a name imported from a package counts as its
    submodule where there is one)."""
    if isinstance(node, ast.Import):
        names = [alias.name for alias in node.names]
    else:
        base = node.module or ""
        if node.level:
            package = module.split(".")
            if not path.endswith("__init__.py"):
                package = package[:-1]
            package = package[: len(package) - (node.level - 1)]
            base = ".".join(package + ([node.module] if node.module else []))
        names = [f"{base}.{alias.name}" if f"{base}.{alias.name}" in modules else base for alias in node.names]
    found = []
    for name in names:
        while name and name not in modules:  # a name inside a module: the module
            name = name.rpartition(".")[0]
        if name and name != module:
            found.append(name)
    return found


def _third_party(node) -> list[str]:
    if isinstance(node, ast.Import):
        return [alias.name.partition(".")[0] for alias in node.names]
    return [] if node.level else [(node.module or "").partition(".")[0]]


def project_imports(root: str = ROOT) -> tuple[list[Import], dict[str, set[str]]]:
    """Every import of a project module by a project module, and each module's third-party
    packages imported at module level."""
    modules = module_files(root)
    imports, packages = [], {}
    for module, path in modules.items():
        with open(path) as f:
            tree = ast.parse(f.read(), path)
        top_level = {id(n) for n in tree.body}
        # module level includes `if` / `try` blocks at the top: they run at import
        for statement in tree.body:
            if isinstance(statement, (ast.If, ast.Try)):
                top_level |= {id(n) for n in ast.walk(statement)}
        packages[module] = set()
        for node in ast.walk(tree):
            if not isinstance(node, (ast.Import, ast.ImportFrom)):
                continue
            deferred = id(node) not in top_level
            for target in _imported_names(module, path, node, modules):
                imports.append(Import(module, target, node.lineno, deferred))
            if not deferred:
                packages[module].update(_third_party(node))
    return imports, packages


def circles(imports: list[Import]) -> list[list[str]]:
    """The strongly connected groups of more than one module (Tarjan's algorithm, iterative)."""
    edges: dict[str, set[str]] = {}
    for i in imports:
        edges.setdefault(i.source, set()).add(i.target)
        edges.setdefault(i.target, set())
    index, low, on_stack, stack, found = {}, {}, set(), [], []
    for start in sorted(edges):
        if start in index:
            continue
        work = [(start, iter(sorted(edges[start])))]
        index[start] = low[start] = len(index)
        stack.append(start)
        on_stack.add(start)
        while work:
            node, targets = work[-1]
            for target in targets:
                if target not in index:
                    index[target] = low[target] = len(index)
                    stack.append(target)
                    on_stack.add(target)
                    work.append((target, iter(sorted(edges[target]))))
                    break
                if target in on_stack:
                    low[node] = min(low[node], index[target])
            else:
                work.pop()
                if work:
                    low[work[-1][0]] = min(low[work[-1][0]], low[node])
                if low[node] == index[node]:
                    group = []
                    while True:
                        member = stack.pop()
                        on_stack.discard(member)
                        group.append(member)
                        if member == node:
                            break
                    if len(group) > 1:
                        found.append(sorted(group))
    return found


def layer_of(module: str) -> int | None:
    best, best_length = None, -1
    for layer, prefixes in enumerate(LAYERS):
        for prefix in prefixes:
            if (module == prefix or module.startswith(prefix + ".")) and len(prefix) > best_length:
                best, best_length = layer, len(prefix)
    return best


def _needs_optional(module: str, imports: list[Import], packages: dict) -> bool:
    """Whether importing ``module`` imports an optional dependency (module-level imports,
    followed through the project)."""
    seen, todo = set(), [module]
    at_top = {}
    for i in imports:
        if not i.deferred:
            at_top.setdefault(i.source, []).append(i.target)
    while todo:
        current = todo.pop()
        if current in seen:
            continue
        seen.add(current)
        if packages.get(current, set()) & set(OPTIONAL):
            return True
        todo.extend(at_top.get(current, []))
    return False


def _where(i: Import) -> str:
    return f"{i.source}:{i.line} -> {i.target}{' (in a function)' if i.deferred else ''}"


def test_no_circle_among_the_project_modules():
    imports, _ = project_imports()
    found = circles(imports)
    described = []
    for group in found:
        members = set(group)
        edges = [_where(i) for i in imports if i.source in members and i.target in members]
        described.append(f"{len(group)} modules: " + "; ".join(sorted(edges)))
    assert not found, "import circles:\n" + "\n".join(described)


def test_every_product_module_has_a_layer():
    modules = [m for m in module_files() if m.startswith(PRODUCT)]
    assert [m for m in modules if layer_of(m) is None] == []


def test_the_product_imports_downward():
    imports, _ = project_imports()
    upward = [
        f"{_where(i)} (layer {layer_of(i.source)} imports layer {layer_of(i.target)})"
        for i in imports
        if i.source.startswith(PRODUCT) and layer_of(i.target) is not None and layer_of(i.target) > layer_of(i.source)
    ]
    assert not upward, "imports against the layers (tests/cpu/test_import_layers.py LAYERS):\n" + "\n".join(upward)


def test_function_level_imports_of_the_product_only_for_optional_dependencies():
    imports, packages = project_imports()
    hidden = [
        _where(i) for i in imports
        if i.deferred and i.source.startswith(PRODUCT) and i.target.startswith(PRODUCT)
        and not _needs_optional(i.target, imports, packages)
    ]  # fmt: skip
    assert not hidden, (
        "imports of the product's own modules inside functions, whose target needs no optional "
        f"dependency ({', '.join(OPTIONAL)}): import them at module level\n" + "\n".join(hidden)
    )


def test_the_checks_find_what_they_look_for(tmp_path):
    """A circle through a function-level import, and one at module level, are found; a module
    that needs triton counts as optional, one that does not, not."""
    package = tmp_path / "overlap_pass"
    package.mkdir()
    (package / "__init__.py").write_text("")
    (package / "config.py").write_text("import os\n")
    (package / "a.py").write_text("from . import b\n")
    (package / "b.py").write_text("def f():\n    from overlap_pass import a\n")
    (package / "c.py").write_text("from overlap_pass import d\n")
    (package / "d.py").write_text("from . import c\n")
    (package / "k.py").write_text("import triton\n")
    imports, packages = project_imports(str(tmp_path))
    assert sorted(circles(imports)) == [["overlap_pass.a", "overlap_pass.b"], ["overlap_pass.c", "overlap_pass.d"]]
    assert [i.deferred for i in imports if i.source == "overlap_pass.b"] == [True]
    assert _needs_optional("overlap_pass.k", imports, packages)
    assert not _needs_optional("overlap_pass.a", imports, packages)


if __name__ == "__main__":
    imports, packages = project_imports()
    for module in sorted(module_files()):
        targets = sorted({_where(i).split(" -> ", 1)[1] for i in imports if i.source == module})
        print(f"{module} (layer {layer_of(module)}): {', '.join(targets) or '-'}")
    for group in circles(imports):
        print("circle:", ", ".join(group))
    sys.exit(1 if circles(imports) else 0)
