"""LAGA through MindSpeed-LLM's own fine-tuning loop: the unmodified ``posttrain_gpt.py``
under ``torchrun ... -m mindspeed_laga.launch`` on gloo CPU ranks
(tests/support/loop/tune_loop.py).

Every case trains the stock CP fine-tuning recipe
(``tune_deepseek3_671b_16k_lora_A3_ptd.sh``: SFT, LoRA r 8 / alpha 16 with
``--lora-fusion``, full recompute; scaled down) for a few iterations on instruction data
built by the host's ``preprocess_data.py``, with ``--mla-latent-all-gather`` at CP = 2,
and must equal the same recipe at CP = 1 without LAGA (the host's own MLA attention on the
strict ``npu_fusion_attention`` stand-in) iteration by iteration: LM loss and grad norm at
full precision, with the pretrain loop's tolerances (tests/support/loop/compare.py).

Cases: padded SFT (the trainer's causal + key-padding mask) with right and left padding,
packed SFT (``--reset-attention-mask``), LoRA on the stock targets, LoRA with the K/V
up-projection added (fused ``linear_kv_up_proj``; ``--mla-mm-split``'s ``linear_kv_nope``
and ``linear_v``), and a ``--lora-load`` resume; ``ulysses_cp_algo`` (the recipe's),
``kvallgather_cp_algo`` and ``megatron_cp_algo``.

The data is laid out so that the host itself is CP-invariant: its SFT loss shifts the
labels inside each CP shard and so drops the first token of every CP chunk at CP > 1, LAGA
or not; the prompts and the padding cover those positions (tune_data.check_labels, run on
the built data). The host's CP-local router terms (``--seq-aux``,
``--moe-router-enable-expert-bias``) are left out as in the pretrain loop.

Each rank counts its calls: LAGA's attention ran on every MLA forward and the host's core
attention never.

Every other release pair (26.1.0, 26.0.0, 2.3.0, 2.2.0) runs the recipe's own case (padded
SFT, stock LoRA targets, ``ulysses_cp_algo``) against its own CP = 1 run (26.0.0 and older
with block recompute: RELEASE_CASES).
"""
from __future__ import annotations

import re
from pathlib import Path

import pytest

from mindspeed_laga.patches.mindspeed_llm.releases import BY_NAME
from support.loop import real_loop, tune_loop
from support.loop.steady_state import assert_steady_state
# the pretrain loop's tolerances and bound
from support.loop.compare import GRAD_NORM_RTOL, LOSS_RTOL, RUN_TIMEOUT_S, assert_release_found
from support.thirdparty import RELEASE_NAMES, release_sources

pytestmark = [pytest.mark.ascend, pytest.mark.loop, pytest.mark.hosts]

KV_UP = ["linear_kv_up_proj"]
MM_SPLIT_KV = ["linear_kv_nope", "linear_v"]
LEFT = ["--tokenizer-padding-side", "left"]
# what the fine-tune loop needs beyond the pretrain loop's (MindSpeed-LLM's requirements)
TUNE_MODULES = {"peft": "peft==0.7.1", "datasets": "datasets", "tokenizers": "tokenizers"}


def _missing():
    import importlib.util
    return real_loop.missing_modules() + [pin for name, pin in TUNE_MODULES.items()
                                          if importlib.util.find_spec(name) is None]


@pytest.fixture(scope="session")
def tune_data():
    """The tokenizer and datasets, built once with master's preprocess_data.py and kept in
    the test cache (the indexed format is the same in every release)."""
    from support.thirdparty import find_host_sources
    _skip_without_modules()
    return tune_loop.prepare_data(find_host_sources("master"))


def _skip_without_modules():
    missing = _missing()
    if missing:  # as host_sources does: skip naming them, fail under CI=true
        from support.thirdparty import skip_or_fail
        skip_or_fail(f"the fine-tune loop needs: pip install {' '.join(missing)}")


