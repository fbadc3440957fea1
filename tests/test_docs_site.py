"""The documentation site builds, covers the public API, and renders in a real browser.

``mkdocs build --strict`` (what ``make docs`` runs) fails on a broken link or anchor, an API
reference that does not resolve, a page left out of the navigation, or any other warning. The
built site is then served on 127.0.0.1 and two pages are loaded in headless Chromium (Debian's
``chromium``; ``.ci/run`` installs it), which must run the theme's JavaScript and fetch nothing
but the site's own files.
"""

from __future__ import annotations

import functools
import http.server
import json
import os
import re
import shutil
import subprocess
import sys
import threading
import time
from pathlib import Path

import pytest

ROOT = Path(__file__).resolve().parent.parent
CHROMIUM = shutil.which("chromium") or shutil.which("chromium-browser")
CONFIG_CLASSES = ("TrainConfig", "BackendConfig", "CheckpointConfig", "RunConfig", "ModelConfig", "OptimizerConfig",
                  "ScheduleConfig")


def build_site(site_dir: Path, config: Path = ROOT / "mkdocs.yml") -> subprocess.CompletedProcess:
    if importlib_spec("mkdocs") is None:
        pytest.fail("mkdocs is not installed here: the docs extra provides it (pip install -e '.[docs]'; "
                    "make venv installs it from requirements.lock)")
    env = {**os.environ, "NO_MKDOCS_2_WARNING": "1", "PYTHONPATH": str(ROOT / "src")}
    return subprocess.run([sys.executable, "-m", "mkdocs", "build", "--strict", "-f", str(config),
                           "--site-dir", str(site_dir)], capture_output=True, text=True, timeout=300, env=env,
                          stdin=subprocess.DEVNULL)


def importlib_spec(name: str):  # noqa: ANN201 - a ModuleSpec or None
    import importlib.util

    return importlib.util.find_spec(name)


@pytest.fixture(scope="module")
def site(tmp_path_factory: pytest.TempPathFactory) -> Path:
    out = tmp_path_factory.mktemp("site") / "site"
    started = time.perf_counter()
    proc = build_site(out)
    took = time.perf_counter() - started
    assert proc.returncode == 0, f"mkdocs build --strict failed:\n{proc.stdout[-3000:]}\n{proc.stderr[-6000:]}"
    warnings = [line for line in proc.stderr.splitlines() if line.startswith("WARNING")]
    assert not warnings, "\n".join(warnings)
    print(f"site built in {took:.1f} s")
    return out


def test_the_site_builds_strictly_with_every_page(site):
    pages = sorted(p.relative_to(ROOT / "docs").with_suffix("").as_posix() for p in (ROOT / "docs").rglob("*.md"))
    for page in pages:
        html = site / ("index.html" if page == "index" else f"{page}/index.html")
        assert html.is_file(), f"docs/{page}.md was not built into {html}"
    assert (site / "search" / "search_index.json").is_file(), "the search plugin wrote no index"


def test_a_broken_link_fails_the_build(tmp_path):
    """The site's own settings turn a broken link into a failed build (a one-page site with one)."""
    docs = tmp_path / "docs"
    docs.mkdir()
    (docs / "index.md").write_text("# Home\n\nSee [a page that is not there](guides/nowhere.md).\n")
    config = (ROOT / "mkdocs.yml").read_text()
    config = config[: config.index("\nnav:")].replace("docs_dir: docs", f"docs_dir: {docs}").replace(
        "tools/mkdocs_hooks.py", str(ROOT / "tools" / "mkdocs_hooks.py"))
    (tmp_path / "mkdocs.yml").write_text(config)
    proc = build_site(tmp_path / "site", tmp_path / "mkdocs.yml")
    assert proc.returncode != 0 and "guides/nowhere.md" in proc.stderr, proc.stderr[-3000:]


