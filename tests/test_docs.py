"""The README and the docs site say only true things about the repository: every `tox -e` env,
script, file path, `tierkv` subcommand and relative link they name exists, every YAML config
they show is one tierkv accepts, and every page is in mkdocs.yml's nav.

Fast and offline: nothing here starts a service or builds the site (`tox -e docs` does that)."""

from __future__ import annotations

import configparser
import contextlib
import functools
import importlib
import io
import re
import runpy
import sys
import unicodedata
from pathlib import Path

import pytest
import yaml

import tierkv

ROOT = Path(__file__).resolve().parents[1]
DOCS = ROOT / "docs"
PAGES = [ROOT / "README.md", *sorted(DOCS.rglob("*.md"))]

FENCE = re.compile(r"^([ \t]*)(```+)([\w+-]*)[^\n]*\n(.*?)^\1\2[ \t]*$", re.M | re.S)
INLINE = re.compile(r"`([^`\n]+)`")
LINK = re.compile(r"!?\[[^\]]*\]\(([^)\s]+)(?:\s+\"[^\"]*\")?\)")
# paths into the repository's own folders (a leading ~, /, $, . or word character means another place)
REPO_PATH = re.compile(r"(?<![\w/.~$-])((?:benchmarks|scripts|tests|examples|docs|tierkv|tierkv_backends|cuda_ext|\.ci)"
                       r"/[\w./-]*)")
SCRIPT = re.compile(r"\b(?:python3?|bash)\s+((?:benchmarks|scripts|tests|examples|\.ci)/[\w./-]+)")
TOX_ENV = re.compile(r"\btox\s+-e\s+([\w.,-]+)")
PYTHON_M = re.compile(r"\bpython3?\s+-m\s+(tierkv[\w.]*)((?:\s+[\w-]+)?)")
# `tierkv ...` in command position: at the start of a span or line, or after a shell operator
TIERKV_CLI = re.compile(r"(?:^|[;&|]\s*)tierkv((?:\s+--?[\w-]+)*)\s+([a-z][\w-]*)((?:\s+[^\s;&|#]+)*)", re.M)
HEADING = re.compile(r"^(#{1,6})\s+(.*?)\s*#*\s*$", re.M)

# top-level keys that make a YAML block a tierkv config (or a piece of one)
CONFIG_KEYS = {"model", "model_revision", "chunk_size", "kv_format", "dtype", "write_policy", "world_size",
               "worker_id", "tiers", "pressure", "background", "health", "recompute", "cost_aware"}
TOP_TIER = {"name": "docs-test-top", "backend": "cpu", "capacity": "1GiB"}


def page_id(page: Path) -> str:
    return str(page.relative_to(ROOT))


def read(page: Path) -> str:
    return page.read_text(encoding="utf-8")


def fenced(text: str) -> list[tuple[str, str]]:
    """(language, body) of every fenced code block, the body dedented to its fence."""
    blocks = []
    for match in FENCE.finditer(text):
        indent = len(match.group(1))
        body = "\n".join(line[indent:] if line[:indent].isspace() else line for line in match.group(4).splitlines())
        blocks.append((match.group(3).lower(), body))
    return blocks


def prose(text: str) -> str:
    """The text without its fenced code blocks."""
    return FENCE.sub("\n", text)


def code_texts(text: str) -> list[str]:
    """Every code block body and every inline code span."""
    return [body for _, body in fenced(text)] + INLINE.findall(prose(text))


def links(text: str) -> list[str]:
    """Targets of the Markdown links and images outside code."""
    return LINK.findall(INLINE.sub("code", prose(text)))


def is_external(target: str) -> bool:
    return bool(re.match(r"^[a-z][a-z0-9+.-]*:", target, re.I)) or target.startswith("//")


def slugify(heading: str) -> str:
    """Python-Markdown's toc anchor for a heading (what mkdocs and GitHub both link to here)."""
    text = re.sub(r"\[([^\]]*)\]\([^)]*\)", r"\1", heading).replace("`", "").replace("*", "")
    text = unicodedata.normalize("NFKD", text)
    text = re.sub(r"[^\w\s-]", "", text).strip().lower()
    return re.sub(r"[-\s]+", "-", text)


def anchors(page: Path) -> set[str]:
    return {slugify(match.group(2)) for match in HEADING.finditer(prose(read(page)))}


def ignored_dirs() -> list[str]:
    """Folders .gitignore names (benchmark outputs, fetched wheels): commands write them, a checkout lacks them."""
    lines = (ROOT / ".gitignore").read_text().splitlines()
    return [line.strip().lstrip("/") for line in lines if line.strip().endswith("/") and "/" in line.strip()[:-1]]


