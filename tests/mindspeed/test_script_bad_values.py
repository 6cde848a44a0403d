"""Every bad environment value of the recipe scripts stops them with one line (exit 2)
before anything launches. Each case runs the script for real, without DRY_RUN=1, in a
checkout that holds the entry script, against a stand-in torchrun that records the command
it is given: only the scripts' checks stand between a bad value and a recorded launch,
and the good run beside them shows the stand-in does record one."""
import os
import re
import subprocess
import sys

import pytest

from mindspeed_laga.features.laga_args import KERNEL_CHOICES
from support.laga_scripts import SCRIPTS

PRETRAIN, TUNE, LONG = "pretrain_deepseek3_laga.sh", "tune_deepseek3_laga.sh", "pretrain_deepseek3_128k_laga.sh"
NAMES = (PRETRAIN, TUNE, LONG)
WRAPS = str(2**64 + 2)  # bash's 64-bit arithmetic reads it as 2
HYBRID = {"CP": "4", "CP_TYPE": "hybrid_cp_algo"}

# (environment, words of the one line): every script refuses these
BAD = [
    ({"DRY_RUN": "yes"}, "DRY_RUN=yes: must be 0 or 1"),
    ({"DRY_RUN": "true"}, "DRY_RUN=true: must be 0 or 1"),
    ({"DRY_RUN": "2"}, "DRY_RUN=2: must be 0 or 1"),
    ({"LAGA_KERNEL": "bogus"}, f"LAGA_KERNEL=bogus: use one of {', '.join(KERNEL_CHOICES)}"),
    ({"LAGA_KERNEL": "auto eager"}, "LAGA_KERNEL=auto eager: use one of"),
    ({"LAGA_KERNEL": "sdpa"}, "LAGA_KERNEL=sdpa: use one of"),
    ({"NNODES": "abc"}, "NNODES=abc: must be a positive integer"),
    ({"NNODES": "0"}, "NNODES=0: must be a positive integer"),
    ({"NPUS_PER_NODE": "-8"}, "NPUS_PER_NODE=-8: must be a positive integer"),
    ({"MASTER_PORT": "70000"}, "MASTER_PORT=70000: must be a port number from 1 to 65535"),
    ({"MASTER_PORT": "0"}, "MASTER_PORT=0: must be a port number"),
    ({"MASTER_PORT": "http"}, "MASTER_PORT=http: must be a port number"),
    ({"MASTER_PORT": str(2**64 + 6000)}, f"MASTER_PORT={2**64 + 6000}: must be a port number"),
    ({"NNODES": "2", "NODE_RANK": "2"}, "NODE_RANK=2: must be an integer from 0 to NNODES-1 = 1"),
    ({"NODE_RANK": "-1"}, "NODE_RANK=-1: must be an integer from 0"),
    ({"MASTER_ADDR": "node0 node1"}, "MASTER_ADDR=node0 node1: one host name or address"),
    ({"LAGA_BLOCK": "4096"}, "LAGA_BLOCK=4096 needs LAGA_RECOMPUTE=1"),
    ({"LAGA_BLOCK": "0", "LAGA_RECOMPUTE": "1"}, "LAGA_BLOCK=0: must be a positive integer"),
    ({"LAGA": "0", "LAGA_TRIM": "1"}, "LAGA_TRIM=1 needs LAGA=1"),
    ({"LAGA": "0", "LAGA_KERNEL": "eager"}, "LAGA_KERNEL=eager needs LAGA=1"),
    ({"CP": WRAPS}, f"CP={WRAPS}: must be a positive integer up to 2147483647"),
    ({"CP": str(2**63)}, f"CP={2**63}: must be a positive integer"),
    ({"CP": "4294967298"}, "CP=4294967298: must be a positive integer up to 2147483647"),
    ({"SEQ_LEN": str(2**64)}, f"SEQ_LEN={2**64}: must be a positive integer"),
    ({"CP": "128", "CP_TYPE": "megatron_cp_algo"}, "CP=128: TP*PP*CP ="),
    ({**HYBRID, "ULYSSES_DEGREE": "4"}, "ULYSSES_DEGREE=4 must be less than CP=4"),
    ({**HYBRID, "ULYSSES_DEGREE": "1"}, "ULYSSES_DEGREE=1 with LAGA=1: hybrid_cp_algo needs U > 1"),
    ({**HYBRID, "ULYSSES_DEGREE": "3"}, "ULYSSES_DEGREE=3 must divide CP=4"),
    ({**HYBRID, "ULYSSES_DEGREE": WRAPS}, f"ULYSSES_DEGREE={WRAPS}: must be a positive integer"),
]
# what one script refuses for its own reason: packed documents under hybrid (LAGAFeature's
# rule), and the 128k recipe's general mask under kvallgather_cp_algo (the host's)
OWN_BAD = [
    (PRETRAIN, {**HYBRID, "ULYSSES_DEGREE": "2"}, "hybrid_cp_algo with packed documents (RESET_MASK=1)"),
    (TUNE, {**HYBRID, "ULYSSES_DEGREE": "2", "PACKED": "1"}, "hybrid_cp_algo with packed documents (PACKED=1)"),
    (LONG, {"CP_TYPE": "kvallgather_cp_algo"}, "CP_TYPE=kvallgather_cp_algo takes causal masks only"),
]
# values the scripts launch with, which a check too strict would refuse
GOOD = [
    (PRETRAIN, {}), (TUNE, {}), (LONG, {}),
    (PRETRAIN, {**HYBRID, "ULYSSES_DEGREE": "2", "RESET_MASK": "0"}),
    (PRETRAIN, {"LAGA": "0", **HYBRID, "ULYSSES_DEGREE": "2"}),  # MindSpeed's own hybrid packs
    (TUNE, {**HYBRID, "ULYSSES_DEGREE": "2"}),
    (LONG, {**HYBRID, "ULYSSES_DEGREE": "2"}),  # general mask: LAGA covers hybrid there
    (PRETRAIN, {"LAGA_KERNEL": "eager", "LAGA_RECOMPUTE": "1", "LAGA_BLOCK": "2048",
                "MASTER_PORT": "65535", "NNODES": "4", "NODE_RANK": "3", "NPUS_PER_NODE": "16",
                "TRANSFORMER_IMPL": "transformer_engine"}),
]