def test_the_api_reference_documents_everything_xlatrain_exports(site):
    import xlatrain

    documented = set()
    for page in (ROOT / "docs" / "reference").glob("*.md"):
        documented |= set(re.findall(r"^::: xlatrain\.(\w+)\s*$", page.read_text(), re.M))
    missing = sorted(set(xlatrain.__all__) - documented)
    assert not missing, f"xlatrain.__all__ names {missing}, which no page of docs/reference/ shows (add `::: xlatrain.NAME`)"
    built = (site / "reference" / "api" / "index.html").read_text() + (site / "reference" / "config" / "index.html").read_text()
    unrendered = [name for name in xlatrain.__all__ if f'id="xlatrain.{name}"' not in built]
    assert not unrendered, f"mkdocstrings rendered no entry for {unrendered}"


def test_docstrings_cross_references_render_as_links_or_code_not_as_roles(site):
    """Docstrings say :class:`~xlatrain.config.TrainConfig` (as help() shows it); the site showed
    the role as literal text."""
    html = (site / "reference" / "api" / "index.html").read_text()
    assert not re.findall(r":(?:class|mod|func|meth|attr):<code>", html)
    # ``~`` shows the last part only, linked to the page that documents it.
    assert re.search(r'<a class="autorefs[^"]*"[^>]*href="\.\./config/#xlatrain\.TrainConfig"><code>TrainConfig</code></a>', html)
    assert "<code>xlatrain.train.model_io</code>" in html  # a module no page documents: code, unlinked


_UNDOCUMENTED = """
import dataclasses, json, sys
import griffe
from xlatrain import config as config_module
module = griffe.load("xlatrain.config", search_paths=[sys.argv[1]], docstring_parser="google")
undocumented = []
for name in sys.argv[2:]:
    cls = module[name]
    in_section = {attr.name for section in (cls.docstring.parse("google") if cls.docstring else [])
                  if section.kind.value == "attributes" for attr in section.value}
    for field in dataclasses.fields(getattr(config_module, name)):
        member = cls.members.get(field.name)
        if field.name not in in_section and not (member is not None and member.docstring):
            undocumented.append(f"{name}.{field.name}")
print(json.dumps(undocumented))
"""


def test_every_config_field_is_documented():
    """Each field of every config class has a description griffe reads: a line of the class's
    ``Attributes:`` section or a docstring under the field. griffe runs in a process of its own:
    Python 3.11 parses in one interpreter-wide AST state, and a thread another test left behind
    that compiled at the same time made it raise 'AST constructor recursion depth mismatch'."""
    proc = subprocess.run([sys.executable, "-c", _UNDOCUMENTED, str(ROOT / "src"), *CONFIG_CLASSES],
                          capture_output=True, text=True, timeout=120, stdin=subprocess.DEVNULL)
    assert proc.returncode == 0, proc.stderr
    undocumented = json.loads(proc.stdout.strip().splitlines()[-1])
    assert not undocumented, f"config fields without a description in the API reference: {undocumented}"


def test_readme_links_lead_to_files_that_exist():
    text = (ROOT / "README.md").read_text()
    links = re.findall(r"\]\(([^)#\s]+)(?:#[^)]*)?\)", text)
    local = [link for link in links if not re.match(r"[a-z]+://", link)]
    assert local, "README links to no page of the documentation"
    broken = [link for link in local if not (ROOT / link).exists()]
    assert not broken, f"README links to files that do not exist: {broken}"


def test_the_built_pages_load_nothing_from_the_network(site):
    """No stylesheet, font, script or image comes from another host (links a reader may follow may)."""
    external = r"""=["'](?:https?:)?//"""
    loads = re.compile(rf"""<(?:script|img|iframe|source)\b[^>]*\ssrc{external}[^>]*>"""
                       rf"""|<link\b(?=[^>]*\srel=["'](?:stylesheet|preload|preconnect|modulepreload|icon)["'])[^>]*\shref{external}[^>]*>""")
    found = {page.relative_to(site).as_posix(): loads.findall(page.read_text()) for page in site.rglob("*.html")}
    found = {page: tags for page, tags in found.items() if tags}
    assert not found, f"pages that load files from the network: {found}"


# --- the site in a browser --------------------------------------------------------------------