def tox_envs() -> set[str]:
    parser = configparser.ConfigParser(interpolation=None)
    parser.read(ROOT / "tox.ini")
    envs: set[str] = set()
    for section in parser.sections():
        if not section.startswith("testenv:"):
            continue
        name = section.split(":", 1)[1]
        match = re.fullmatch(r"([\w.-]*)\{([^}]*)\}([\w.-]*)", name)
        if match:
            envs |= {match.group(1) + factor + match.group(3) for factor in match.group(2).split(",")}
        else:
            envs.add(name)
    return envs


def cli_main():
    """The function behind the `tierkv` console script (pyproject.toml's [project.scripts])."""
    match = re.search(r'^tierkv\s*=\s*"([\w.]+):(\w+)"', (ROOT / "pyproject.toml").read_text(), re.M)
    assert match, "pyproject.toml: no `tierkv` console script"
    return getattr(importlib.import_module(match.group(1)), match.group(2))


def subcommands(help_text: str) -> set[str]:
    """The subcommands a command's help lists (``{status,drop}`` in its usage line)."""
    usage = help_text.split("\n\n", 1)[0]
    return {name for group in re.findall(r"\{([\w,-]+)\}", usage) for name in group.split(",")}


def cli_help(argv: list[str]) -> str | None:
    """The help text `tierkv ARGV --help` prints, or None when argparse refuses ARGV."""
    out, err = io.StringIO(), io.StringIO()
    with contextlib.redirect_stdout(out), contextlib.redirect_stderr(err):
        try:
            cli_main()([*argv, "--help"])
        except SystemExit as exc:
            return out.getvalue() if exc.code == 0 else None
    return out.getvalue()


@functools.cache
def module_help(module: str) -> tuple[int, str]:
    """`python -m MODULE --help`, run in this process (tierkv and torch are imported already): exit status, output."""
    out = io.StringIO()
    argv = sys.argv
    sys.argv = [module, "--help"]
    try:
        with contextlib.redirect_stdout(out), contextlib.redirect_stderr(out):
            runpy.run_module(module, run_name="__main__", alter_sys=True)
    except SystemExit as exc:
        return (exc.code if isinstance(exc.code, int) else 1), out.getvalue()
    except Exception as exc:  # an import error, a module that is not runnable
        return 1, f"{out.getvalue()}{type(exc).__name__}: {exc}"
    finally:
        sys.argv = argv
    return 0, out.getvalue()


PIP_INSTALL = re.compile(r"\bpip3?\s+install\s+([^\n;&|#`]*)")
INSTALL_PAGES = [*PAGES, *sorted((ROOT / "examples").glob("*/README.md"))]


def index_requirements(command: str) -> list[str]:
    """The distributions a ``pip install`` argument list would take from the package index:
    every argument that is not an option, a path (``.``, ``./x``, ``/x``) or an option's value."""
    names, words, skip_next = [], command.split(), False
    for word in words:
        word = word.strip("'\"")
        if skip_next:
            skip_next = False
            continue
        if word in ("-r", "-c", "-e", "--index-url", "--extra-index-url", "-i", "--target", "-t"):
            skip_next = word not in ("-e",)
            continue
        if not word or word.startswith(("-", ".", "/", "~", "$")):
            continue
        names.append(re.split(r"[\[<>=!~;@ ]", word, maxsplit=1)[0])
    return names


@pytest.mark.parametrize("page", INSTALL_PAGES, ids=page_id)
def test_no_install_line_takes_tierkv_from_the_index(page: Path) -> None:
    """The name ``tierkv`` on the public index is an unrelated project: every install line
    installs this checkout (a path) and names it nowhere as an index requirement."""
    wrong = [match.group(0).strip() for match in PIP_INSTALL.finditer(read(page))
             if any(re.sub(r"[-_.]+", "-", name).lower() == "tierkv" for name in index_requirements(match.group(1)))]
    assert not wrong, f"{page_id(page)} installs the index's 'tierkv', another project: {wrong}"


def test_the_example_backend_depends_on_this_distribution() -> None:
    """tierkv-redis, the example users copy, requires this project's distribution, never the
    index's 'tierkv' (installing it elsewhere would pull a stranger's code)."""
    import tomllib

    ours = tomllib.loads((ROOT / "pyproject.toml").read_text())["project"]["name"]
    example = tomllib.loads((ROOT / "examples" / "tierkv-redis" / "pyproject.toml").read_text())["project"]
    names = [re.split(r"[\[<>=!~; ]", requirement, maxsplit=1)[0] for requirement in example["dependencies"]]
    assert ours == "tierkv-engine" and ours in names and "tierkv" not in names