def _runner(sources, workdir, data):
    """run(name, cp, algo, laga, **recipe): one loop of the scaled-down tune recipe on these
    host sources, each name run once."""
    ready = tune_loop.prepare(sources, data)
    runs = {}

    def run(name, cp, algo="ulysses_cp_algo", laga=True, **recipe):
        if name not in runs:
            argv = tune_loop.tune_recipe(Path(ready["sources"]["MINDSPEED_LLM_SRC"]), cp, algo,
                                         laga, ready["data"], **_resolve(recipe, workdir))
            runs[name] = tune_loop.run(ready, workdir / name, cp, argv, timeout_s=RUN_TIMEOUT_S)
        return runs[name]

    return run


def _resolve(recipe, workdir):
    """``save``: this run saves its final checkpoint (the runner's one checkpoint folder);
    ``load_from``: the case whose CP = 1 run saved it, which this run loads with --load and
    --lora-load (base and adapters)."""
    recipe = dict(recipe)
    extra = list(recipe.pop("extra", []))
    if recipe.pop("save", False):
        extra += ["--save", str(workdir / "checkpoint")]
    source = recipe.pop("load_from", None)
    if source:
        extra += ["--load", str(workdir / "checkpoint"), "--lora-load", str(workdir / "checkpoint")]
    recipe["extra"] = extra
    return recipe


@pytest.fixture(scope="module")
def tune(host_sources, tmp_path_factory, tune_data):
    """The master pair's runner, shared by every master case of this module."""
    return _runner(host_sources, tmp_path_factory.mktemp("real-tune"), tune_data)


def reference(tune, **recipe):
    """The same recipe at CP = 1 without LAGA: the host's own attention."""
    name = re.sub(r"[^\w=.-]+", "_", "cp1-" + "-".join(f"{k}={v}" for k, v in sorted(recipe.items())))
    ref = tune(name, 1, laga=False, **recipe)
    for counts in ref.counts:
        assert counts.get("laga_attention", 0) == 0, counts
        assert counts["core_attention"] == counts["mla_forward"] > 0, counts
    losses = ref.series("lm loss")
    assert max(losses) - min(losses) > 1e-3, f"the losses do not move: {losses}"
    assert min(ref.series("grad norm")) > 0, "the adapters got no gradient: nothing trains"
    return ref


def assert_laga_ran_everywhere(run, ref):
    """LAGA's attention on every MLA forward of every rank, as many as the CP = 1 run
    made (layers x micro-batches x iterations, twice where full recompute reruns them),
    the host's core and fused attention never."""
    layers = int(run.argv[run.argv.index("--num-layers") + 1])
    expected = ref.counts[0]["mla_forward"]
    assert expected >= layers * tune_loop.MICRO_BATCHES * tune_loop.ITERATIONS, ref.counts
    for rank, counts in enumerate(run.counts):
        where = f"rank {rank}: {counts}"
        assert counts.get("core_attention", 0) == 0, "the host's core attention ran: " + where
        assert counts.get("npu_fusion_attention", 0) == 0, where
        assert counts.get("npu_fusion_attention_grad", 0) == 0, where
        assert counts["laga_attention"] == counts["mla_forward"] == expected, where


def relative_errors(run, ref):
    """{"lm loss": [...], "grad norm": [...]}: per iteration, relative to CP = 1."""
    return {key: [abs(g - w) / abs(w) for g, w in zip(run.series(key), ref.series(key))]
            for key in ("lm loss", "grad norm")}


def assert_same_training(run, ref):
    assert sorted(run.iterations) == list(range(1, tune_loop.ITERATIONS + 1)), run.iterations
    assert not any(v["skipped"] for v in run.iterations.values())
    errors = relative_errors(run, ref)
    print(f"\n{run.argv[run.argv.index('--context-parallel-algo') + 1]}: largest relative "
          f"difference from CP=1: loss {max(errors['lm loss']):.2g}, grad norm "
          f"{max(errors['grad norm']):.2g} ({run.seconds:.0f} s, CP=1 {ref.seconds:.0f} s)")
    for key, rtol in (("lm loss", LOSS_RTOL), ("grad norm", GRAD_NORM_RTOL)):
        assert max(errors[key]) <= rtol, (f"{key}: {run.series(key)} vs CP=1 {ref.series(key)} "
                                          f"(relative {errors[key]})")


