"""The docs stay short, and every repository path and module they cite exists.

- Each doc under docs/ is under 600 lines; docs/*.md together under 3,500.
- Every path in backquotes in docs/*.md and README.md that starts in this repository
  (``mindspeed_laga/``, ``tests/``, ``scripts/``, ``patches/``, ``features/``, ``docs/``,
  ``.ci/``, or a package folder such as ``kernels/`` or ``sparse/``) names a file or folder
  that exists. ``{a,b}`` alternatives and ``*`` globs are expanded; ``file.py::name`` and
  ``module.name`` must name something the file defines.
- Every dotted module in backquotes (``mindspeed_laga.x``, ``patches.x``, ``features.x``)
  resolves to a file, its trailing parts to names that file defines.
- DESIGN.md's "Layout of the repository" names every top module of the package and every
  package folder, so it lists what is in the tree now.

Sections (anchors) are checked by tests/core/test_doc_citations.py. Host paths (the
MindSpeed-LLM or Megatron tree: ``pretrain_gpt.py``, ``training/checkpointing.py``) do not
start in this repository and are not checked. The checker is tried on made-up citations first,
so a checker that finds nothing cannot pass for clean docs.
"""
from __future__ import annotations

import glob
import re
from pathlib import Path

import pytest

ROOT = Path(__file__).resolve().parents[2]
MAX_LINES_PER_DOC = 600
MAX_LINES_ALL_DOCS = 3500

_TOP = ("mindspeed_laga", "tests", "scripts", "patches", "features", "docs", ".ci")
_PACKAGES = ("mindspeed_laga", "patches", "features")
# Installed names of the adapter folders (setup.py's package_dir).
_INSTALLED = {"mindspeed_laga.patches": "patches", "mindspeed_laga.features": "features"}
# Host trees whose paths look like this repository's: MindSpeed-LLM's own tests/poc/ and docs/en/.
_HOST_PATHS = ("tests/poc/", "docs/en/")
_CODE = re.compile(r"`([^`\n]+)`")
_PATH = re.compile(r"^[\w.{},*-]+(?:/[\w.{},*-]*)+(?:::[\w]+)?$")
_MODULE = re.compile(r"^(?:mindspeed_laga|patches|features)(?:\.\w+)+$")


def _subfolders(root: Path):
    """The top folders a doc may name a path from: the repository's own, and each package's."""
    names = set(_TOP)
    for pkg in ("mindspeed_laga", "features"):  # patches/'s folders share the hosts' names
        base = root / pkg
        if base.is_dir():
            names |= {p.name for p in base.iterdir() if p.is_dir() and p.name != "__pycache__"}
    return names


def _expand(path: str):
    """``a/{b,c}.py`` -> ``a/b.py``, ``a/c.py``."""
    m = re.search(r"\{([^{}]*)\}", path)
    if not m:
        return [path]
    return [x for alt in m.group(1).split(",") for x in _expand(path[:m.start()] + alt + path[m.end():])]


def _defines(file: Path, name: str) -> bool:
    text = file.read_text(encoding="utf-8", errors="replace")
    # a def, a class, an assignment, an import, or a lazy table's key (``"name": ".module"``)
    return re.search(rf"^\s*(?:async\s+)?(?:def|class)\s+{name}\b|^\s*{name}\s*[:=]|import[^\n]*\b{name}\b"
                     rf"|[\"']{name}[\"']\s*:", text, flags=re.M) is not None


def _candidates(root: Path, path: str):
    """Where a cited path may live: from the root, or inside a package."""
    yield root / path
    for pkg in _PACKAGES:
        yield root / pkg / path


def _path_exists(root: Path, cited: str) -> bool:
    path, _, name = cited.partition("::")
    path = path.rstrip("/")
    for one in _expand(path):
        found = False
        for cand in _candidates(root, one):
            hits = [Path(p) for p in glob.glob(str(cand))] if "*" in one else ([cand] if cand.exists() else [])
            if not hits and not name and "." in cand.name and cand.suffix not in (".py", ".sh", ".md", ".txt"):
                # ``vocab/blocks.SCORE_CHUNK_ELEMENTS``: a module and a name it defines
                mod, _, attr = cand.name.partition(".")
                file = cand.with_name(mod + ".py")
                hits = [file] if file.is_file() and _defines(file, attr) else []
            if hits and (not name or any(h.is_file() and _defines(h, name) for h in hits)):
                found = True
                break
        if not found:
            return False
    return True


def _module_exists(root: Path, dotted: str) -> bool:
    for installed, folder in _INSTALLED.items():
        if dotted == installed or dotted.startswith(installed + "."):
            dotted = folder + dotted[len(installed):]
    parts = dotted.split(".")
    for cut in range(len(parts), 0, -1):
        base = root.joinpath(*parts[:cut])
        rest = parts[cut:]
        for file in (base.with_suffix(".py"), base / "__init__.py"):
            if file.is_file():
                return not rest or _defines(file, rest[0])
    return False


