"""gpusnap's import graph: no circles, nothing imports upward, and docs/DESIGN.md says it as it is.

The layers and the component graph are read from docs/DESIGN.md ("Layers and imports"), so
the document is the one statement of the architecture and this test keeps it true. The graph is
built with ast from src/gpusnap: imports at module level and inside functions count; imports
under ``if TYPE_CHECKING:`` do not (they never run, so they can neither form an import-time
circle nor load anything). ``python tests/unit/test_import_graph.py`` prints the graph block
DESIGN.md should hold.
"""

from __future__ import annotations

import ast
import re
import sys
from collections.abc import Iterator
from pathlib import Path

REPO = Path(__file__).resolve().parents[2]
SRC = REPO / "src" / "gpusnap"
DESIGN = REPO / "docs" / "DESIGN.md"


def modules(src: Path = SRC) -> dict[str, Path]:
    """Dotted module name -> file, for every module of the package (``gpusnap`` is __init__)."""
    out: dict[str, Path] = {}
    for path in sorted(src.rglob("*.py")):
        parts = list(path.relative_to(src.parent).with_suffix("").parts)
        if parts[-1] == "__init__":
            parts.pop()
        out[".".join(parts)] = path
    return out


def _runtime_imports(tree: ast.AST) -> Iterator[ast.Import | ast.ImportFrom]:
    """Every import statement that can run: anything but the body of ``if TYPE_CHECKING:``."""
    stack: list[ast.AST] = [tree]
    while stack:
        node = stack.pop()
        if isinstance(node, (ast.Import, ast.ImportFrom)):
            yield node
            continue
        if isinstance(node, ast.If) and _is_type_checking(node.test):
            stack.extend(node.orelse)
            continue
        stack.extend(ast.iter_child_nodes(node))


def _is_type_checking(test: ast.expr) -> bool:
    return (isinstance(test, ast.Name) and test.id == "TYPE_CHECKING") or (
        isinstance(test, ast.Attribute) and test.attr == "TYPE_CHECKING"
    )


def import_graph(src: Path = SRC) -> dict[str, set[str]]:
    """Module -> the gpusnap modules it imports (``from pkg import mod`` names ``pkg.mod``)."""
    mods = modules(src)
    graph: dict[str, set[str]] = {}
    for name, path in mods.items():
        is_pkg = path.name == "__init__.py"
        targets: set[str] = set()
        for node in _runtime_imports(ast.parse(path.read_text(), str(path))):
            if isinstance(node, ast.Import):
                bases = [alias.name for alias in node.names]
                names: list[str] = []
            else:
                if node.level:
                    here = name.split(".") if is_pkg else name.split(".")[:-1]
                    here = here[: len(here) - node.level + 1]
                    base = ".".join(here + ([node.module] if node.module else []))
                else:
                    base = node.module or ""
                bases, names = [base], [alias.name for alias in node.names]
            for base in bases:
                if base != "gpusnap" and not base.startswith("gpusnap."):
                    continue
                subs = [f"{base}.{n}" for n in names if f"{base}.{n}" in mods]
                if len(subs) < len(names) or not names:
                    # `import gpusnap.a.b` loads gpusnap.a.b; a name that is no module comes from base
                    targets.add(base if base in mods else base.rsplit(".", 1)[0])
                targets.update(subs)
        graph[name] = targets - {name}
    return graph


def cycles(graph: dict[str, set[str]]) -> list[list[str]]:
    """The strongly connected components with more than one member (Tarjan, iteratively)."""
    index: dict[str, int] = {}
    low: dict[str, int] = {}
    on_stack: set[str] = set()
    stack: list[str] = []
    found: list[list[str]] = []
    counter = 0
    for root in sorted(graph):
        if root in index:
            continue
        work = [(root, iter(sorted(graph.get(root, ()))))]
        index[root] = low[root] = counter
        counter += 1
        stack.append(root)
        on_stack.add(root)
        while work:
            node, it = work[-1]
            advanced = False
            for nxt in it:
                if nxt not in graph:
                    continue
                if nxt not in index:
                    index[nxt] = low[nxt] = counter
                    counter += 1
                    stack.append(nxt)
                    on_stack.add(nxt)
                    work.append((nxt, iter(sorted(graph.get(nxt, ())))))
                    advanced = True
                    break
                if nxt in on_stack:
                    low[node] = min(low[node], index[nxt])
            if advanced:
                continue
            work.pop()
            if work:
                low[work[-1][0]] = min(low[work[-1][0]], low[node])
            if low[node] == index[node]:
                comp = []
                while True:
                    member = stack.pop()
                    on_stack.discard(member)
                    comp.append(member)
                    if member == node:
                        break
                if len(comp) > 1:
                    found.append(sorted(comp))
    return found


# ---- what docs/DESIGN.md states ----------------------------------------------------------------


def _design_section() -> str:
    text = DESIGN.read_text()
    start = text.index("## Layers and imports")
    end = text.find("\n## ", start + 1)
    return text[start : end if end != -1 else len(text)]


