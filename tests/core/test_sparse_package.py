"""The sparse MLA package's structure: imports one way, capabilities declared, one check.

- no stage kernel (nor anything under ``mindspeed_laga/kernels/``) imports a form;
- a kernel is chosen by what it declares: a subclass of the torch kernel registered under
  its own name takes ``loss_target="all_keys"`` and gives the torch kernel's numbers;
- the registry refuses a kernel that declares no name of its own;
- ``sparse.checks.check`` returns the typed setup, ``agreed_values`` one int per agreed
  value, and every agreed value moves when its argument does.
"""
import ast
from pathlib import Path

import pytest
import torch

import mindspeed_laga
from mindspeed_laga import agreement
from mindspeed_laga.sparse import checks, registry
from mindspeed_laga.sparse.torch_stages import SparseTorch
from support import sparse_mla as sm

PACKAGE = Path(mindspeed_laga.__file__).parent
FORM_MODULES = {"mindspeed_laga.forms", "mindspeed_laga.sparse.form", "mindspeed_laga.api"}


def _imports(path: Path):
    """The absolute names a module imports (relative imports resolved)."""
    parts = path.relative_to(PACKAGE.parent).with_suffix("").parts
    package = parts[:-1]
    names = []
    for node in ast.walk(ast.parse(path.read_text())):
        if isinstance(node, ast.Import):
            names += [alias.name for alias in node.names]
        elif isinstance(node, ast.ImportFrom):
            base = list(package[:len(package) - node.level + 1]) if node.level else []
            module = ".".join(base + ([node.module] if node.module else []))
            names += [module] + [f"{module}.{alias.name}" for alias in node.names]
    return names


def _imports_a_form(name: str) -> bool:
    return any(name == form or name.startswith(form + ".") for form in FORM_MODULES)


def test_the_import_scanner_sees_a_form_import():
    """The scanner itself: the adapter (dsa.py) is seen importing the form, and the form's
    relative import of its checks is resolved."""
    dsa = PACKAGE.parent / "patches" / "mindspeed_llm" / "dsa.py"
    assert any(_imports_a_form(n) for n in _imports(dsa)), _imports(dsa)
    assert "mindspeed_laga.sparse.checks" in _imports(PACKAGE / "sparse" / "form.py")


def test_no_kernel_imports_a_form():
    modules = [p for p in (PACKAGE / "sparse").glob("*.py") if p.name != "form.py"]
    modules += list((PACKAGE / "kernels").glob("*.py"))
    assert len(modules) > 5
    for path in modules:
        bad = [n for n in _imports(path) if _imports_a_form(n)]
        assert not bad, f"{path.relative_to(PACKAGE)} imports {bad}"


def _args():
    x = sm.full_inputs(0)
    tensors = [x[k] for k in sm.LOCAL[:3]] + [x["kv_up_weight"]] + [x[k] for k in sm.LOCAL[3:]]
    kw = dict(index_topk=sm.TOPK, softmax_scale=sm.SCALE, qk_head_dim=sm.D_N,
              v_head_dim=sm.D_V, indexer_loss_coeff=sm.COEFF, layout="contiguous")
    return tensors, kw


class _Torch2(SparseTorch):
    name = "torch2"


def test_a_registered_subclass_takes_all_keys_by_its_capability(monkeypatch):
    monkeypatch.setattr(registry, "_TYPES", {**registry._TYPES, "torch2": _Torch2})
    tensors, kw = _args()
    kw.update(loss_target="all_keys")
    want = mindspeed_laga.sparse_laga_attention(*tensors, **kw)
    got = mindspeed_laga.sparse_laga_attention(*tensors, **kw, indexer_kernel="torch2",
                                               attention_kernel="torch2", loss_kernel="torch2")
    assert torch.equal(got.output, want.output) and torch.equal(got.indexer_loss,
                                                                want.indexer_loss)
    monkeypatch.setattr(_Torch2, "supports_all_keys", False)
    with pytest.raises(ValueError, match="loss_kernel='torch2' does not"):
        mindspeed_laga.sparse_laga_attention(*tensors, **kw, loss_kernel="torch2")


def test_a_kernel_must_declare_its_own_name():
    class Unnamed(SparseTorch):
        pass

    with pytest.raises(TypeError, match="Unnamed must declare its own name"):
        registry._by_name([SparseTorch, Unnamed])
    with pytest.raises(TypeError, match="'torch2' is declared by both"):
        registry._by_name([_Torch2, type("Again", (_Torch2,), {"name": "torch2"})])


def _setup(**changes):
    tensors, kw = _args()
    kw.update(changes)
    return checks.check(*tensors, checks.SparseOptions(**kw)), tensors


def test_check_returns_the_typed_setup_and_the_agreed_ints():
    setup, tensors = _setup()
    assert setup.dims.index_heads == sm.INDEX_HEADS and setup.dims.index_key == sm.INDEX_DIM
    assert setup.kernels == ("torch", "torch", "torch") and setup.with_loss
    values = checks.agreed_values(setup, tensors)
    assert all(type(v) is int for v in values.values()), values
    assert values["indexer_loss_coeff"] == agreement.float_bits(sm.COEFF)
    assert values["dtype"] == agreement.dtype_code(torch.float64)
    with torch.no_grad():
        assert checks.agreed_values(setup, tensors)["requires_grad"] == 0
    needs = [t.clone().requires_grad_(i in (1, 5)) for i, t in enumerate(tensors)]
    assert checks.agreed_values(setup, needs)["requires_grad"] == 0b100010


@pytest.mark.parametrize("field,change", [
    ("index_topk", dict(index_topk=sm.TOPK + 1)),
    ("indexer_loss_coeff", dict(indexer_loss_coeff=sm.COEFF * (1 + 2 ** -52))),
    ("indexer_loss_coeff", dict(indexer_loss_coeff=None)),
    ("loss_target", dict(loss_target="all_keys")),
    ("layout", dict(layout="zigzag")),
    ("indexer_kernel", dict(indexer_kernel=registry.SPARSE_KERNELS[-1])),
    ("attention_kernel", dict(attention_kernel=registry.SPARSE_KERNELS[-1])),
    ("loss_kernel", dict(loss_kernel=registry.SPARSE_KERNELS[-1], indexer_loss_coeff=None)),
])
def test_each_agreed_value_moves_with_its_argument(field, change, monkeypatch):
    monkeypatch.setattr(registry.SparseNpu, "check", lambda *a: None)  # no torch_npu here
    base, tensors = _setup()
    moved, _ = _setup(**change)
    assert checks.agreed_values(moved, tensors)[field] != checks.agreed_values(base,
                                                                               tensors)[field]
