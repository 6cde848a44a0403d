"""The host's flags select the sparse stage kernels through what each kernel declares
(``host_flags``): the MindSpeed-LLM adapter names no kernel.

- every declared flag selects its kernel at its stage, the others at the default;
- a kernel registered last with its own flag is selected by it (the adapter unedited);
- the host's loss flag acts on its absorbed path only.
"""
from argparse import Namespace
from types import SimpleNamespace

import pytest

from mindspeed_laga.sparse import registry
from mindspeed_laga.sparse.stage import STAGES, LossReads
from mindspeed_laga.sparse.torch_stages import SparseTorch

dsa = pytest.importorskip("mindspeed_laga.patches.mindspeed_llm.dsa")


class _Torch2(SparseTorch):
    name = "torch2"
    host_flags = {"attention": "use_torch2_attention"}


@pytest.fixture
def one_tp_rank(monkeypatch):
    from megatron.core import parallel_state
    monkeypatch.setattr(parallel_state, "get_tensor_model_parallel_world_size", lambda: 1)


def _kernels(absorbed=True, **flags):
    return dsa.dsa_kernels(SimpleNamespace(enable_mla_absorb=absorbed), Namespace(**flags))


def test_each_declared_flag_selects_its_kernel(one_tp_rank):
    assert registry.HOST_DEFAULT == registry.SPARSE_KERNELS[0]
    none = _kernels()
    assert {none[f"{s}_kernel"] for s in STAGES} == {registry.HOST_DEFAULT}
    declared = [(c.name, stage, flag) for c in registry.KERNEL_TYPES
                for stage, flag in c.host_flags.items()]
    assert len(declared) >= 3
    for name, stage, flag in declared:
        got = _kernels(**{flag: True})
        assert got[f"{stage}_kernel"] == name, (flag, got)
        assert all(got[f"{s}_kernel"] == registry.HOST_DEFAULT for s in STAGES if s != stage)


def test_a_new_kernel_is_selected_by_its_own_flag(one_tp_rank, monkeypatch):
    monkeypatch.setattr(registry, "KERNEL_TYPES", (*registry.KERNEL_TYPES, _Torch2))
    assert _kernels(use_torch2_attention=True)["attention_kernel"] == "torch2"
    assert _kernels()["attention_kernel"] == registry.HOST_DEFAULT
    assert registry.host_flag_names()["use_torch2_attention"] == "torch2"


def test_the_loss_flag_acts_on_the_absorbed_path_only(one_tp_rank):
    flag = next(c.host_flags["loss"] for c in registry.KERNEL_TYPES if "loss" in c.host_flags)
    assert _kernels(absorbed=True, **{flag: True})["loss_kernel"] != registry.HOST_DEFAULT
    assert _kernels(absorbed=False, **{flag: True})["loss_kernel"] == registry.HOST_DEFAULT


def test_what_a_loss_reads_is_an_enum():
    assert {c.loss_reads for c in registry.KERNEL_TYPES} <= set(LossReads)
