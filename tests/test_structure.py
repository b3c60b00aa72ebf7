"""The shape of the code the engine restructure promised (issue 23), kept from drifting:
no import cycle among tierkv, tierkv_backends and benchmarks (type-only imports included),
the prompt API holds its router instead of being one and uses no private member of it, and
tier capabilities are declared Protocols, not guessed from attributes or class names."""

from __future__ import annotations

import ast
import re
from pathlib import Path

from tierkv.backend import InPlaceTier, SupportsDemotion, SupportsPressure
from tierkv.engine.async_engine import AsyncEngine
from tierkv.routing.router import TierRouter
from tierkv_backends.cpu import CPUBackend
from tierkv_backends.gpu import GPUBackend
from tierkv_backends.lmdb import LMDBBackend

# the checkout's sources (tests/..), not the installed package: under tox tierkv is installed
# from a wheel, and site-packages has no benchmarks/ to check
ROOT = Path(__file__).resolve().parent.parent
PACKAGES = ("tierkv", "tierkv_backends", "benchmarks")
ENGINE_MODULES = ("routing/router.py", "tiers/tier.py", "routing/reads.py", "routing/locate.py", "routing/fill.py",
                  "routing/offload.py", "tiers/tier_pressure.py", "engine/async_engine.py", "engine/blocking.py",
                  "engine/chunk_layout.py", "engine/prefix_plans.py")
# tierkv's sub-packages bottom up (docs/design.md, "Layers"): a module imports only from its own
# layer or the ones below it; errors and metrics sit under all of them, the rest above
LAYERS = ("chunks", "policy", "backend", "config", "tiers", "routing", "engine")
BASE = ("tierkv.errors", "tierkv.metrics", "tierkv.ops")


def _modules() -> dict[str, Path]:
    found = {}
    for package in PACKAGES:
        for path in (ROOT / package).rglob("*.py"):
            name = ".".join(path.relative_to(ROOT).with_suffix("").parts)
            found[name.removesuffix(".__init__")] = path
    return found


def _imports(name: str, path: Path, modules: dict[str, Path]) -> set[str]:
    # a benchmark runs as a script with benchmarks/ as sys.path[0], so it imports its neighbours
    # (and the GPU check's package, gpu_checks) by bare name: resolve those under benchmarks too
    script_dir = "benchmarks." if name.startswith("benchmarks.") else ""

    def resolve(dotted: str) -> str | None:
        if script_dir and dotted.partition(".")[0] not in ("tierkv", "tierkv_backends"):
            if (found := resolve_in(script_dir + dotted)) is not None:
                return found
        return resolve_in(dotted)

    def resolve_in(dotted: str) -> str | None:
        while dotted and dotted not in modules:
            dotted = dotted.rpartition(".")[0]
        return dotted or None

    deps: set[str] = set()
    for node in ast.walk(ast.parse(path.read_text())):
        if isinstance(node, ast.Import):
            deps.update(filter(None, (resolve(alias.name) for alias in node.names)))
        elif isinstance(node, ast.ImportFrom):
            base = node.module or ""
            if node.level:
                parts = name.split(".") if path.name == "__init__.py" else name.split(".")[:-1]
                base = ".".join(parts[: len(parts) - node.level + 1] + ([base] if base else []))
            for alias in node.names:
                full = f"{base}.{alias.name}"
                deps.add(full if full in modules else resolve(base) or "")
    deps.discard("")
    deps.discard(name)
    return {dep for dep in deps if not name.startswith(dep + ".")}  # a package's own __init__ is no cycle


def test_no_import_cycle() -> None:
    modules = _modules()
    for package in PACKAGES:
        assert any(name.startswith(package + ".") for name in modules), f"no module of {package} found under {ROOT}"
    graph = {name: _imports(name, path, modules) for name, path in modules.items()}
    index: dict[str, int] = {}
    low: dict[str, int] = {}
    stack: list[str] = []
    cycles: list[list[str]] = []

    def visit(node: str) -> None:  # Tarjan's strongly connected components
        index[node] = low[node] = len(index)
        stack.append(node)
        for dep in graph.get(node, ()):
            if dep not in index:
                visit(dep)
                low[node] = min(low[node], low[dep])
            elif dep in stack:
                low[node] = min(low[node], index[dep])
        if low[node] == index[node]:
            component = []
            while True:
                member = stack.pop()
                component.append(member)
                if member == node:
                    break
            if len(component) > 1:
                cycles.append(sorted(component))

    for node in graph:
        if node not in index:
            visit(node)
    assert len(graph) > 50, "the module scan found too little to mean anything"
    assert cycles == [], f"import cycles: {cycles}"