def cited(text: str, root: Path = ROOT):
    """(line, kind, citation) of each repository path ("path") and module ("module") in ``text``."""
    tops = _subfolders(root)
    out = []
    for m in _CODE.finditer(text):
        token = m.group(1).strip()
        line = text.count("\n", 0, m.start()) + 1
        if _MODULE.match(token):
            out.append((line, "module", token))
        elif _PATH.match(token) and token.split("/")[0] in tops and "..." not in token \
                and not token.startswith(_HOST_PATHS):
            out.append((line, "path", token))
    return out


def missing(text: str, root: Path = ROOT):
    """The citations in ``text`` that do not resolve, as ``line: citation``."""
    out = []
    for line, kind, token in cited(text, root):
        ok = _module_exists(root, token) if kind == "module" else _path_exists(root, token)
        if not ok:
            out.append(f"{line}: {kind} {token}")
    return out


def doc_files(root: Path = ROOT):
    return sorted((root / "docs").glob("*.md")) + [root / "README.md"]


# ----------------------------------------------------------------- the checker itself

GOOD = ["`mindspeed_laga/api.py`", "`kernels/sdpa.py`", "`tests/core/`", "`mindspeed_laga.api`",
        "`tools/costmodel/{config,comm}.py`", "`tests/tools/test_docs.py::test_checker_passes_a_real_path`",
        "`mindspeed_laga.api.laga_attention`", "`pretrain_gpt.py`", "`training/checkpointing.py`",
        "`sparse/stage.py`", "`tests/core/test_*.py`", "`mindspeed_laga.patches.megatron_core.patch`",
        "`mindspeed_laga.new_micro_batch`", "`mindspeed_llm/training/checkpointing.py`", "`tests/poc/`"]
BAD = ["`mindspeed_laga/no_such_module.py`", "`kernels/made_up.py`", "`tests/core/test_made_up.py`",
       "`mindspeed_laga.no_such_module`", "`mindspeed_laga.api.no_such_function`",
       "`tools/costmodel/{config,made_up}.py`", "`tests/tools/test_docs.py::test_made_up`",
       "`sparse/made_up/`", "`scripts/made_up.sh`", "`mindspeed_laga.patches.made_up`",
       "`patches/mindspeed_llm/made_up.py`"]


@pytest.mark.parametrize("text", GOOD)
def test_checker_passes_a_real_path(text):
    assert missing(text) == []


@pytest.mark.parametrize("text", BAD)
def test_checker_fails_a_made_up_path(text):
    assert len(missing(text)) == 1, text


# ----------------------------------------------------------------- the docs

@pytest.mark.parametrize("doc", doc_files(), ids=lambda p: p.name)
def test_every_path_and_module_a_doc_cites_exists(doc):
    text = doc.read_text(encoding="utf-8")
    assert missing(text) == [], f"{doc.relative_to(ROOT)} cites what is not in the tree:\n" + "\n".join(missing(text))


def test_the_docs_cite_many_paths():
    """A checker that recognises nothing would pass every doc."""
    assert sum(len(cited(d.read_text(encoding="utf-8"))) for d in doc_files()) > 100


@pytest.mark.parametrize("doc", sorted((ROOT / "docs").glob("*.md")), ids=lambda p: p.name)
def test_each_doc_is_under_its_line_budget(doc):
    lines = len(doc.read_text(encoding="utf-8").splitlines())
    assert lines < MAX_LINES_PER_DOC, f"{doc.name} has {lines} lines (fewer than {MAX_LINES_PER_DOC} wanted)"


def test_the_docs_together_are_under_their_line_budget():
    total = sum(len(d.read_text(encoding="utf-8").splitlines()) for d in (ROOT / "docs").glob("*.md"))
    assert total < MAX_LINES_ALL_DOCS, f"docs/*.md have {total} lines (fewer than {MAX_LINES_ALL_DOCS} wanted)"


# ----------------------------------------------------------------- DESIGN.md's layout of the repository

def layout_section(root: Path = ROOT) -> str:
    text = (root / "docs" / "DESIGN.md").read_text(encoding="utf-8")
    start = text.index("\n## Layout of the repository")
    end = text.find("\n## ", start + 1)
    return text[start:] if end < 0 else text[start:end]


def unlisted(section: str, root: Path = ROOT):
    """The package's top modules and every package folder the layout section does not name."""
    out = []
    for module in sorted((root / "mindspeed_laga").glob("*.py")):
        if module.name != "__init__.py" and module.name not in section:
            out.append(f"mindspeed_laga/{module.name}")
    for top in _PACKAGES:
        for init in sorted((root / top).rglob("__init__.py")):
            folder = init.parent.relative_to(root / top).as_posix()
            if folder != "." and f"{folder}/" not in section:
                out.append(f"{top}/{folder}/")
    return out


def test_the_layout_of_the_repository_names_what_is_in_the_tree():
    assert unlisted(layout_section()) == [], "docs/DESIGN.md's layout section does not name these"


def test_the_layout_check_finds_a_module_left_out():
    section = layout_section().replace("`layout.py`", "").replace("`mindspeed_laga/sparse/`", "")
    section = section.replace("mindspeed_laga/layout.py", "")
    assert unlisted(section) == ["mindspeed_laga/layout.py", "mindspeed_laga/sparse/"]
