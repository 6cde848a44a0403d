"""Which MindSpeed-LLM release is installed, read from the host's own files.

Every tested release pair's real sources (tests/support/thirdparty.py) are identified
as that release; a mismatched pair and an untested MindSpeed-LLM are refused,
naming the tested releases, at feature validation (before training) and by
``mindspeed-laga doctor``'s environment report, which names the release found.
"""
import dataclasses
import importlib
import os
import sys
from pathlib import Path

import pytest
import torch

from mindspeed_laga.tools.commands.environment import mindspeed_llm_release, report
from mindspeed_laga.features import LAGAFeature
from mindspeed_laga.patches.common import UnsupportedHostError
from mindspeed_laga.patches.mindspeed_llm import releases
from mindspeed_laga.patches.mindspeed_llm.releases import (BY_NAME, MINDSPEED_FILES, MLA_MODULE,
                                                           RELEASES, UnknownHostRelease,
                                                           deinterleave_rope_dims, has_files,
                                                           identify, identify_mindspeed_llm,
                                                           installed_release)
from support.laga_parser import parse
from support.thirdparty import RELEASE_NAMES, release_sources

pytestmark = pytest.mark.ascend  # the leg that runs it (tests/conftest.py)

VALID = ["--multi-latent-attention", "--disable-bias-linear", "--attention-dropout", "0.0",
         "--num-attention-heads", "8", "--seq-length", "64", "--context-parallel-size", "2",
         "--mla-latent-all-gather"]
UNTESTED_MLA = '''
class CustomMLASelfAttention:
    def __init__(self, config):
        self.kv_layernorm = config.kv_layernorm

    def forward(self, hidden_states, attention_mask):
        return self.linear_proj(self.kv_layernorm(hidden_states))
'''


def packages(sources):
    return (str(Path(sources["MINDSPEED_LLM_SRC"]) / "mindspeed_llm"),
            str(Path(sources["MINDSPEED_SRC"]) / "mindspeed"))


@pytest.fixture
def on_path(monkeypatch):
    """Put source roots first on sys.path (found by find_spec, never imported here)."""
    def put(*roots):
        for root in roots:
            monkeypatch.syspath_prepend(str(root))
        importlib.invalidate_caches()
    # find_spec answers from sys.modules for an imported package: hide any MindSpeed that
    # an earlier test of this process imported (stand-ins included) while this one runs
    for name in [n for n in sys.modules if n.split(".")[0] in ("mindspeed", "mindspeed_llm")]:
        monkeypatch.delitem(sys.modules, name)
    return put


def untested_host(tmp_path, mindspeed_src):
    llm = tmp_path / "MindSpeed-LLM"
    (llm / "mindspeed_llm" / Path(MLA_MODULE).parent).mkdir(parents=True)
    (llm / "mindspeed_llm" / "__init__.py").write_text("raise ImportError('not imported')\n")
    (llm / "mindspeed_llm" / MLA_MODULE).write_text(UNTESTED_MLA)
    return llm, mindspeed_src


@pytest.mark.parametrize("release", RELEASE_NAMES)
def test_each_release_pair_is_identified(release):
    found = identify(*packages(release_sources(release)))
    assert found is BY_NAME[BY_NAME[release].facts_owner]  # a same_as release: its facts' owner


def test_the_releases_are_the_tested_pairs():
    assert [r.name for r in RELEASES] == list(RELEASE_NAMES)
    # a release is identified by its pair of facts: no two owners' pairs may be equal (two
    # releases may share an MLA module, test below); a same_as release has its owner's
    owners = [r for r in RELEASES if r.same_as is None]
    assert len({(r.llm_facts, r.mindspeed_facts) for r in owners}) == len(owners)
    for r in RELEASES:
        owner = BY_NAME[r.facts_owner]
        assert (r.llm_facts, r.mindspeed_facts) == (owner.llm_facts, owner.mindspeed_facts)


def test_two_releases_with_the_same_mla_module_are_told_apart_by_mindspeed(monkeypatch, tmp_path):
    """A later release that left master's MLA module alone, paired with another MindSpeed:
    both rows exist, and each pair is identified as its own release (the MLA module alone
    names both; MindSpeed decides)."""
    master = BY_NAME["master"]
    later = dataclasses.replace(master, name="later", mindspeed_branch="later",
                                mindspeed_facts=has_files("auto_settings"))
    monkeypatch.setattr(releases, "RELEASES", RELEASES + (later,))
    llm, mindspeed = packages(release_sources("master"))
    other = tmp_path / "mindspeed"
    (other / MINDSPEED_FILES["auto_settings"]).parent.mkdir(parents=True)
    (other / MINDSPEED_FILES["auto_settings"]).write_text("")
    assert identify(llm, mindspeed) is master
    assert identify(llm, str(other)) is later
    mla = os.path.join(llm, MLA_MODULE)
    assert identify_mindspeed_llm(mla, mindspeed) is master
    assert identify_mindspeed_llm(mla, str(other)) is later
    with pytest.raises(UnknownHostRelease, match="master or later found but MindSpeed"):
        identify(llm, None)