def documented_layers() -> list[tuple[str, list[str]]]:
    """[(layer, [component, ...])], lowest first, from the table rows ``| n | layer | `a/`, `b.py` |``."""
    layers = []
    for row in re.findall(r"^\|\s*(\d+)\s*\|\s*([^|]+?)\s*\|\s*([^|]+?)\s*\|", _design_section(), re.M):
        names = [component_of_path(p) for p in re.findall(r"`([^`]+)`", row[2])]
        layers.append((row[1], names))
    return layers


def component_of_path(text: str) -> str:
    """`gpu/` -> gpusnap.gpu, `errors.py` -> gpusnap.errors, `__init__.py` -> gpusnap."""
    text = text.rstrip("/").removesuffix(".py")
    return "gpusnap" if text == "__init__" else f"gpusnap.{text}"


def documented_graph() -> str:
    block = re.search(r"```text\n(.*?)```", _design_section(), re.S)
    assert block, "docs/DESIGN.md's 'Layers and imports' needs the ```text component graph block"
    return block.group(1)


def component(module: str) -> str:
    return ".".join(module.split(".")[:2])


def component_graph(graph: dict[str, set[str]]) -> dict[str, set[str]]:
    out: dict[str, set[str]] = {}
    for src, targets in graph.items():
        out.setdefault(component(src), set()).update(component(t) for t in targets if component(t) != component(src))
    return out


def render_graph(graph: dict[str, set[str]], foundation: set[str]) -> str:
    """One line per component above the foundation: what it imports (the foundation left out)."""
    comps = component_graph(graph)
    lines = []
    for comp in sorted(c for c in comps if c not in foundation):
        targets = sorted(t.removeprefix("gpusnap.") for t in comps[comp] if t not in foundation)
        lines.append(f"{comp.removeprefix('gpusnap.'):<13}-> {' '.join(targets) or '(foundation only)'}")
    return "\n".join(lines) + "\n"


# ---- the tests ---------------------------------------------------------------------------------


def _layer_of() -> dict[str, int]:
    return {comp: rank for rank, (_, comps) in enumerate(documented_layers()) for comp in comps}


def test_every_component_has_a_layer() -> None:
    layer_of = _layer_of()
    assert [name for name, _ in documented_layers()][-1] == "entry points"
    loose = sorted({component(m) for m in import_graph()} - set(layer_of))
    assert not loose, f"place {loose} in a layer of docs/DESIGN.md's 'Layers and imports' table"


def test_no_import_circles() -> None:
    graph = import_graph()
    assert cycles(graph) == [], "import circles between modules"
    assert cycles(component_graph(graph)) == [], "import circles between packages"


def test_nothing_imports_upward() -> None:
    layer_of = _layer_of()
    names = [name for name, _ in documented_layers()]
    upward = [  # a component with no layer yet is test_every_component_has_a_layer's to report
        f"{src} ({names[layer_of[component(src)]]}) imports {dst} ({names[layer_of[component(dst)]]})"
        for src, targets in sorted(import_graph().items())
        for dst in sorted(targets)
        if component(src) in layer_of and layer_of.get(component(dst), -1) > layer_of[component(src)]
    ]
    assert upward == []


def test_entry_points_are_imported_by_nothing_else() -> None:
    entry = set(documented_layers()[-1][1])
    crossing = [
        f"{src} imports {dst}"
        for src, targets in sorted(import_graph().items())
        for dst in sorted(targets)
        if component(dst) in entry and component(dst) != component(src)
    ]
    assert crossing == []


def test_design_states_the_graph() -> None:
    foundation = set(documented_layers()[0][1])
    actual = render_graph(import_graph(), foundation)
    assert documented_graph() == actual, f"update the graph block in docs/DESIGN.md to:\n{actual}"


def test_graph_reader_sees_what_python_imports(tmp_path: Path) -> None:
    """The reader itself: function-level and relative imports count, TYPE_CHECKING ones do not."""
    pkg = tmp_path / "gpusnap"
    (pkg / "a").mkdir(parents=True)
    (pkg / "__init__.py").write_text("")
    (pkg / "a" / "__init__.py").write_text("")
    (pkg / "a" / "x.py").write_text("from . import y\ndef f():\n    from gpusnap.b import thing\n")
    (pkg / "a" / "y.py").write_text("TYPE_CHECKING = False\nif TYPE_CHECKING:\n    from gpusnap.a import x\n")
    (pkg / "b.py").write_text("import gpusnap.a.y\nfrom gpusnap import a\n")
    graph = import_graph(pkg)
    assert graph["gpusnap.a.x"] == {"gpusnap.a.y", "gpusnap.b"}
    assert graph["gpusnap.a.y"] == set()
    assert graph["gpusnap.b"] == {"gpusnap.a.y", "gpusnap.a"}
    assert cycles(graph) == []
    graph["gpusnap.a.y"].add("gpusnap.b")
    assert cycles(graph) == [["gpusnap.a.y", "gpusnap.b"]]


if __name__ == "__main__":
    sys.stdout.write(render_graph(import_graph(), set(documented_layers()[0][1])))