TARGETS = tune_loop.STOCK_TARGETS
# case -> (CP algorithm, recipe): each against the same recipe at CP = 1 without LAGA
CASES = {
    # the stock recipe as shipped (padded SFT, right padding, stock LoRA targets)
    "ulysses-padded-right": ("ulysses_cp_algo", dict()),
    # the host's pad rows see no key with left padding, so its own attention leaves them
    # unspecified (tune_loop.run): the router's expert bias, which counts them, stays out
    "kvallgather-padded-left": ("kvallgather_cp_algo",
                                dict(extra=LEFT, without=["--moe-router-enable-expert-bias"])),
    # LoRA on the K/V up-projection too (its checkpoint is the resume case's)
    "kvallgather-packed-lora-kv-up": ("kvallgather_cp_algo",
                                      dict(packed=True, targets=TARGETS + KV_UP, save=True)),
    "ulysses-packed-mm-split-lora-kv": ("ulysses_cp_algo",
                                        dict(packed=True, targets=TARGETS + MM_SPLIT_KV,
                                             extra=["--mla-mm-split"])),
    # --lora-load of the adapters trained above (non-zero lora_B from the first step)
    "megatron-padded-right-lora-load": ("megatron_cp_algo",
                                        dict(targets=TARGETS + KV_UP,
                                             load_from="kvallgather-packed-lora-kv-up")),
}


@pytest.mark.timeout(3 * RUN_TIMEOUT_S)
@pytest.mark.parametrize("case", list(CASES))
def test_tune_equals_cp1(tune, case):
    algo, recipe = CASES[case]
    if "load_from" in recipe:  # the checkpoint: that case's CP = 1 run saved it
        reference(tune, **CASES[recipe["load_from"]][1])
    ref = reference(tune, **recipe)
    run = tune(case, 2, algo, **{k: v for k, v in recipe.items() if k != "save"})
    assert_laga_ran_everywhere(run, ref)
    assert_same_training(run, ref)
    assert_steady_state(run, tune_loop.MICRO_BATCHES, tune_loop.ITERATIONS)


# --- the other release pairs: the recipe's own case ------------------------------------------
#
# 26.0.0, 2.3.0 and 2.2.0 make the embedding output require grad for LoRA under full
# recompute only with --recompute-method block (master and 26.1.0: any full recompute); with
# the recipe's uniform method their recomputed blocks get no input that requires grad, so
# no adapter receives a gradient and nothing trains (grad norm 0, LAGA or not). Their case
# runs the recipe with block recompute, the method those releases hook for LoRA.
BLOCK_RECOMPUTE = dict(without=["--recompute-method"], extra=["--recompute-method", "block"])
# Keyed by the release that owns the facts (a release declared the same as another runs its
# case); every other release runs the recipe as master and 26.1.0 do.
LEAVES_OUT = {"26.0.0": BLOCK_RECOMPUTE, "2.3.0": BLOCK_RECOMPUTE, "2.2.0": BLOCK_RECOMPUTE}
RELEASE_CASES = {name: LEAVES_OUT.get(BY_NAME[name].facts_owner, dict())
                 for name in RELEASE_NAMES if name != "master"}


@pytest.fixture(scope="module")
def release_tune(tmp_path_factory, tune_data):
    runners = {}

    def get(release):
        if release not in runners:
            runners[release] = _runner(release_sources(release),
                                       tmp_path_factory.mktemp(f"real-tune-{release}"),
                                       tune_data)
        return runners[release]

    return get


@pytest.mark.timeout(3 * RUN_TIMEOUT_S)
@pytest.mark.parametrize("release", list(RELEASE_CASES))
def test_release_tune_equals_cp1(release_tune, release):
    tune = release_tune(release)
    ref = reference(tune, **RELEASE_CASES[release])
    run = tune("ulysses-padded-right", 2, "ulysses_cp_algo", **RELEASE_CASES[release])
    assert_release_found(run, release)
    assert_laga_ran_everywhere(run, ref)
    assert_same_training(run, ref)
    assert_steady_state(run, tune_loop.MICRO_BATCHES, tune_loop.ITERATIONS)
