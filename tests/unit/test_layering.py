"""Lower layers never import higher ones (DESIGN.md section 4, docs/architecture.md).

Every ``import`` of an ``mpistrat`` module, at module level or inside a function, is read
from the source with ``ast`` and checked against the layer table below.
"""

import ast
from pathlib import Path

ROOT = Path(__file__).resolve().parents[2] / "mpistrat"

# module prefix -> layer (longest prefix wins)
LAYERS = {
    "mpistrat.errors": 0, "mpistrat.nest": 0, "mpistrat.partition": 0,
    "mpistrat.safe_files": 0,      # below the formats: tfformats writes and reads through it
    "mpistrat.tfformats": 0, "mpistrat.io": 0.5,   # ms.io parses over TensorFlow's formats
    "mpistrat.keras.adapter": 0,   # Keras's private names, behind one adapter (imports Keras only)
    "mpistrat.runtime": 1, "mpistrat.cluster_resolver": 1, "mpistrat.cluster_spec": 0, "mpistrat.config": 1,
    "mpistrat.tpu": 1,
    "mpistrat.collectives": 2,
    "mpistrat.distribute": 3, "mpistrat.experimental": 3,
    "mpistrat.data": 2.5,   # datasets, below the strategies (distribute/input_lib.py distributes them)
    "mpistrat.checkpoint": 5, "mpistrat.train": 5, "mpistrat.nn": 5,
    "mpistrat.preemption": 5.5,
    "mpistrat.keras": 6,   # Keras's fit under a strategy (its adapter above is layer 0)
    "mpistrat.__main__": 6, "mpistrat": 6,            # the package's __init__ ties all together
}


def layer(module: str) -> float:
    best = max((p for p in LAYERS if module == p or module.startswith(p + ".")), key=len)
    return LAYERS[best]


def imports(path: Path, module: str):
    package = module if path.name == "__init__.py" else module.rsplit(".", 1)[0]
    for node in ast.walk(ast.parse(path.read_text(), str(path))):
        if isinstance(node, ast.Import):
            yield from (a.name for a in node.names if a.name.startswith("mpistrat"))
        elif isinstance(node, ast.ImportFrom):
            base = node.module or ""
            if node.level:
                parts = package.split(".")[: len(package.split(".")) - node.level + 1]
                base = ".".join(parts + ([base] if base else []))
            if base.startswith("mpistrat"):
                yield from ((f"{base}.{a.name}" if f"{base}.{a.name}".replace(".", "/")
                             in _MODULES else base) for a in node.names)


_MODULES = {str(p.relative_to(ROOT.parent).with_suffix("")).replace("/__init__", "")
            for p in ROOT.rglob("*.py")}


def test_no_module_imports_a_higher_layer():
    upward = []
    for path in sorted(ROOT.rglob("*.py")):
        module = str(path.relative_to(ROOT.parent).with_suffix("")).replace("/", ".")
        module = module.removesuffix(".__init__")
        for target in imports(path, module):
            if layer(target) > layer(module):
                upward.append(f"{module} (layer {layer(module)}) imports {target} "
                              f"(layer {layer(target)})")
    assert not upward, "\n".join(upward)


def test_the_table_knows_every_module():
    assert layer("mpistrat.io.example") > layer("mpistrat.tfformats.bundle") >= \
        layer("mpistrat.safe_files")
    assert layer("mpistrat.preemption") > layer("mpistrat.checkpoint.manager") > \
        layer("mpistrat.distribute.input_lib") > layer("mpistrat.data.readers") > \
        layer("mpistrat.collectives.engine")


def _graph():
    """module -> the mpistrat modules it imports (module level or inside a function)."""
    graph = {}
    for path in sorted(ROOT.rglob("*.py")):
        module = str(path.relative_to(ROOT.parent).with_suffix("")).replace("/", ".")
        module = module.removesuffix(".__init__")
        graph[module] = {t for t in imports(path, module) if t != module}
    return graph


def circles(graph) -> list:
    """The import circles of ``graph``: its strongly connected components of two or more
    modules (Tarjan's algorithm, iterative), each sorted."""
    index, low, on_stack, stack, found, counter = {}, {}, set(), [], [], [0]
    for start in graph:
        if start in index:
            continue
        work = [(start, iter(sorted(graph.get(start, ()))))]
        index[start] = low[start] = counter[0]; counter[0] += 1
        stack.append(start); on_stack.add(start)
        while work:
            node, children = work[-1]
            child = next(children, None)
            if child is None:
                work.pop()
                if work:
                    low[work[-1][0]] = min(low[work[-1][0]], low[node])
                if low[node] == index[node]:
                    component = []
                    while True:
                        member = stack.pop(); on_stack.discard(member)
                        component.append(member)
                        if member == node:
                            break
                    if len(component) > 1:
                        found.append(sorted(component))
            elif child not in index:
                index[child] = low[child] = counter[0]; counter[0] += 1
                stack.append(child); on_stack.add(child)
                work.append((child, iter(sorted(graph.get(child, ())))))
            elif child in on_stack:
                low[node] = min(low[node], index[child])
    return found


def test_the_circle_finder_finds_a_circle_inside_one_layer():
    graph = {"a.x": {"a.y"}, "a.y": {"a.z"}, "a.z": {"a.x"}, "a.w": {"a.x"}}
    assert circles(graph) == [["a.x", "a.y", "a.z"]]
    assert circles({"a.x": {"a.y"}, "a.y": set()}) == []


def test_no_modules_import_each_other_in_a_circle():
    """Within a layer too: two modules that need each other are one concept or need a third.
    A package's ``__init__`` (which hands on its modules' names) is left out as a target."""
    graph = _graph()
    packages = {m for m in graph if (ROOT.parent / m.replace(".", "/") / "__init__.py").exists()}
    graph = {m: {t for t in targets if t not in packages} for m, targets in graph.items()}
    found = circles(graph)
    assert not found, "\n".join(" <-> ".join(c) for c in found)