@pytest.mark.parametrize("page", PAGES, ids=page_id)
def test_tox_envs_exist(page: Path) -> None:
    envs = tox_envs()
    wrong = sorted({name for match in TOX_ENV.finditer(read(page)) for name in match.group(1).split(",")
                    if name and name not in envs})
    assert not wrong, f"{page_id(page)} names tox envs that tox.ini lacks: {wrong} (it has {sorted(envs)})"


@pytest.mark.parametrize("page", PAGES, ids=page_id)
def test_scripts_and_paths_exist(page: Path) -> None:
    text = read(page)
    skip = ignored_dirs()
    named = {match.group(1) for match in SCRIPT.finditer(text)}
    for code in code_texts(text):
        named |= {match.group(1) for match in REPO_PATH.finditer(code)}
    missing = []
    for path in sorted(named):
        path = path.rstrip(".")
        if any(ch in path for ch in "*{<") or any(path.startswith(folder) for folder in skip):
            continue
        if not (ROOT / path).exists():
            missing.append(path)
    assert not missing, f"{page_id(page)} names files the repository lacks: {missing}"


@pytest.mark.parametrize("page", PAGES, ids=page_id)
def test_tierkv_commands_exist(page: Path) -> None:
    wrong = []
    for code in code_texts(read(page)):
        for match in TIERKV_CLI.finditer(code):
            pre_flags, command = match.group(1).split(), match.group(2)
            words = match.group(3).split()
            post_flags = [word.split("=")[0] for word in words if word.startswith("-")]
            top = cli_help([])
            sub = cli_help([command])
            if sub is None:
                wrong.append(f"tierkv {command}: no such subcommand")
                continue
            if words and words[0] in subcommands(sub):
                action = cli_help([command, words[0]])  # a command's own subcommand: tierkv pool drop
                if action is None:
                    wrong.append(f"tierkv {command} {words[0]}: no such subcommand")
                    continue
                command, sub = f"{command} {words[0]}", action
            wrong += [f"tierkv {flag}: no such option" for flag in pre_flags if flag not in (top or "")]
            wrong += [f"tierkv {command} {flag}: no such option" for flag in post_flags if flag not in sub]
    assert not wrong, f"{page_id(page)}: {wrong}"


@pytest.mark.parametrize("page", PAGES, ids=page_id)
def test_python_m_tierkv_commands_exist(page: Path) -> None:
    wrong = []
    calls = {(m.group(1), m.group(2).strip()) for code in code_texts(read(page)) for m in PYTHON_M.finditer(code)}
    for module, command in sorted(calls):
        code, out = module_help(module)
        if code != 0:
            wrong.append(f"python -m {module} --help: exit status {code}: {out.strip().splitlines()[-1:]}")
        elif command and not command.startswith("-") and not re.search(rf"\b{re.escape(command)}\b", out):
            wrong.append(f"python -m {module} {command}: not in its --help")
    assert not wrong, f"{page_id(page)}: {wrong}"


def as_config(document: object) -> dict | None:
    """A YAML block as a whole tierkv config, or None when it is not one (nor a piece of one)."""
    if isinstance(document, dict) and CONFIG_KEYS & set(document):
        return {"model": "docs-test", "tiers": [TOP_TIER], **document}
    if isinstance(document, list) and document and all(isinstance(t, dict) and "backend" in t for t in document):
        return {"model": "docs-test", "tiers": [TOP_TIER, *document]}  # tier entries, shown alone
    return None


@pytest.mark.parametrize("page", PAGES, ids=page_id)
def test_yaml_configs_load(page: Path) -> None:
    wrong = []
    for index, (lang, body) in enumerate(fenced(read(page))):
        if lang not in ("yaml", "yml"):
            continue
        try:
            document = yaml.safe_load(body)
        except yaml.YAMLError as exc:
            wrong.append(f"yaml block {index}: not YAML: {' '.join(str(exc).split())}")
            continue
        config = as_config(document)
        if config is None:
            continue
        try:
            tierkv.load_config(config)  # validates every key and each tier's options; starts nothing
        except Exception as exc:
            wrong.append(f"yaml block {index}: {type(exc).__name__}: {exc}")
    assert not wrong, f"{page_id(page)}: {wrong}"


