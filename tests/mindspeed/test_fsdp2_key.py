"""The FSDP2 backend's turn-on key and its checks, without training (the loop runs them in
tests/loop/test_fsdp2_loop.py): how the launcher reads ``parallel.mla_latent_all_gather``
(the host's precedence: the last command-line override, else the YAML), what it refuses,
how ``parallel.cp_type`` maps to LAGA's algorithms, and LAGA's group in the host's real
CP table (MindSpeed-LLM 26.1.0's ``context_parallel_mappings.py``, loaded from its file)."""
from __future__ import annotations

import copy
import importlib.util
import os
import subprocess
import sys
from pathlib import Path

import pytest

from mindspeed_laga.features import fsdp2_launch
from mindspeed_laga.patches.fsdp2 import host, register
from support.thirdparty import fsdp2_sources, release_sources

MAPPINGS = Path("mindspeed_llm/fsdp2/distributed/context_parallel/context_parallel_mappings.py")


@pytest.fixture
def config_yaml(tmp_path):
    def write(parallel):
        path = tmp_path / "c.yaml"
        import yaml
        path.write_text(yaml.safe_dump({"model": {"model_name_or_path": "m"},
                                        "parallel": parallel}))
        return str(path)
    return write


@pytest.mark.parametrize("parallel, cli, on", [
    ({}, [], False),
    ({"mla_latent_all_gather": True}, [], True),
    ({"mla_latent_all_gather": True}, ["--parallel.mla_latent_all_gather", "false"], False),
    ({"mla_latent_all_gather": False}, ["--parallel.mla_latent_all_gather"], True),
    ({}, ["--parallel.mla_latent_all_gather=true", "--parallel.cp_size", "2"], True),
    ({}, ["--parallel.mla_latent_all_gather", "--parallel.cp_size", "2"], True),
])
def test_key_precedence(config_yaml, parallel, cli, on):
    assert fsdp2_launch.laga_requested([config_yaml(parallel), *cli]) is on


def test_key_takes_a_bool(config_yaml):
    with pytest.raises(SystemExit, match="parallel.mla_latent_all_gather takes true or false"):
        fsdp2_launch.laga_requested([config_yaml({"mla_latent_all_gather": "maybe"})])


def test_settings_read_as_the_host_reads_them(config_yaml):
    args = [config_yaml({"cp_size": 4, "cp_type": "ring"}), "--parallel.cp_size", "2"]
    assert fsdp2_launch.setting(args, "parallel.cp_size") == "2"
    assert fsdp2_launch.setting(args, "parallel.cp_type") == "ring"
    assert fsdp2_launch.setting(args, "data.cutoff_len", 7) == 7


def test_cp_type_mapping():
    assert host.cp_algo("ulysses") == ("ulysses", "contiguous")
    assert host.cp_algo("ring") == ("allgather", "zigzag")
    with pytest.raises(ValueError, match="parallel.mla_latent_all_gather: parallel.cp_type "
                                         "'zigzag' .* set parallel.cp_type to ulysses or ring"):
        host.cp_algo("zigzag")


@pytest.mark.parametrize("config, message", [
    ({"model_type": "qwen3"}, "model_type 'qwen3' has no MLA"),
    ({"model_type": "kimi_k2", "kv_lora_rank": 512}, "'kimi_k2' is an MLA model LAGA does not"),
    ({"model_type": "deepseek_v3", "kv_lora_rank": 512, "attention_dropout": 0.1},
     "attention_dropout=0.1"),
])
def test_models_refused_by_name(config, message):
    with pytest.raises(ValueError, match=message) as refused:
        host.check_model(config)
    assert str(refused.value).startswith("parallel.mla_latent_all_gather: ")
    assert "drop the key" in str(refused.value) or "set attention_dropout" in str(refused.value)


def test_forms_by_model():
    assert host.check_model({"model_type": "deepseek_v3", "kv_lora_rank": 512}) == "dense"
    assert host.check_model({"model_type": "glm_moe_dsa", "kv_lora_rank": 512}) == "sparse"


