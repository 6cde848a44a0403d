"""The recipe scripts pass what users give them, or refuse it in one line naming it:

- the script's own arguments go to the launch, after the recipe's flags; one naming a flag
  the recipe passes is refused naming the variable that sets it, and LAGA's flags with
  LAGA=0 are refused;
- TP, PP, EP, GBS and MBS in the environment: the recipe's value is taken, another is
  refused naming the recipe's;
- a path with a space stays one argument;
- CPU_AFFINITY_CONF and LORA_TARGETS are checked.
"""
import os
import shlex
import subprocess

import pytest

from support.laga_scripts import SCRIPTS, flags

NAMES = ("pretrain_deepseek3_laga.sh", "tune_deepseek3_laga.sh", "pretrain_deepseek3_128k_laga.sh")
ENTRY = {"tune_deepseek3_laga.sh": "posttrain_gpt.py"}
# each script's fixed layout, as its launch line shows it
LAYOUT = {"pretrain_deepseek3_laga.sh": dict(TP="4", PP="8", EP="32", GBS="3840", MBS="1"),
          "tune_deepseek3_laga.sh": dict(TP="1", PP="8", EP="16", GBS="128", MBS="1"),
          "pretrain_deepseek3_128k_laga.sh": dict(TP="1", PP="1", EP="64", GBS="16", MBS="1")}
LAYOUT_FLAGS = {"TP": "--tensor-model-parallel-size", "PP": "--pipeline-model-parallel-size",
                "EP": "--expert-model-parallel-size", "GBS": "--global-batch-size",
                "MBS": "--micro-batch-size"}


def run(name, *argv, **env):
    env = {k: v for k, v in dict(os.environ, DRY_RUN="1", **env).items()
           if k not in LAYOUT_FLAGS or k in env}
    return subprocess.run(["bash", str(SCRIPTS / name), *argv], env=env, capture_output=True,
                          text=True, timeout=60)


def launched(proc, name):
    assert proc.returncode == 0, proc.stderr
    tokens = shlex.split(proc.stdout.replace("\\\n", " "))
    return tokens[tokens.index(ENTRY.get(name, "pretrain_gpt.py")) + 1:]


def refused(proc, name, words):
    lines = proc.stderr.strip().splitlines()
    assert proc.returncode == 2 and proc.stdout == "", proc.stdout[-500:]
    assert len(lines) == 1 and lines[0].startswith(f"{name}: ") and words in lines[0], proc.stderr


@pytest.mark.parametrize("name", NAMES)
def test_extra_arguments_reach_the_launch_last(name):
    args = launched(run(name, "--mla-laga-overlap", "--timing-log-level=1", "--exit-interval", "9"),
                    name)
    assert args[-4:] == ["--mla-laga-overlap", "--timing-log-level=1", "--exit-interval", "9"]
    assert args[:-4] == launched(run(name), name)


@pytest.mark.parametrize("name", NAMES)
@pytest.mark.parametrize("argv, words", [
    (["--seq-length", "8192"], "extra argument --seq-length: the recipe passes --seq-length "
                               "already (set SEQ_LEN instead)"),
    (["--mla-laga-kernel=eager"], "(set LAGA_KERNEL instead)"),
    (["--tensor-model-parallel-size", "8"], "(set TP instead)"),
    (["--bf16"], "extra argument --bf16: the recipe passes --bf16 already (edit the recipe"),
])
def test_an_extra_argument_the_recipe_passes_is_refused(name, argv, words):
    refused(run(name, *argv), name, words)


@pytest.mark.parametrize("name", NAMES)
def test_laga_flags_need_laga(name):
    refused(run(name, "--mla-laga-overlap", LAGA="0"), name,
            "extra argument --mla-laga-overlap needs LAGA=1")


@pytest.mark.parametrize("name", NAMES)
@pytest.mark.parametrize("var", sorted(LAYOUT_FLAGS))
def test_the_layout_from_the_environment_is_the_recipes_or_refused(name, var):
    mine = LAYOUT[name][var]
    args = flags(launched(run(name, **{var: mine}), name))
    assert args[LAYOUT_FLAGS[var]] == [[mine]]
    other = str(int(mine) * 2)
    refused(run(name, **{var: other}), name,
            f"{var}={other}: this recipe trains with {var}={mine}")


@pytest.mark.parametrize("name", NAMES)
@pytest.mark.parametrize("var, flag", [("DATA_PATH", "--data-path"),
                                       ("TOKENIZER_PATH", "--tokenizer-name-or-path"),
                                       ("CKPT_SAVE_DIR", "--save")])
def test_a_path_with_a_space_is_one_argument(name, var, flag, tmp_path):
    path = str(tmp_path / "my data" / "it's here")
    assert flags(launched(run(name, **{var: path}), name))[flag] == [[path]]
    refused(run(name, **{var: ""}), name, f"{var} is empty")


@pytest.mark.parametrize("name", NAMES)
@pytest.mark.parametrize("value", ["garbage", "3", "1,npu0:1", "1;npu0:0-23"])
def test_cpu_affinity_is_checked(name, value):
    refused(run(name, CPU_AFFINITY_CONF=value), name, f"CPU_AFFINITY_CONF={value}: use MODE")


@pytest.mark.parametrize("name", NAMES)
def test_a_valid_cpu_affinity_is_taken(name):
    launched(run(name, CPU_AFFINITY_CONF="2,npu0:0-23,npu1:24-47"), name)


@pytest.mark.parametrize("value", ["", "a;b", " linear_qkv", "linear_qkv,linear_proj"])
def test_lora_targets_are_module_names(value):
    refused(run("tune_deepseek3_laga.sh", LORA_TARGETS=value), "tune_deepseek3_laga.sh",
            f"LORA_TARGETS='{value}': give module names separated by spaces")


def test_lora_targets_reach_the_launch_one_name_an_argument():
    name = "tune_deepseek3_laga.sh"
    args = flags(launched(run(name, LORA_TARGETS="linear_qkv linear_kv_up_proj"), name))
    assert args["--lora-target-modules"] == [["linear_qkv", "linear_kv_up_proj"]]