def _layer(module: str) -> int | None:
    parts = module.split(".")
    if parts[0] != "tierkv" or len(parts) < 2:
        return None
    if module in BASE or any(module.startswith(base + ".") for base in BASE):
        return -1
    return LAYERS.index(parts[1]) if parts[1] in LAYERS else len(LAYERS)


def test_the_sub_packages_are_layers() -> None:
    modules = _modules()
    upward = []
    for name, path in modules.items():
        layer = _layer(name)
        if layer is None or layer == len(LAYERS):
            continue
        for dep in _imports(name, path, modules):
            dep_layer = _layer(dep)
            if dep_layer is not None and dep_layer > layer:
                upward.append(f"{name} -> {dep}")
    assert sum(_layer(name) == 0 for name in modules) > 5, "the layer scan found too little to mean anything"
    assert upward == [], f"imports from a layer above: {upward}"


def test_old_flat_module_paths_still_import_and_say_where_to() -> None:
    import importlib
    import warnings

    from tierkv.chunks import keys
    from tierkv.routing import router

    with warnings.catch_warnings(record=True) as caught:
        warnings.simplefilter("always")
        old_keys = importlib.import_module("tierkv." + "keys")  # (split: a path rewrite would not see it)
        old_router = importlib.import_module("tierkv." + "router")
        from tierkv.policy.residency import LRUIndex
    assert old_keys is keys and old_router is router
    assert LRUIndex is importlib.import_module("tierkv.policy.residency").LRUIndex
    said = [str(warning.message) for warning in caught if warning.category is DeprecationWarning]
    assert any("tierkv.chunks.keys" in message for message in said), said
    assert any("tierkv.routing.router" in message for message in said), said
    with __import__("pytest").raises(ModuleNotFoundError):
        importlib.import_module("tierkv.no_such_module")


def test_prompt_api_holds_a_router_and_uses_its_public_surface() -> None:
    assert not issubclass(AsyncEngine, TierRouter)
    private_use = re.compile(r"\brouter\._[a-z]")
    offenders = [f"{path.relative_to(ROOT)}:{number}" for path in (ROOT / "tierkv").rglob("*.py")
                 if path.relative_to(ROOT / "tierkv").as_posix() != "routing/router.py"
                 for number, line in enumerate(path.read_text().splitlines(), 1) if private_use.search(line)]
    assert offenders == [], f"private router members used outside the router: {offenders}"


def test_capabilities_are_declared_not_guessed() -> None:
    guess = re.compile(r"hasattr\(|__name__ ==")
    for module in ENGINE_MODULES:
        text = (ROOT / "tierkv" / module).read_text()
        assert not guess.search(text), f"tierkv/{module} guesses a capability"
    memory_tiers = (CPUBackend("c", 1 << 20, preallocate=False), GPUBackend("g", 1 << 20, device="cpu",
                                                                            preallocate=False))
    for tier in memory_tiers:
        assert isinstance(tier, InPlaceTier) and isinstance(tier, SupportsPressure)
        assert isinstance(tier, SupportsDemotion)
    assert [tier.device_memory for tier in memory_tiers] == [False, True]  # which memory pressure watches


def test_a_disk_tier_declares_no_memory_capability(tmp_path: Path) -> None:
    disk = LMDBBackend("d", 1 << 20, path=str(tmp_path / "lmdb"))
    try:
        assert not isinstance(disk, (InPlaceTier, SupportsPressure, SupportsDemotion))
    finally:
        import asyncio

        asyncio.run(disk.close())


def _missing_package(exc: BaseException) -> str | None:
    """The optional package (a serving engine, a backend's client library) whose absence made
    an import fail, following the chain of causes; None when the failure is something else."""
    import importlib.util

    seen: BaseException | None = exc
    while seen is not None:
        if isinstance(seen, ModuleNotFoundError) and seen.name:
            top = seen.name.partition(".")[0]
            if top not in ("tierkv", "tierkv_backends") and importlib.util.find_spec(top) is None:
                return top
        seen = seen.__cause__ or seen.__context__
    return None


