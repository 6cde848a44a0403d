"""Which document boundaries the MindSpeed-LLM wrapper hands LAGA under --reset-attention-mask.

MindSpeed keeps the cumulative document ends in ``get_actual_seq_len()``. With
``--mtp-num-layers`` MindSpeed-LLM's ``generate_mtp_batch_list_on_this_tp_rank``
replaces them by one row per MTP depth (row d: each end not at the sequence end moved
d earlier), and each core attention reads its own row by ``mtp_idx``; a sample that
ends on an EOD repeats the last end. The expected values below are written out by
hand from those rules (the loop tests, tests/loop, train through the real host).
"""
import sys
import types
from types import SimpleNamespace

import pytest
import torch

from mindspeed_laga.patches.mindspeed_llm.forward import _mtp_depth, document_boundaries

pytestmark = pytest.mark.ascend  # the leg that runs it (tests/conftest.py)


@pytest.fixture
def host_ends(monkeypatch):
    """MindSpeed's get_batch_utils, as far as document_boundaries reads it."""
    state = SimpleNamespace(ends=None, ring_degree=1)
    names = ["mindspeed", "mindspeed.core", "mindspeed.core.context_parallel",
             "mindspeed.core.context_parallel.get_batch_utils"]
    for name in names:
        module = types.ModuleType(name)
        module.__path__ = []
        monkeypatch.setitem(sys.modules, name, module)
    utils = sys.modules[names[-1]]
    utils.get_actual_seq_len = lambda: state.ends
    utils.get_ring_degree = lambda: state.ring_degree
    return state


def test_one_row_of_ends(host_ends):
    host_ends.ends = torch.tensor([5, 12, 16])
    assert document_boundaries() == [0, 5, 12, 16]


def test_each_mtp_depth_reads_its_own_row(host_ends):
    # the rows generate_mtp_batch_list_on_this_tp_rank builds for ends [5, 12, 16], S = 16
    host_ends.ends = torch.tensor([[5, 12, 16], [4, 11, 16]])
    assert document_boundaries(0) == [0, 5, 12, 16]
    assert document_boundaries(1) == [0, 4, 11, 16]


def test_a_sample_ending_on_eod_adds_no_empty_document(host_ends):
    host_ends.ends = torch.tensor([7, 16, 16])
    assert document_boundaries() == [0, 7, 16]


def test_ring_degree_scales_the_ends_back(host_ends):
    # megatron_cp_algo: the loader divided the padded ends by the ring degree (CP)
    host_ends.ends = torch.tensor([8, 16]) / 2
    host_ends.ring_degree = 2
    assert document_boundaries() == [0, 8, 16]


def test_no_ends_names_the_flag(host_ends):
    with pytest.raises(ValueError, match="--reset-attention-mask"):
        document_boundaries()


def test_mtp_depth_is_read_where_mindspeed_llm_sets_it():
    assert _mtp_depth(SimpleNamespace(core_attention=SimpleNamespace())) == 0  # no MTP
    assert _mtp_depth(SimpleNamespace(core_attention=SimpleNamespace(mtp_idx=1))) == 1
    assert _mtp_depth(SimpleNamespace(mtp_idx=2, core_attention=SimpleNamespace(mtp_idx=0))) == 2


def test_general_masks_take_the_loaders_ends_as_they_are(host_ends):
    # --attention-mask-type general: the loader neither pads nor divides the ends (here the
    # fixed sub-sequences of --fix-sub-seq-length 6, S = 16), whatever the ring degree
    host_ends.ends = torch.tensor([6, 12, 16])
    host_ends.ring_degree = 2
    assert document_boundaries(loader_scaled=False) == [0, 6, 12, 16]
    assert document_boundaries(loader_scaled=True) == [0, 12, 24, 32]
