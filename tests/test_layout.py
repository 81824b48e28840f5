"""The layout's bounds (issue 63): the Python side in sub-packages that mirror the layers,
at most 8 modules at the top of ``src/smartinf/``, no import cycle between modules (an import
inside a function counts), no Python file over 450 lines and no native file over 700."""
import ast
from pathlib import Path

ROOT = Path(__file__).resolve().parents[1]
PACKAGE = ROOT / "src" / "smartinf"
TOP_MODULES, PYTHON_LINES, NATIVE_LINES = 8, 450, 700


def modules() -> dict:
    """Dotted name -> path of every module of the package."""
    found = {}
    for path in [*PACKAGE.rglob("*.py"), *PACKAGE.rglob("*.pyx"), *PACKAGE.rglob("*.py.in")]:
        parts = path.relative_to(PACKAGE.parent).parts
        parts = (*parts[:-1], parts[-1].split(".")[0])
        found[".".join(parts[:-1] if parts[-1] == "__init__" else parts)] = path
    return found


def imports(path: Path, name: str, known: dict) -> set:
    """The package's modules that ``path`` (module ``name``) imports, anywhere in it."""
    package = name if path.name == "__init__.py" else name.rpartition(".")[0]
    out = set()
    if path.suffix != ".py":  # the binding (Cython) and the build's record import none
        return set()
    tree = ast.parse(path.read_text())
    for node in ast.walk(tree):  # ``if TYPE_CHECKING:`` blocks import nothing at run time
        if isinstance(node, ast.If) and getattr(node.test, "id", None) == "TYPE_CHECKING":
            node.body = []
    for node in ast.walk(tree):
        if isinstance(node, ast.Import):
            out.update(a.name for a in node.names if a.name in known)
        elif isinstance(node, ast.ImportFrom):
            base = node.module or ""
            if node.level:
                base = ".".join(package.split(".")[:len(package.split(".")) - node.level + 1]
                                + ([node.module] if node.module else []))
            for a in node.names:  # a module, or a name of ``base``'s own
                out.add(f"{base}.{a.name}" if f"{base}.{a.name}" in known else base)
    out.discard(name)
    return out & set(known)


def test_at_most_eight_modules_at_the_top():
    top = sorted(p.name for p in PACKAGE.glob("*.py"))
    assert len(top) <= TOP_MODULES, top


def test_no_import_cycle():
    known = modules()
    graph = {name: imports(path, name, known) for name, path in known.items()}
    # a package's __init__ importing its own modules is not a cycle through them
    graph = {n: {m for m in deps if not (n == m.rpartition(".")[0] or m == n.rpartition(".")[0])}
             for n, deps in graph.items()}
    state: dict = {}

    def visit(node, stack):
        state[node] = "open"
        for dep in sorted(graph[node]):
            if state.get(dep) == "open":
                raise AssertionError("import cycle: " + " -> ".join(stack[stack.index(dep):] + [dep]))
            if dep not in state:
                visit(dep, stack + [dep])
        state[node] = "done"
    for node in sorted(graph):
        if node not in state:
            visit(node, [node])


def test_file_lengths():
    long_python = {str(p.relative_to(ROOT)): n for p in PACKAGE.rglob("*.py")
                   if (n := len(p.read_text().splitlines())) > PYTHON_LINES}
    native = [*(ROOT / "src" / "native").rglob("*.*"), *(ROOT / "hls_kernels").glob("*.*")]
    long_native = {str(p.relative_to(ROOT)): n for p in native
                   if p.suffix in (".h", ".cc", ".cu", ".cpp")
                   and (n := len(p.read_text().splitlines())) > NATIVE_LINES}
    assert not long_python and not long_native, (long_python, long_native)


CLASS_LINES = 300  # (issue 43's bound; issue 75 brought _StorageOptimizer and SmartInfinityStage3 back)


def test_class_lengths():
    """Each class of the package, its lines (a class that outgrows it splits along a seam:
    a mixin of its own, as the optimizers' layout and the DeepSpeed integration's overlap)."""
    import ast
    long = {}
    for p in PACKAGE.rglob("*.py"):
        for node in ast.walk(ast.parse(p.read_text())):
            if isinstance(node, ast.ClassDef) and node.end_lineno - node.lineno + 1 > CLASS_LINES:
                long[f"{p.relative_to(ROOT)}:{node.name}"] = node.end_lineno - node.lineno + 1
    assert not long, long
