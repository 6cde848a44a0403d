"""Every citation of a doc section in the repository names a heading that exists.

Code comments, docstrings, scripts and the docs themselves point into the docs
by name, and a renamed heading or a moved section silently breaks those
pointers. The forms recognised (``X`` an upper-case doc name such as
``DESIGN``; ``docs/`` optional; the quotes ' or "):

- ``docs/X.md, section 'Y'`` and ``docs/X.md, sections 'Y' and 'Z'``;
- ``docs/X.md "Y"`` and ``docs/X.md, "Y"``;
- ``docs/X.md#anchor``, a markdown link ``(X.md#anchor)`` and, inside a doc,
  ``(#anchor)``: GitHub's slug of a heading;
- ``X.md, section 3`` / ``X.md section 2c``: a heading numbered so (``## 3. ...``).

Each cited file must exist and each named section must be a heading in it
(headings inside fenced code blocks do not count). The scanner is tested on
its own first, broken citations included, so a scanner that finds nothing
cannot pass for a clean repository.
"""
import os
import re
from pathlib import Path

import pytest

ROOT = Path(__file__).resolve().parents[2]
SCANNED = (".py", ".md", ".sh")
# Folders that are not the repository's own text: virtual environments, caches,
# build output, host sources a checkout may hold beside the code.
SKIP_DIRS = {".git", ".venv", "venv", "build", "dist", "__pycache__", "shared", "node_modules"}

_DOC = r"(?<![\w/.-])(?P<docs>docs/)?(?P<name>[A-Z][A-Z_]*)\.md"
_GAP = r"[\s#]*"  # a citation may wrap onto the next line, inside a comment too
# A quoted section name: one line, or wrapped once onto the next.
_NAME = r"{q}(?P<{g}>[^{q}\n]{{1,100}}(?:\n[^{q}\n]{{1,100}})?){q}"
_QUOTED = "(?:" + _NAME.format(q="'", g="sq") + "|" + _NAME.format(q='"', g="dq") + ")"
_UNNAMED = _QUOTED.replace("?P<sq>", "").replace("?P<dq>", "")
_SECTION_NAMES = re.compile(_DOC + r",?" + _GAP + r"sections?" + _GAP + r"(?P<list>" + _UNNAMED
                            + r"(?:" + _GAP + r"(?:,|and)" + _GAP + _UNNAMED + r")*)")
# "X.md "Y"" or "X.md, "Y"": a space or a comma first, so a closing quote right after
# the file name is not taken for an opening one.
_BARE_NAME = re.compile(_DOC + r"(?:,[\s#]*|[ \t]+)" + _QUOTED)
_NUMBERED = re.compile(_DOC + r",?" + _GAP + r"section" + _GAP + r"(?P<num>\d+[a-z]?)\b(?!\.\d)")
# "section 3" with no file named: the citing doc's own numbered sections.
_OWN_NUMBERED = re.compile(r"(?<![\w.])[Ss]ection (?P<num>\d+[a-z]?)\b(?!\.\d)")
_ANCHOR = re.compile(_DOC + r"#(?P<anchor>[\w-]+)")
_LOCAL_ANCHOR = re.compile(r"\]\(#(?P<anchor>[\w-]+)\)")
_LIST_ITEM = re.compile(_QUOTED)


def _clean(name: str) -> str:
    """A section name as cited, with a line break (and a comment's ``#``) collapsed."""
    return re.sub(r"\s*\n[\s#]*", " ", name).strip()


def slug(heading: str) -> str:
    """GitHub's anchor of a heading: lower case, punctuation dropped, spaces to hyphens."""
    text = heading.strip().lower().replace("`", "")
    text = re.sub(r"[^\w\- ]", "", text)
    return text.replace(" ", "-")


def headings(text: str):
    """The headings of a markdown text, fenced code blocks skipped."""
    out, fenced = [], False
    for line in text.splitlines():
        if line.lstrip().startswith("```"):
            fenced = not fenced
            continue
        m = re.match(r"#{1,6}\s+(.*?)\s*#*\s*$", line)
        if m and not fenced:
            out.append(m.group(1))
    return out