def test_glm_needs_the_backends_own_model():
    host.check_model_id("glm_moe_dsa", "glm52")
    host.check_model_id("deepseek_v3", None)
    with pytest.raises(ValueError, match="parallel.mla_latent_all_gather: model_type "
                                         "'glm_moe_dsa' is covered as MindSpeed-LLM's own "
                                         "glm52 model.*; set model.model_id: glm52"):
        host.check_model_id("glm_moe_dsa", None)


@pytest.mark.parametrize("cp_type, length, ok", [
    ("ring", 32, True), ("ring", 30, False), ("ulysses", 30, True), ("ulysses", 31, False)])
def test_sequence_splits_evenly(config_yaml, cp_type, length, ok):
    args = [config_yaml({"cp_size": 2}), "--data.cutoff_len", str(length)]
    if ok:
        fsdp2_launch.check_sequence(args, cp_type)
    else:
        with pytest.raises(ValueError, match=f"data.cutoff_len {length} does not split"):
            fsdp2_launch.check_sequence(args, cp_type)


def _host_table(llm_root):
    spec = importlib.util.spec_from_file_location("host_cp_mappings", Path(llm_root) / MAPPINGS)
    module = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(module)
    return module


@pytest.mark.ascend
def test_laga_group_in_the_host_table():
    """deepseek_v3 and glm_moe_dsa leave the host's groups for LAGA's, which keeps the
    host's CP loss and replaces their attention's forward (GLM-5.2: the backend's own
    glm52 class); the other models stay where they were."""
    table = _host_table(fsdp2_sources()["MINDSPEED_LLM_SRC"])
    before = copy.deepcopy(table.MODEL_CP_CONFIG)
    models = ["deepseek_v3", "glm_moe_dsa"]
    register.add_laga_group(table, models)
    register.add_laga_group(table, models)  # idempotent
    groups = table.MODEL_CP_CONFIG
    assert groups["cp_attention_common"]["models"] == \
        before["cp_attention_common"]["models"] - {"deepseek_v3"}
    assert groups["dsa"]["models"] == before["dsa"]["models"] - {"glm_moe_dsa"}
    assert "glm_moe_dsa" not in groups["dsa"]["model_specific"]  # the host's dsa_forward
    assert groups["laga"] == {
        "models": set(models), "cp_to_att_template": {"fixed_cross_entropy"},
        "model_specific": {m: [register.FORWARDS[m]] for m in models}}
    untouched = ("laga", "cp_attention_common", "dsa")
    assert {k: v for k, v in groups.items() if k not in untouched} == \
        {k: v for k, v in before.items() if k not in untouched}
    assert register.forward_of("deepseek_v3").__name__ == "laga_forward"
    assert register.forward_of("glm_moe_dsa").__name__ == "laga_glm_dsa_forward"


def _release_of(sources) -> str:
    """host.check_release() in a fresh process on these sources: its result or refusal."""
    env = dict(os.environ, PYTHONPATH=os.pathsep.join(
        [sources["MINDSPEED_LLM_SRC"], sources["MINDSPEED_SRC"]]))
    code = ("from mindspeed_laga.patches.fsdp2 import host\n"
            "try:\n    print(host.check_release())\n"
            "except Exception as exc:\n    print(type(exc).__name__, exc)\n")
    return subprocess.run([sys.executable, "-c", code], env=env, capture_output=True,
                          text=True, timeout=120, check=True).stdout.strip()


@pytest.mark.ascend
@pytest.mark.hosts
def test_release_identified_or_refused_by_name():
    assert _release_of(fsdp2_sources()) == "26.1.0"
    refused = "UnsupportedHostError parallel.mla_latent_all_gather: this MindSpeed-LLM"
    master = _release_of(release_sources("master"))
    assert master.startswith(refused) and "builds on fsdp_turbo (master)" in master
    older = _release_of(release_sources("26.0.0"))  # its CP mapping table came with 26.1.0
    assert older.startswith(refused) and "has no FSDP2 context parallelism" in older
    for text in (master, older):
        assert text.endswith("use MindSpeed-LLM 26.1.0, or drop the key")
