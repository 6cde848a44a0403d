"""The package's shape as drawn from its imports (every import statement, at any depth,
lazy ones inside functions included):

- no import circle among the modules of ``mindspeed_laga/``, ``features/`` and ``patches/``
  (the last two are installed under ``mindspeed_laga``);
- no kernel module imports another kernel module: the dense backends
  (``kernels/<backend>.py``, the ones a declaration names) and the sparse stage kernels;
- ``sparse/`` reaches into no dense form module (``forms/``);
- at most 12 public modules flat at the package top.

The scanner is checked on a circle and a kernel-to-kernel import it must see.
"""
import ast
from pathlib import Path
from typing import Dict, List, Set

import pytest

import mindspeed_laga
from mindspeed_laga.kernels.registry import KERNEL_TYPES
from mindspeed_laga.sparse.registry import KERNEL_TYPES as SPARSE_TYPES

PACKAGE = Path(mindspeed_laga.__file__).resolve().parent
ROOT = PACKAGE.parent
MAX_FLAT = 12
# the agreement's modules, which move into their own package: counted once they are gone
AGREEMENT_MODULES = {"agreement", "agreement_row", "handshake", "skipped", "key_padding_digest"}


def _modules(root: Path) -> Dict[str, Path]:
    """Dotted name -> file, ``features``/``patches`` under ``mindspeed_laga`` as installed."""
    found = {}
    for top in ("mindspeed_laga", "features", "patches"):
        for path in (root / top).rglob("*.py"):
            parts = list(path.relative_to(root).with_suffix("").parts)
            if parts[0] != "mindspeed_laga":
                parts.insert(0, "mindspeed_laga")
            if parts[-1] == "__init__":
                parts.pop()
            found[".".join(parts)] = path
    return found


def _owner(name: str, modules) -> str:
    """The module ``name`` is, or the one it is an attribute of."""
    while name and name not in modules:
        name = name.rpartition(".")[0]
    return name


def _graph(modules: Dict[str, Path]) -> Dict[str, Set[str]]:
    """module -> the package's modules it imports (a package's own submodules' parent
    package and the module itself left out)."""
    edges = {}
    for name, path in modules.items():
        package = name if path.name == "__init__.py" else name.rpartition(".")[0]
        targets = []
        for node in ast.walk(ast.parse(path.read_text())):
            if isinstance(node, ast.Import):
                targets += [alias.name for alias in node.names]
            elif isinstance(node, ast.ImportFrom):
                base = package.split(".")[:len(package.split(".")) - node.level + 1] \
                    if node.level else []
                module = ".".join(base + ([node.module] if node.module else []))
                targets += [f"{module}.{a.name}" if f"{module}.{a.name}" in modules else module
                            for a in node.names]
        owners = {_owner(t, modules) for t in targets}
        edges[name] = {o for o in owners if o and o != name and not name.startswith(o + ".")}
    return edges


def _circles(edges: Dict[str, Set[str]]) -> List[List[str]]:
    """The strongly connected components of more than one module (Tarjan, iterative)."""
    index, low, stack, on_stack, found = {}, {}, [], set(), []
    for start in edges:
        if start in index:
            continue
        work = [(start, iter(sorted(edges[start])))]
        index[start] = low[start] = len(index)
        stack.append(start)
        on_stack.add(start)
        while work:
            node, children = work[-1]
            child = next(children, None)
            if child is not None:
                if child not in index:
                    index[child] = low[child] = len(index)
                    stack.append(child)
                    on_stack.add(child)
                    work.append((child, iter(sorted(edges.get(child, ())))))
                elif child in on_stack:
                    low[node] = min(low[node], index[child])
                continue
            work.pop()
            if work:
                low[work[-1][0]] = min(low[work[-1][0]], low[node])
            if low[node] == index[node]:
                component = []
                while True:
                    member = stack.pop()
                    on_stack.discard(member)
                    component.append(member)
                    if member == node:
                        break
                if len(component) > 1:
                    found.append(sorted(component))
    return found