def anchors(heads):
    """Every anchor GitHub gives these headings (repeated ones get -1, -2, ...)."""
    seen, out = {}, set()
    for h in heads:
        s = slug(h)
        n = seen.get(s, 0)
        out.add(s if n == 0 else f"{s}-{n}")
        seen[s] = n + 1
    return out


def _line(text: str, pos: int) -> int:
    return text.count("\n", 0, pos) + 1


def citations(text: str):
    """(line, doc name, with docs/ prefix, kind, target) of every citation in ``text``;
    kind is "file", "section", "number" or "anchor" (doc name None: this file's own)."""
    out = []
    for m in re.finditer(_DOC, text):
        out.append((_line(text, m.start()), m.group("name"), bool(m.group("docs")), "file", None))
    for m in _SECTION_NAMES.finditer(text):
        for q in _LIST_ITEM.finditer(m.group("list")):
            name = q.group("sq") if q.group("sq") is not None else q.group("dq")
            out.append((_line(text, m.start()), m.group("name"), bool(m.group("docs")), "section",
                        _clean(name)))
    for m in _BARE_NAME.finditer(text):
        name = m.group("sq") if m.group("sq") is not None else m.group("dq")
        out.append((_line(text, m.start()), m.group("name"), bool(m.group("docs")), "section",
                    _clean(name)))
    for m in _NUMBERED.finditer(text):
        out.append((_line(text, m.start()), m.group("name"), bool(m.group("docs")), "number",
                    m.group("num")))
    for m in _ANCHOR.finditer(text):
        out.append((_line(text, m.start()), m.group("name"), bool(m.group("docs")), "anchor",
                    m.group("anchor")))
    for m in _LOCAL_ANCHOR.finditer(text):
        out.append((_line(text, m.start()), None, False, "anchor", m.group("anchor")))
    if any(re.match(r"\d+[a-z]?\.\s", h) for h in headings(text)):
        for m in _OWN_NUMBERED.finditer(text):
            if not re.search(_DOC + r",?" + _GAP + r"$", text[max(0, m.start() - 40):m.start()]):
                out.append((_line(text, m.start()), None, False, "number", m.group("num")))
    return out


def _doc_path(source: Path, name: str, docs_prefix: bool, root: Path) -> Path:
    """Where a cited doc lives: ``docs/X.md``; a bare ``X.md`` inside docs/ is its sibling,
    elsewhere ``docs/X.md`` or, for the README, the root's."""
    if docs_prefix:
        return root / "docs" / f"{name}.md"
    for candidate in (source.parent / f"{name}.md", root / "docs" / f"{name}.md", root / f"{name}.md"):
        if candidate.is_file():
            return candidate
    return root / "docs" / f"{name}.md"


def broken(source: Path, text: str, root: Path = ROOT):
    """The citations in ``text`` (read from ``source``) that do not resolve, as messages."""
    problems = []
    where = source.relative_to(root) if source.is_relative_to(root) else source
    for line, name, docs_prefix, kind, target in citations(text):
        if name is None:  # the citing text's own headings
            doc, heads = source, headings(text)
        else:
            doc = _doc_path(source, name, docs_prefix, root)
            if not doc.is_file():
                problems.append(f"{where}:{line}: {name}.md does not exist")
                continue
            heads = headings(doc.read_text(encoding="utf-8")) if kind != "file" else []
        if kind == "section" and target not in heads and target not in [h.replace("`", "") for h in heads]:
            problems.append(f"{where}:{line}: {doc.name} has no heading {target!r}")
        elif kind == "number" and not any(re.match(re.escape(target) + r"\.?\s", h) for h in heads):
            problems.append(f"{where}:{line}: {doc.name} has no section numbered {target}")
        elif kind == "anchor" and target not in anchors(heads):
            problems.append(f"{where}:{line}: {doc.name} has no heading with anchor #{target}")
    return list(dict.fromkeys(problems))  # a missing file is named once per line