def test_every_module_imports_and_says_what_it_is_for() -> None:
    """Each module of tierkv and tierkv_backends imports on its own (no import that only works
    after another module ran) and documents itself and every public function and class it
    defines: a newcomer reads the docstring before the code."""
    import importlib
    import inspect

    undocumented: list[str] = []
    imported = 0
    for name in sorted(_modules()):
        if name.startswith("benchmarks") or name.endswith("__main__"):
            continue
        try:
            module = importlib.import_module(name)
        except ImportError as exc:
            if _missing_package(exc) is not None:
                continue  # e.g. the vLLM connector in an env without vLLM, mooncake without its extra
            raise
        imported += 1
        if not (module.__doc__ or "").strip():
            undocumented.append(name)
        for attr, value in vars(module).items():
            if attr.startswith("_") or getattr(value, "__module__", None) != name:
                continue
            if (inspect.isclass(value) or inspect.isfunction(value)) and not (value.__doc__ or "").strip():
                undocumented.append(f"{name}.{attr}")
    assert imported >= 80, f"only {imported} modules found under {ROOT}"
    assert not undocumented, f"no docstring: {undocumented}"


def test_the_gpu_check_parts_say_their_job() -> None:
    """Each module of the GPU check's package (benchmarks/gpu_checks, issue 49) has one job, named
    by its docstring's first line, and documents every public function and class; read from the
    source (the package runs with benchmarks/ on sys.path, not as benchmarks.gpu_checks)."""
    paths = sorted((ROOT / "benchmarks" / "gpu_checks").glob("*.py"))
    assert len(paths) > 10, f"the GPU check's parts not found under {ROOT}"
    undocumented: list[str] = []
    for path in paths:
        tree = ast.parse(path.read_text())
        if not (ast.get_docstring(tree) or "").strip():
            undocumented.append(path.name)
        undocumented += [f"{path.name}:{node.name}" for node in tree.body
                         if isinstance(node, (ast.FunctionDef, ast.ClassDef)) and not node.name.startswith("_")
                         and not (ast.get_docstring(node) or "").strip()]
    assert not undocumented, f"no docstring: {undocumented}"


def test_a_long_module_says_why_it_is_one() -> None:
    """Modules stay at about 400 lines, or say at their top why they are one module."""
    unexplained = []
    for package in (*PACKAGES, "examples/tierkv-redis/src"):
        for path in (ROOT / package).rglob("*.py"):
            lines = path.read_text().count("\n")
            docstring = ast.get_docstring(ast.parse(path.read_text())) or ""
            if lines > 420 and "by choice" not in docstring:
                unexplained.append(f"{path.relative_to(ROOT)} ({lines} lines)")
    assert unexplained == [], f"over 400 lines with no word on why: {unexplained}"


def test_what_a_long_module_says_of_its_length_is_true() -> None:
    """A module that says "about N lines" at its top is within 15% of N: the reason it gives
    for being one module was given for that size."""
    import re

    untrue = []
    for package in (*PACKAGES, "examples/tierkv-redis/src"):
        for path in (ROOT / package).rglob("*.py"):
            text = path.read_text()
            said = re.search(r"about (\d[\d,]*) lines", ast.get_docstring(ast.parse(text)) or "")
            if said is None:
                continue
            claimed, lines = int(said.group(1).replace(",", "")), text.count("\n")
            if abs(lines - claimed) > 0.15 * claimed:
                untrue.append(f"{path.relative_to(ROOT)}: says about {claimed}, has {lines}")
    assert untrue == [], f"a module's note on its length is not true: {untrue}"


def test_the_longest_first_list_names_modules_that_exist() -> None:
    # read from the file: the module named conftest may be another folder's under xdist
    tree = ast.parse((ROOT / "tests" / "conftest.py").read_text())
    LONGEST_FIRST = next(ast.literal_eval(node.value) for node in tree.body if isinstance(node, ast.Assign)
                         and any(getattr(target, "id", "") == "LONGEST_FIRST" for target in node.targets))
    assert len(LONGEST_FIRST) > 5
    missing = [name for name in LONGEST_FIRST if not (ROOT / "tests" / name).is_file()]
    assert missing == [], f"tests/conftest.py LONGEST_FIRST names modules that are gone: {missing}"


def test_no_sphinx_roles_in_docstrings() -> None:
    """The API reference (mkdocstrings) shows a Sphinx role such as :class:`X` literally: names
    in docstrings are written as ``X``."""
    import re

    role = re.compile(r":(?:class|func|meth|mod|attr|data|exc|obj|ref|const):`")
    found = [f"{path.relative_to(ROOT)}:{number}" for package in PACKAGES for path in (ROOT / package).rglob("*.py")
             for number, line in enumerate(path.read_text().splitlines(), 1) if role.search(line)]
    assert found == [], f"Sphinx roles the docs site would show literally: {found[:10]}"

