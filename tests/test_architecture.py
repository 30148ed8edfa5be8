"""The layout's rules: layered imports, no import circle, plain-data cores without TensorFlow,
and a README map that names every module."""
import ast
import os
import re
import subprocess
import sys

import pytest

PACKAGE = os.path.join(os.path.dirname(os.path.dirname(os.path.abspath(__file__))), "tfoverlap")
README = os.path.join(os.path.dirname(PACKAGE), "README.md")

# Lower layers never import higher ones. A module's layer is that of its longest prefix.
LAYERS = {
    "tfoverlap.log": 0,
    "tfoverlap.graph": 0,
    "tfoverlap.costs": 1,
    "tfoverlap.schedulers": 2,
    "tfoverlap.sim.engine": 2,
    "tfoverlap.rewriters": 2,
    "tfoverlap.options": 2,
    "tfoverlap.planning": 3,
    "tfoverlap.passes": 4,
    "tfoverlap.sim": 4,
    "tfoverlap.integrations": 5,
    "tfoverlap.api": 6,
    # The Horovod wrappers, in layers of their own: settings and measurements; the core
    # (rules, decisions, plans, layout: plain data); the two backends (session: TF1,
    # pending work across runs; in_call: within one tf.function call); the adapters of
    # each API; the public modules (wrappers, keras, the package).
    "tfoverlap.horovod.settings": 7.0,
    "tfoverlap.horovod.measure": 7.0,
    "tfoverlap.horovod.core": 7.1,
    "tfoverlap.horovod.session": 7.2,
    "tfoverlap.horovod.in_call": 7.2,
    "tfoverlap.horovod.adapters": 7.3,
    "tfoverlap.horovod": 7.4,
    "tfoverlap.launcher": 7.5,
    "tfoverlap.boot": 9,
    "tfoverlap.cli": 9,          # entry points and tools: may use anything below
    "tfoverlap.__main__": 9,
    "tfoverlap.testbed": 9,
    "tfoverlap.bench": 9,
}


def _modules() -> dict[str, str]:
    found = {}
    for directory, _, files in os.walk(PACKAGE):
        for name in files:
            if name.endswith(".py"):
                path = os.path.join(directory, name)
                relative = os.path.relpath(path, os.path.dirname(PACKAGE))[:-3]
                module = relative.replace(os.sep, ".").removesuffix(".__init__")
                found[module] = path
    return found


def _imports(path: str, modules) -> set[str]:
    """Every tfoverlap module that ``path`` imports, at module level or inside a function."""
    imported = set()
    for node in ast.walk(ast.parse(open(path).read())):
        if isinstance(node, ast.Import):
            names = [alias.name for alias in node.names]
        elif isinstance(node, ast.ImportFrom) and node.module and node.level == 0:
            names = [node.module] + [f"{node.module}.{alias.name}" for alias in node.names]
        else:
            continue
        for name in names:
            if name.startswith("tfoverlap") and name in modules:
                imported.add(name)
    return imported


def _layer(module: str) -> float:
    prefixes = [p for p in LAYERS if module == p or module.startswith(p + ".")]
    return LAYERS[max(prefixes, key=len)]


def _graph():
    modules = _modules()
    return {m: _imports(path, modules) - {m, "tfoverlap"} for m, path in modules.items()}


def test_every_module_has_a_layer_and_a_docstring():
    for module, path in _modules().items():
        if module == "tfoverlap":
            continue
        _layer(module)
        assert ast.get_docstring(ast.parse(open(path).read())), f"{module} has no docstring"


def test_imports_go_down_the_layers():
    wrong = [(m, i) for m, imported in _graph().items() if m != "tfoverlap"
             for i in imported if _layer(i) > _layer(m)]
    assert not wrong, f"modules importing a higher layer: {wrong}"


def test_no_module_imports_one_of_its_importers():
    graph = _graph()
    state: dict[str, int] = {}

    def visit(module, path):
        state[module] = 1
        for imported in sorted(graph.get(module, ())):
            if state.get(imported) == 1:
                cycle = path[path.index(imported):] + [imported]
                pytest.fail("import circle: " + " -> ".join(cycle))
            if imported not in state:
                visit(imported, path + [imported])
        state[module] = 2

    for module in sorted(graph):
        if module not in state:
            visit(module, [module])


@pytest.mark.parametrize("modules", [
    "tfoverlap",
    "tfoverlap.schedulers.tictac, tfoverlap.schedulers.caramel, tfoverlap.sim.engine",
    "tfoverlap.horovod.core.contract, tfoverlap.horovod.core.decisions, "
    "tfoverlap.horovod.core.layout, tfoverlap.horovod.core.plans",
])
def test_plain_data_cores_import_without_tensorflow_or_the_plugin(modules):
    code = (f"import sys, {modules}\n"
            "loaded = [m for m in sys.modules if m == 'tensorflow' or m.startswith('tensorflow.')"
            " or m == 'tfoverlap.integrations.grappler']\n"
            "print(loaded)")
    result = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True,
                            timeout=120)
    assert result.returncode == 0, result.stderr
    assert result.stdout.strip() == "[]"


def test_public_names_resolve_lazily():
    import tfoverlap
    for name in tfoverlap.__all__:
        assert getattr(tfoverlap, name) is not None
    with pytest.raises(AttributeError, match="no attribute 'no_such_name'"):
        tfoverlap.no_such_name  # noqa: B018


def test_readme_layout_names_every_module():
    text = open(README).read()
    layout = text[text.index("## Layout"):]
    layout = layout[:layout.index("\n## ", 1)]
    missing = []
    for module, path in _modules().items():
        name = os.path.basename(path)
        package = os.path.basename(os.path.dirname(path))
        if name == "__init__.py" and module != "tfoverlap":
            name = package + "/"
        if not re.search(r"(?<![\w/])" + re.escape(name), layout):
            missing.append(module)
    assert not missing, f"README's Layout section does not name: {missing}"


def test_the_horovod_wrappers_stay_in_small_pieces():
    """tfoverlap/horovod/ was a matrix of APIs x mechanisms in files of up to 700 lines;
    its layers keep each module under 450 lines and each function under 80."""
    too_long = []
    for module, path in _modules().items():
        if not module.startswith("tfoverlap.horovod"):
            continue
        source = open(path).read()
        if len(source.splitlines()) > 450:
            too_long.append(f"{module}: {len(source.splitlines())} lines")
        for node in ast.walk(ast.parse(source)):
            if isinstance(node, (ast.FunctionDef, ast.AsyncFunctionDef)):
                length = node.end_lineno - node.lineno + 1
                if length > 80:
                    too_long.append(f"{module}.{node.name}: {length} lines")
    assert not too_long, too_long