@pytest.fixture
def node(tmp_path):
    """(environment, record): a stand-in torchrun first on PATH that writes its arguments to
    ``record``, and a MindSpeed-LLM checkout holding the entry scripts."""
    bin_dir, checkout = tmp_path / "bin", tmp_path / "MindSpeed-LLM"
    bin_dir.mkdir()
    checkout.mkdir()
    record = tmp_path / "torchrun.argv"
    torchrun = bin_dir / "torchrun"
    torchrun.write_text(f'#!/bin/sh\nprintf "%s\\n" "$@" > "{record}"\n')
    torchrun.chmod(0o755)
    python = bin_dir / "python"  # the scripts find mindspeed_laga with it
    python.write_text(f'#!/bin/sh\nexec "{sys.executable}" "$@"\n')
    python.chmod(0o755)
    for entry in ("pretrain_gpt.py", "posttrain_gpt.py"):
        (checkout / entry).write_text("")
    env = {k: v for k, v in os.environ.items() if k != "DRY_RUN"}
    env.update(PATH=f"{bin_dir}{os.pathsep}{env['PATH']}", MINDSPEED_LLM_DIR=str(checkout))
    return env, record


def run(name, node, env):
    base, record = node
    proc = subprocess.run(["bash", str(SCRIPTS / name)], env=dict(base, **env), cwd=base["MINDSPEED_LLM_DIR"],
                          capture_output=True, text=True, timeout=60)
    return proc, record


def assert_refused(name, node, env, words):
    proc, record = run(name, node, env)
    assert not record.exists(), f"launched with {env}: {record.read_text()[:300]}"
    assert proc.returncode == 2 and proc.stdout == "", (proc.returncode, proc.stdout[-300:])
    assert proc.stderr.splitlines() == [proc.stderr.strip()] and proc.stderr.startswith(f"{name}: "), proc.stderr
    assert words in proc.stderr, proc.stderr


@pytest.mark.parametrize("name", NAMES)
@pytest.mark.parametrize("env, words", BAD, ids=[" ".join(f"{k}={v}" for k, v in e.items()) for e, _ in BAD])
def test_every_bad_value_is_one_line_and_no_launch(node, name, env, words):
    assert_refused(name, node, env, words)


@pytest.mark.parametrize("name, env, words", OWN_BAD, ids=[n for n, *_ in OWN_BAD])
def test_each_scripts_own_refusals(node, name, env, words):
    assert_refused(name, node, env, words)


@pytest.mark.parametrize("name, env", GOOD)
def test_good_values_reach_the_stand_in_torchrun(node, name, env):
    proc, record = run(name, node, env)
    assert proc.returncode == 0, proc.stderr
    argv = record.read_text().splitlines()
    assert argv[argv.index("--context-parallel-size") + 1] == env.get("CP", "8" if name == LONG else "2")
    for key, flag in (("NNODES", "--nnodes"), ("NODE_RANK", "--node_rank"), ("MASTER_PORT", "--master_port")):
        if key in env:
            assert argv[argv.index(flag) + 1] == env[key]


@pytest.mark.parametrize("name", NAMES)
def test_dry_run_one_launches_nothing(node, name):
    proc, record = run(name, node, {"DRY_RUN": "1"})
    assert proc.returncode == 0 and proc.stdout.startswith("torchrun") and not record.exists()


@pytest.mark.parametrize("name", NAMES)
def test_the_scripts_kernels_are_the_flags_choices(node, name):
    """Every kernel the training flag takes is taken; the scripts keep no list of their own."""
    assert "LAGA_KERNELS=" not in (SCRIPTS / "deepseek3_common.sh").read_text()
    for kernel in KERNEL_CHOICES:
        proc, _ = run(name, node, {"LAGA_KERNEL": kernel, "DRY_RUN": "1"})
        assert proc.returncode == 0 and f"--mla-laga-kernel {kernel}" in proc.stdout, proc.stderr


@pytest.mark.parametrize("name", NAMES)
def test_a_kernel_without_mindspeed_laga_to_list_it_is_one_line(node, name):
    assert_refused(name, node, {"LAGA_KERNEL": "eager", "LAGA_PYTHON": "false"},
                   "LAGA_KERNEL=eager: LAGA_PYTHON=false cannot import mindspeed_laga")