@pytest.mark.parametrize("page", PAGES, ids=page_id)
def test_relative_links_exist(page: Path) -> None:
    wrong = []
    for target in links(read(page)):
        if is_external(target):
            continue
        path, _, anchor = target.partition("#")
        dest = (page.parent / path).resolve() if path else page
        if not dest.is_relative_to(ROOT):
            wrong.append(f"{target}: outside the repository")
        elif page.is_relative_to(DOCS) and not dest.is_relative_to(DOCS):
            wrong.append(f"{target}: outside docs/ (the site has only docs/)")
        elif not dest.exists():
            wrong.append(f"{target}: no such file")
        elif anchor and dest.suffix == ".md" and anchor not in anchors(dest):
            wrong.append(f"{target}: no heading with that anchor")
    assert not wrong, f"{page_id(page)}: {wrong}"


def nav_files(nav: object) -> list[str]:
    if isinstance(nav, str):
        return [nav]
    if isinstance(nav, list):
        return [f for item in nav for f in nav_files(item)]
    if isinstance(nav, dict):
        return [f for value in nav.values() for f in nav_files(value)]
    return []


def test_every_page_in_nav() -> None:
    config = yaml.safe_load((ROOT / "mkdocs.yml").read_text())
    assert config.get("docs_dir", "docs") == "docs"
    listed = [f for f in nav_files(config["nav"]) if not is_external(f)]
    pages = {str(page.relative_to(DOCS)) for page in DOCS.rglob("*.md")}
    assert not pages - set(listed), f"pages missing from mkdocs.yml's nav: {sorted(pages - set(listed))}"
    assert not set(listed) - pages, f"mkdocs.yml's nav names pages docs/ lacks: {sorted(set(listed) - pages)}"


def test_api_reference_uses_public_names() -> None:
    """The API page documents objects under the names users import, which keep working when modules move."""
    names = re.findall(r"^:::\s*([\w.]+)", read(DOCS / "api.md"), re.M)
    assert names
    wrong = [name for name in names if not re.fullmatch(r"tierkv\.(?:(?:backend|testing)\.)?[A-Za-z]\w*", name)]
    assert not wrong, f"docs/api.md documents objects by module paths that are moving: {wrong}"


def test_every_layout_the_vllm_page_names_is_one_the_connector_accepts() -> None:
    """docs/vllm.md's ``layout:`` values, each given to the connector's settings loader."""
    from tierkv.integrations.vllm_v1.settings import settings_from

    named = re.search(r"`layout: ([\w|]+)`", read(DOCS / "vllm.md"))
    assert named, "docs/vllm.md names the layouts `layout:` can force"
    config = {"chunk_size": 256, "tiers": [{"name": "host", "backend": "cpu", "capacity": "16MiB"}]}
    for layout in named.group(1).split("|"):
        assert settings_from({"config": config, "layout": layout}, "kv_both", "m", 1).layout == layout


def test_every_vllm_connector_key_is_in_the_options_table() -> None:
    """Each key the connector's settings accept has a row in docs/vllm.md's table (a key added
    without docs fails here)."""
    from tierkv.integrations.vllm_v1 import settings

    rows = set(re.findall(r"^\| `(\w+)` \|", read(DOCS / "vllm.md"), re.M))
    assert set(settings._KNOWN) <= rows, f"undocumented kv_connector_extra_config keys: {set(settings._KNOWN) - rows}"


def test_the_configuration_reference_is_the_code_s() -> None:
    """docs/reference.md is generated from the declarations: every key and option documented
    (an option without a description fails here), and the page up to date with the code."""
    from tierkv.config import reference

    assert reference.undocumented() == [], "keys or options without a description"
    assert read(DOCS / "reference.md") == reference.reference_markdown(), (
        "docs/reference.md is not the code's: python -m tierkv.config.reference > docs/reference.md")



ARGS_ITEM = re.compile(r"(\*{0,2}\w+)(?:\s*\([^)]*\))?\s*:")


def api_objects() -> list[tuple[str, object]]:
    """Every object docs/api.md documents (``::: tierkv.X``), imported under that name."""
    objects = []
    for name in re.findall(r"^:::\s*([\w.]+)", read(DOCS / "api.md"), re.M):
        module, _, attr = name.rpartition(".")
        objects.append((name, getattr(importlib.import_module(module), attr)))
    return objects


def is_tierkv(module: str) -> bool:
    return module == "tierkv" or module.startswith("tierkv.")