def repository_files(root: Path = ROOT):
    for folder, dirs, files in os.walk(root):
        dirs[:] = [d for d in dirs if d not in SKIP_DIRS and not d.endswith(".egg-info")
                   and not (d.startswith(".") and d != ".ci")]
        for f in files:
            path = Path(folder) / f
            if path.suffix in SCANNED and path != Path(__file__).resolve():
                yield path


# ----------------------------------------------------------------- the scanner itself

@pytest.fixture
def docs_root(tmp_path):
    (tmp_path / "docs").mkdir()
    (tmp_path / "docs" / "DESIGN.md").write_text(
        "# Design\n\n## Layouts\n\n## Causal masks and key prefixes\n\n"
        "## megatron-core `MLASelfAttention`\n\n```bash\n# not a heading\n```\n")
    (tmp_path / "docs" / "RESULTS.md").write_text("# Results\n\n## 2. Memory\n\n## 3. The memory mode\n")
    return tmp_path


GOOD = [
    "see docs/DESIGN.md, section 'Layouts'",
    'docs/DESIGN.md, sections "Layouts" and "Causal masks and key prefixes"',
    'docs/DESIGN.md "Layouts"',
    "[docs/DESIGN.md, \"Layouts\"](docs/DESIGN.md#layouts)",
    "(see docs/DESIGN.md, section\n    \"Causal masks and key prefixes\")",
    "# shims (docs/DESIGN.md, section 'Causal masks\n# and key prefixes')",
    "docs/DESIGN.md#megatron-core-mlaselfattention",
    "docs/DESIGN.md, section \"megatron-core `MLASelfAttention`\"",
    "RESULTS.md, section 3",
    "# Results\n\n## 2. Memory\n\nas in section 2 (Section 2 too)",
    "(RESULTS.md section 2)",
    "the torch_npu docs ``docs/context/torch_npu-npu_fusion_attention.md``",
]

BAD = [
    ("docs/DESIGN.md, section 'Causal masks'", "no heading 'Causal masks'"),
    ('docs/DESIGN.md, sections "Layouts" and "Host facts"', "no heading 'Host facts'"),
    ('docs/DESIGN.md "The cross-rank handshake"', "no heading 'The cross-rank handshake'"),
    ("docs/DESIGN.md#host-facts", "no heading with anchor #host-facts"),
    ("docs/DESIGN.md, section 'not a heading'", "no heading 'not a heading'"),
    ("docs/HOSTS.md, section 'megatron-core on CPU'", "HOSTS.md does not exist"),
    ("RESULTS.md section 2c", "no section numbered 2c"),
    ("[Memory](#memory)", "no heading with anchor #memory"),
    ("# Results\n\n## 2. Memory\n\nas in section 4", "no section numbered 4"),
]


@pytest.mark.parametrize("text", GOOD)
def test_scanner_accepts_a_citation_that_resolves(docs_root, text):
    assert broken(docs_root / "src.py", text, docs_root) == []


@pytest.mark.parametrize("text,problem", BAD)
def test_scanner_reports_a_broken_citation(docs_root, text, problem):
    found = broken(docs_root / "docs" / "RESULTS.md", text, docs_root)
    assert len(found) == 1 and problem in found[0], found


def test_slug_follows_github():
    assert slug("megatron-core `MLASelfAttention`") == "megatron-core-mlaselfattention"
    assert slug("MindSpeed's CP algorithms") == "mindspeeds-cp-algorithms"
    assert slug("`--context-parallel-algo` mapping") == "--context-parallel-algo-mapping"
    assert slug("2. Memory (activations saved)") == "2-memory-activations-saved"
    assert anchors(["Tests", "Tests"]) == {"tests", "tests-1"}


# ----------------------------------------------------------------- the repository

def test_every_doc_citation_in_the_repository_resolves():
    problems, found = [], 0
    for path in repository_files():
        text = path.read_text(encoding="utf-8", errors="replace")
        found += sum(kind != "file" for *_, kind, _ in citations(text))
        problems += broken(path, text)
    assert found > 50, f"the scanner found only {found} section citations: is it looking?"
    assert not problems, "broken doc citations:\n" + "\n".join(problems)