def _kernel_modules() -> Set[str]:
    """The dense backends (what ``kernels/<backend>.py`` files exist for a registered
    kernel) and the modules of the registered sparse stage kernels."""
    dense = {f"mindspeed_laga.kernels.{k.name}" for k in KERNEL_TYPES.values()}
    return ({m for m in dense if (PACKAGE / "kernels" / f"{m.rsplit('.', 1)[1]}.py").is_file()}
            | {k.__module__ for k in SPARSE_TYPES})


def _flat(modules) -> List[str]:
    names = {n.rsplit(".", 1)[1]: p for n, p in modules.items() if n.count(".") == 1}
    return sorted(n for n, p in names.items() if p.parent == PACKAGE and not n.startswith("_"))


MODULES = _modules(ROOT)
EDGES = _graph(MODULES)


def test_the_scanner_sees_circles_and_kernel_imports(tmp_path):
    """A copy with one circle and one kernel-to-kernel import: both are seen."""
    for top in ("mindspeed_laga/kernels", "features", "patches"):
        (tmp_path / top).mkdir(parents=True)
    (tmp_path / "mindspeed_laga/__init__.py").write_text("")
    (tmp_path / "mindspeed_laga/kernels/__init__.py").write_text("")
    (tmp_path / "mindspeed_laga/a.py").write_text("def f():\n    from . import b\n")
    (tmp_path / "mindspeed_laga/b.py").write_text("from .a import f\n")
    (tmp_path / "mindspeed_laga/kernels/sdpa.py").write_text("from .eager import x\n")
    (tmp_path / "mindspeed_laga/kernels/eager.py").write_text("x = 1\n")
    edges = _graph(_modules(tmp_path))
    assert _circles(edges) == [["mindspeed_laga.a", "mindspeed_laga.b"]]
    assert "mindspeed_laga.kernels.eager" in edges["mindspeed_laga.kernels.sdpa"]


def _moving(circle) -> bool:
    """A circle among the agreement's flat modules (their package breaks it)."""
    return all(m.rsplit(".", 1)[1] in AGREEMENT_MODULES and m.count(".") == 1 for m in circle)


def test_no_import_circle():
    assert len(EDGES) > 100
    assert [c for c in _circles(EDGES) if not _moving(c)] == []


@pytest.mark.skipif(bool(AGREEMENT_MODULES & set(_flat(MODULES))),
                    reason="the agreement's modules still sit flat at the package top")
def test_no_import_circle_at_all():
    assert _circles(EDGES) == []


def test_no_kernel_module_imports_another():
    kernels = _kernel_modules()
    assert {"mindspeed_laga.kernels.eager", "mindspeed_laga.sparse.npu_stages"} <= kernels
    bad = {k: sorted(EDGES[k] & (kernels - {k})) for k in kernels}
    assert not any(bad.values()), bad


def test_sparse_reaches_no_dense_form_module():
    bad = {m: sorted(t for t in targets if t.startswith("mindspeed_laga.forms"))
           for m, targets in EDGES.items() if m.startswith("mindspeed_laga.sparse")}
    assert not any(bad.values()), bad


@pytest.mark.skipif(bool(AGREEMENT_MODULES & set(_flat(MODULES))),
                    reason="the agreement's modules still sit flat at the package top; "
                           "the count applies once they are in their package")
def test_at_most_twelve_flat_modules():
    assert len(_flat(MODULES)) <= MAX_FLAT, _flat(MODULES)


def test_the_rest_of_the_top_fits_beside_the_agreement_package():
    """Meanwhile: the top without the agreement's modules fits the bound."""
    rest = [m for m in _flat(MODULES) if m not in AGREEMENT_MODULES]
    assert len(rest) <= MAX_FLAT - 1, rest  # the agreement package's own place among them