def documented_callables(name: str, obj: object) -> list[tuple[str, object, str | None]]:
    """(name, function, the docstring that documents its parameters) for ``obj`` when it is a
    function; for a class, each public method it has from tierkv's classes (its own and those
    it inherits from one: not ``object``'s, ``Exception``'s or ``Protocol``'s), and its own
    ``__init__`` (documented by the class docstring) unless a dataclass made it. Properties are
    attributes, not calls: left out."""
    import dataclasses
    import inspect

    if inspect.isfunction(obj):
        return [(name, obj, obj.__doc__)]
    assert inspect.isclass(obj), f"{name}: neither a function nor a class"
    found: list[tuple[str, object, str | None]] = []
    init = vars(obj).get("__init__")
    if inspect.isfunction(init) and is_tierkv(init.__module__) and not dataclasses.is_dataclass(obj):
        found.append((f"{name}(...)", init, obj.__doc__))
    seen: set[str] = set()
    for klass in inspect.getmro(obj):
        if not is_tierkv(klass.__module__):
            continue
        for attr, value in vars(klass).items():
            if attr.startswith("_") or attr in seen:
                continue
            seen.add(attr)  # the first class in the MRO defining it is the one that counts
            if isinstance(value, (staticmethod, classmethod)):
                value = value.__func__
            if inspect.isfunction(value):
                found.append((f"{name}.{attr}", value, value.__doc__))
    return found


def args_section(doc: str) -> list[str] | None:
    """The parameter names a Google-style docstring's ``Args:`` section lists (``*args`` as
    ``args``); None when it has no such section."""
    import inspect

    lines = inspect.cleandoc(doc).splitlines()
    start = next((index for index, line in enumerate(lines) if line.strip() == "Args:"), None)
    if start is None:
        return None
    names: list[str] = []
    indent = None
    for line in lines[start + 1:]:
        if not line.strip():
            continue
        width = len(line) - len(line.lstrip())
        if indent is None:
            indent = width
        if width == 0 or width < indent:
            break  # the next section, or the end of an empty one
        match = ARGS_ITEM.match(line.strip())
        if width == indent and match:
            names.append(match.group(1).lstrip("*"))
    return names


def test_api_reference_documents_every_parameter() -> None:
    """Each public function and method of the objects docs/api.md lists that takes parameters
    (besides self / cls), and each such class's own constructor, has a Google-style ``Args:``
    section naming exactly its parameters: the API reference (mkdocstrings, ``docstring_style:
    google``) renders it as the Parameters table, and a parameter added without a word fails
    here. Read from the imported objects (``inspect``), so methods inherited from another
    tierkv class count, and dunder and private members do not."""
    import inspect

    wrong: list[str] = []
    checked = 0
    for name, obj in api_objects():
        for qualname, function, doc in documented_callables(name, obj):
            params = [parameter.name for parameter in inspect.signature(function).parameters.values()
                      if parameter.name not in ("self", "cls")]
            if not params:
                continue
            checked += 1
            listed = args_section(doc or "")
            if listed is None:
                wrong.append(f"{qualname}: no Args: section for {params}")
                continue
            missing = [param for param in params if param not in listed]
            unknown = [item for item in listed if item not in params]
            if missing:
                wrong.append(f"{qualname}: Args: lacks {missing}")
            if unknown:
                wrong.append(f"{qualname}: Args: names {unknown}, which it does not take")
    assert checked > 80, f"only {checked} callables with parameters found: the scan of docs/api.md is broken"
    assert not wrong, f"docstrings whose Args: section does not match the parameters: {wrong}"


def test_the_main_job_fits_its_budget_and_the_readme_says_how_long_it_takes() -> None:
    """`tox -e bench` on the reference machine, as benchmarks/progress.py estimates it from the
    parts' measured times, ends within its budget (15 minutes on every CPU kind), and the
    README's minutes for it are that estimate's, to within a minute."""
    sys.path.insert(0, str(ROOT / "benchmarks"))
    try:
        progress = importlib.import_module("progress")
    finally:
        sys.path.remove(str(ROOT / "benchmarks"))
    parts = [part for part in progress.REFERENCE_S if part != "serving"] + ["replicas"]  # run.py's defaults
    job = progress.Progress(parts, progress.REFERENCE_COPY_GBPS, progress.REFERENCE_MODEL_GFLOPS)
    job.replica_runs = job.replica_runs_within(progress.REPLICAS_SHARE_S)
    total = sum(job.estimate(part) for part in parts)
    assert total <= progress.BUDGET_S, f"the main job's estimate is {total / 60:.1f} min, over its budget"
    said = re.search(r"the main job (\d+(?:\.\d+)?) minutes", (ROOT / "README.md").read_text())
    assert said, "the README says how long the main job takes ('the main job N minutes')"
    assert abs(float(said.group(1)) * 60 - total) <= 60, (
        f"README: the main job {said.group(1)} minutes; benchmarks/progress.py: {total / 60:.1f}")