def test_a_release_the_same_as_another_leaves_its_detection_alone(monkeypatch):
    """A row declared ``same_as`` master (a later pair no fact tells apart) takes master's
    facts and differences; master's sources are still identified as master's facts, and
    the report names the facts and both releases, never one of them alone."""
    same = releases.Release("master-next", "0123abcd", "master-next", "4567ef01", None, None,
                            same_as="master")
    rows = releases._resolved(releases.ROWS + (same,))
    monkeypatch.setattr(releases, "RELEASES", rows)
    monkeypatch.setattr(releases, "BY_NAME", {r.name: r for r in rows})
    master, nxt = releases.BY_NAME["master"], releases.BY_NAME["master-next"]
    assert (nxt.llm_facts, nxt.mindspeed_facts, nxt.lora_scales) == \
        (master.llm_facts, master.mindspeed_facts, master.lora_scales)
    found = identify(*packages(release_sources("master")))
    assert found is master
    assert "matching master's MLA facts" in found.found() == nxt.found()
    assert master.label() in found.found() and nxt.label() in found.found()
    with pytest.raises(ValueError, match="same_as='nowhere' must name a release"):
        releases._resolved(releases.ROWS + (dataclasses.replace(same, same_as="nowhere"),))


def test_a_mismatched_pair_names_the_mindspeed_it_needs():
    llm = packages(release_sources("2.3.0"))[0]
    mindspeed = packages(release_sources("master"))[1]
    with pytest.raises(UnknownHostRelease, match=r"2\.3\.0 is tested with MindSpeed "
                                                 r"2\.3\.0_core_r0\.12\.1.* is branch master"):
        identify(llm, mindspeed)


def test_an_untested_mindspeed_llm_is_refused_with_the_tested_releases(tmp_path):
    llm, _ = untested_host(tmp_path, None)
    with pytest.raises(UnknownHostRelease) as info:
        identify(str(llm / "mindspeed_llm"), packages(release_sources("master"))[1])
    message = str(info.value)
    assert "-mla_scale_kv_lora" in message
    for release in RELEASES:
        assert release.label() in message


def test_feature_validation_refuses_an_untested_host(tmp_path, on_path):
    llm, _ = untested_host(tmp_path, None)
    on_path(Path(release_sources("master")["MINDSPEED_SRC"]), llm)
    feature = LAGAFeature()
    args = parse(VALID, feature)
    with pytest.raises(UnsupportedHostError) as info:
        feature.validate_args(args)
    message = str(info.value)
    assert "--mla-latent-all-gather supports these MindSpeed-LLM releases" in message
    assert all(f"MindSpeed-LLM {name} (" in message for name in RELEASE_NAMES), message
    assert "untested: " in mindspeed_llm_release()


@pytest.mark.parametrize("release", ["26.0.0", "2.2.0"])
def test_feature_validation_and_doctor_name_the_release(release, on_path, caplog, capsys):
    sources = release_sources(release)
    on_path(sources["MINDSPEED_SRC"], sources["MINDSPEED_LLM_SRC"])
    assert installed_release() is BY_NAME[release]
    feature = LAGAFeature()
    with caplog.at_level("INFO"):
        feature.validate_args(parse(VALID, feature))
    found = BY_NAME[release].found()
    assert f"{release}'s MLA facts" in found and BY_NAME[release].label() in found
    assert found in caplog.text and found in capsys.readouterr().out
    assert mindspeed_llm_release() == found == report()["MindSpeed-LLM release"]


def test_packed_documents_are_refused_where_the_release_cannot_take_them(on_path):
    sources = release_sources("2.3.0")
    on_path(sources["MINDSPEED_SRC"], sources["MINDSPEED_LLM_SRC"])
    feature = LAGAFeature()
    documents = VALID + ["--reset-attention-mask", "--micro-batch-size", "1"]
    feature.validate_args(parse(documents + ["--context-parallel-algo", "megatron_cp_algo"],
                                feature))
    with pytest.raises(ValueError, match=r"ulysses_cp_algo is not supported on MindSpeed-LLM "
                                         r"2\.3\.0.*Use --context-parallel-algo megatron_cp_algo"):
        feature.validate_args(parse(documents + ["--context-parallel-algo", "ulysses_cp_algo"],
                                    feature))


def test_without_mindspeed_llm_the_doctor_reports_none():
    assert "mindspeed_llm" not in sys.modules
    if importlib.util.find_spec("mindspeed_llm") is None:
        assert mindspeed_llm_release() is None


def test_the_2x_rope_de_interleave_moves_pairs_to_halves():
    x = torch.arange(2 * 3 * 8).reshape(2, 3, 8)
    out = deinterleave_rope_dims(x)
    assert out[0, 0].tolist() == [0, 2, 4, 6, 1, 3, 5, 7]
    assert torch.equal(out, x[..., [0, 2, 4, 6, 1, 3, 5, 7]])


def test_the_differences_per_release():
    # the 2.x pairs predate the latent scales (read from each owner's own facts)
    assert all(r.lora_scales == ("mla_scale_kv_lora" in r.llm_facts.defines) for r in RELEASES)
    assert BY_NAME["2.3.0"].deinterleaves("plm") and not BY_NAME["2.2.0"].deinterleaves("plm")
    assert not any(BY_NAME[n].deinterleaves("yarn") for n in ("master", "26.1.0", "26.0.0"))
    assert BY_NAME["26.0.0"].takes_documents("ulysses_cp_algo")
    assert not BY_NAME["2.3.0"].takes_documents("ulysses_cp_algo")
    assert BY_NAME["2.3.0"].takes_documents("megatron_cp_algo")
    assert not BY_NAME["2.2.0"].takes_documents("megatron_cp_algo")
