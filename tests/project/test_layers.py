"""The layering, written down and enforced: every import runs down (or sideways without a circle).

Every ``import`` in the production code counts: at module level, inside a
function, or under ``if TYPE_CHECKING:``. Importing ``a.b.c`` also runs the
``__init__`` of ``a`` and ``a.b``, so those count as imported too (unless the
importer lives inside them). The test fails on:

- an import of a higher layer (an arrow that runs back up);
- a circle of modules, or of packages;
- the core importing a plugin distribution, or one plugin importing another.
"""

from __future__ import annotations

import ast
from pathlib import Path

REPO = Path(__file__).resolve().parents[2]
ROOTS = [REPO / "src", *sorted(p / "src" for p in (REPO / "plugins").iterdir() if (p / "src").is_dir())]

#: Bottom to top. A module may import its own layer and the layers below it.
LAYERS: list[set[str]] = [
    {
        "rlcore",
        "rlcore.data",
        "rlcore.models",
        "rlcore.plugins",
        "rlcore.safe_pickle",
        "rlcore.examples",
        "rlcore.tools",
    },
    {"rlcore.config", "rlcore.interfaces", "rlcore.chat"},
    {"rlcore.training", "rlcore.nemo_rl", "rlcore.refit", "rlcore.datasets", "rlcore.environments", "rlcore.serving"},
    {"rlcore.distributed"},
    {"rlcore.policy", "rlcore.preflight", "rlcore.doctor"},
    {
        "rlcore.run",
        "rlcore.algorithms",
        "rlcore.backends",
        "rl_dtensor",
        "rl_fsdp1",
        "rl_megatron",
        "rl_vllm",
        "rl_verifiers",
        "rl_verifiers_harness",
    },
    {"rlcore.cli", "rlcore.__main__"},
    {"rlcore.testing"},
]
PLUGIN_PACKAGES = {"rl_dtensor", "rl_fsdp1", "rl_megatron", "rl_vllm", "rl_verifiers", "rl_verifiers_harness"}


def production_modules() -> dict[str, Path]:
    modules = {}
    for root in ROOTS:
        for path in root.rglob("*.py"):
            parts = list(path.relative_to(root).with_suffix("").parts)
            if parts[-1] == "__init__":
                parts.pop()
            modules[".".join(parts)] = path
    return modules


def package_of(module: str) -> str:
    """The unit the layers are made of: ``rlcore.<sub>`` in the core, the top package of a plugin."""
    parts = module.split(".")
    return ".".join(parts[:2]) if parts[0] == "rlcore" and len(parts) > 1 else parts[0]


def layer_of(package: str) -> int | None:
    return next((i for i, layer in enumerate(LAYERS) if package in layer), None)


def _named(node: ast.AST, importer: str, is_package: bool) -> list[tuple[str, int]]:
    if isinstance(node, ast.Import):
        return [(alias.name, node.lineno) for alias in node.names]
    if not isinstance(node, ast.ImportFrom):
        return []
    base = node.module or ""
    if node.level:
        parts = importer.split(".")[: len(importer.split(".")) - node.level + (1 if is_package else 0)]
        base = ".".join([*parts, base] if base else parts)
    return [(f"{base}.{alias.name}", node.lineno) for alias in node.names] + [(base, node.lineno)]


def import_edges(modules: dict[str, Path]) -> dict[str, dict[str, int]]:
    """``{importer: {imported module: line}}`` over the production modules (see the module docstring)."""
    edges: dict[str, dict[str, int]] = {}
    for name, path in modules.items():
        out: dict[str, int] = {}
        is_package = path.name == "__init__.py"
        for node in ast.walk(ast.parse(path.read_text(encoding="utf-8"), str(path))):
            for target, line in _named(node, name, is_package):
                parts = target.split(".")
                while parts and ".".join(parts) not in modules:
                    parts.pop()  # ``from pkg import name``: the longest prefix that is a module
                for depth in range(1, len(parts) + 1):
                    module = ".".join(parts[:depth])
                    inside = name == module or name.startswith(module + ".")
                    if module in modules and not inside:
                        out.setdefault(module, line)
        edges[name] = out
    return edges


def circles(graph: dict[str, set[str]]) -> list[list[str]]:
    """Strongly connected components of more than one node (Tarjan, iterative)."""
    index: dict[str, int] = {}
    low: dict[str, int] = {}
    stack: list[str] = []
    on_stack: set[str] = set()
    found: list[list[str]] = []
    for root in sorted(graph):
        if root in index:
            continue
        work = [(root, iter(sorted(graph.get(root, ()))))]
        index[root] = low[root] = len(index)
        stack.append(root)
        on_stack.add(root)
        while work:
            node, children = work[-1]
            child = next(children, None)
            if child is not None:
                if child not in index:
                    index[child] = low[child] = len(index)
                    stack.append(child)
                    on_stack.add(child)
                    work.append((child, iter(sorted(graph.get(child, ())))))
                elif child in on_stack:
                    low[node] = min(low[node], index[child])
                continue
            work.pop()
            if work:
                low[work[-1][0]] = min(low[work[-1][0]], low[node])
            if low[node] == index[node]:
                component = []
                while True:
                    member = stack.pop()
                    on_stack.discard(member)
                    component.append(member)
                    if member == node:
                        break
                if len(component) > 1:
                    found.append(sorted(component))
    return found


MODULES = production_modules()
EDGES = import_edges(MODULES)


def test_every_package_has_a_layer():
    missing = sorted({package_of(m) for m in MODULES} - set().union(*LAYERS))
    assert not missing, f"packages with no layer in LAYERS: {missing}; place them"


def test_no_import_runs_back_up():
    upward = []
    for importer, targets in sorted(EDGES.items()):
        low = layer_of(package_of(importer))
        for target, line in sorted(targets.items()):
            high = layer_of(package_of(target))
            if low is not None and high is not None and high > low:
                upward.append(f"{MODULES[importer].relative_to(REPO)}:{line} imports {target} (layer {high} > {low})")
    assert not upward, "imports that run back up the layers:\n" + "\n".join(upward)


def test_no_circle_of_modules():
    found = circles({m: set(targets) for m, targets in EDGES.items()})
    assert not found, "circular imports:\n" + "\n".join(" -> ".join(c) for c in found)


def test_no_circle_of_packages():
    graph: dict[str, set[str]] = {}
    for importer, targets in EDGES.items():
        graph.setdefault(package_of(importer), set()).update(
            package_of(t) for t in targets if package_of(t) != package_of(importer)
        )
    found = circles(graph)
    assert not found, "packages that import each other:\n" + "\n".join(" <-> ".join(c) for c in found)


def test_the_core_never_imports_a_plugin_and_plugins_never_import_each_other():
    offenders = [
        f"{importer} imports {target}"
        for importer, targets in sorted(EDGES.items())
        for target in targets
        if package_of(target) in PLUGIN_PACKAGES and package_of(target) != package_of(importer)
    ]
    assert not offenders, "\n".join(offenders)


def test_the_checks_see_function_level_and_type_checking_imports():
    """Guard against a vacuous pass: imports inside functions and TYPE_CHECKING blocks are edges."""
    assert "rlcore.run.build" in EDGES["rlcore.algorithms.grpo.loop"]  # under ``if TYPE_CHECKING:``
    assert "rlcore.policy" in EDGES["rlcore.run.build"]  # inside build_run
    assert circles({"a": {"b"}, "b": {"c"}, "c": {"a"}, "d": {"a"}}) == [["a", "b", "c"]]