class _Quiet(http.server.SimpleHTTPRequestHandler):
    requests: list[str]

    def log_message(self, format: str, *args: object) -> None:  # noqa: A002 - the base class's name
        self.requests.append(self.path)


@pytest.fixture
def served(site):
    requests: list[str] = []
    handler = functools.partial(type("Handler", (_Quiet,), {"requests": requests}), directory=str(site))
    server = http.server.ThreadingHTTPServer(("127.0.0.1", 0), handler)
    thread = threading.Thread(target=server.serve_forever, daemon=True)
    thread.start()
    try:
        yield f"http://127.0.0.1:{server.server_address[1]}", requests
    finally:
        server.shutdown()
        server.server_close()
        thread.join(timeout=10)


def chromium(args: list[str], url: str, profile: Path) -> subprocess.CompletedProcess:
    profile.mkdir(parents=True, exist_ok=False)
    flags = ["--headless", "--no-sandbox", "--disable-gpu", "--disable-quic", "--no-first-run",
             "--disable-background-networking", "--disable-component-update", "--disable-sync",
             f"--user-data-dir={profile}", "--virtual-time-budget=5000"]
    return subprocess.run([CHROMIUM, *flags, *args, url], capture_output=True, text=True, timeout=120,
                          stdin=subprocess.DEVNULL)


NAV = ["Getting started", "Your pipeline's pieces", "Devices and strategies", "What fits and how fast",
       "Diagnostics and the doctor", "Trainer and functions", "Configs"]


def _text(dom: str) -> str:
    """The DOM with whitespace around tags dropped and the apostrophe unescaped."""
    return re.sub(r">\s+", ">", re.sub(r"\s+<", "<", dom)).replace("&#39;", "'")


@pytest.mark.skipif(CHROMIUM is None, reason="chromium is not installed (apt-get install -y chromium; .ci/run does)")
def test_the_home_page_and_an_api_page_render_in_a_browser(site, served, tmp_path):
    base, requests = served
    pages = {
        "home": ("/", ['id="what-it-does"', "Getting started</a> installs it"]),
        "api": ("/reference/api/", ['id="xlatrain.Trainer"', 'id="xlatrain.Trainer.fit"', 'id="xlatrain.load_weights"',
                                    "Train for <code>config.epochs</code> epochs"]),
        "code": ("/getting-started/", []),
    }
    doms = {}
    for name, (path, content) in pages.items():
        proc = chromium(["--dump-dom"], base + path, tmp_path / f"profile-{name}")
        dom = doms[name] = _text(proc.stdout)
        assert proc.returncode == 0 and "</html>" in dom, f"chromium could not load {path}:\n{proc.stderr[-2000:]}"
        for entry in NAV:
            assert f">{entry}<" in dom, f"{path}: the navigation lacks {entry!r}"
        for text in content:
            assert text in proc.stdout, f"{path}: the page lacks {text!r}"
        # Material's JavaScript ran: it replaces the document's no-js class.
        assert re.search(r'<html[^>]*class="[^"]*\bjs\b', dom), f"{path}: Material's JavaScript did not run"
    # Code blocks get their copy buttons from the theme's JavaScript; the built page has none.
    assert 'data-md-type="copy"' in doms["code"], "no copy button on the code blocks: the theme's JavaScript failed"
    assert 'data-md-type="copy"' not in (site / "getting-started" / "index.html").read_text()
    # Search runs in the page, from the index the site holds; nothing else was asked of any server.
    assert "/search/search_index.json" in requests, f"the search index was not loaded from the site: {requests}"
    shot = tmp_path / "home.png"
    proc = chromium(["--window-size=1400,1000", f"--screenshot={shot}"], base + "/", tmp_path / "profile-shot")
    assert proc.returncode == 0 and shot.read_bytes()[:8] == b"\x89PNG\r\n\x1a\n", proc.stderr[-2000:]
    if os.environ.get("XLATRAIN_DOCS_SCREENSHOT"):  # to look at: XLATRAIN_DOCS_SCREENSHOT=/tmp/home.png
        shutil.copy(shot, os.environ["XLATRAIN_DOCS_SCREENSHOT"])
