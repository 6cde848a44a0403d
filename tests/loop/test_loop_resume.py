"""Resuming across ``--mla-latent-all-gather``, through MindSpeed-LLM's own ``pretrain_gpt.py``
(tests/support/loop/real_loop.py).

LAGA adds no parameter and no state: it replaces how the MLA module's K/V reach attention.
So a checkpoint saved with it must resume without it (and at another CP size), or under
another CP algorithm, and one saved without it must resume with it, and the iterations
after the resume must equal one uninterrupted run.

The recipe is the scaled-down stock one on a 6-iteration schedule (cosine decay over all
six), saving in Megatron's default ``torch_dist`` format with the optimizer state: the
stock ``--use-distributed-optimizer`` shards it over DP x CP, so the CP = 2 save holds two
shards that the CP = 1 resume reads back as one (dist_checkpointing reshards). The stock
``--no-save-rng --no-load-rng`` stay (no dropout: nothing draws from the RNG).

- ``uninterrupted``: CP = 1 without LAGA, iterations 1-6, saving at 3 (and 6);
- ``saved-with-laga``: LAGA at CP = 2 (megatron_cp_algo), ``--exit-interval 3``;
- ``without-laga-cp1``: resumes that save at CP = 1 without the flag;
- ``laga-ulysses``: resumes it with LAGA under ulysses_cp_algo;
- ``laga-from-without``: LAGA at CP = 2 (kvallgather_cp_algo) resumes the uninterrupted
  run's save at iteration 3 (``--ckpt-step 3``): saved without the flag, resumed with it.

A resume that starts from other weights or another optimizer state fails: a save from
another seed moves iterations 4-6 by 7.7e-3, ten thousand times the tolerance.
"""
from __future__ import annotations

from pathlib import Path

import pytest

from support.loop import compare, real_loop
from support.loop.compare import assert_ran, require_loop_modules

pytestmark = [pytest.mark.ascend, pytest.mark.loop, pytest.mark.hosts]

ITERATIONS = 6
SAVED_AT = 3
# every layer MoE: with the stock dense first layer (--first-k-dense-replace 1) the host's
# torch_dist save stops at "Invalid access pattern for ShardedTensor(key='decoder.layers.mlp.
# linear_fc1.weight'": it stacks the layers' MLPs under one key and only layer 0 has a dense one
SCHEDULE = {"--train-iters": str(ITERATIONS), "--save-interval": str(SAVED_AT),
            "--first-k-dense-replace": "0"}
# the stock recipe's torch checkpoints without the optimizer: torch_dist (the default) with it
SAVE_OPTIMIZER = ["--ckpt-format", "--no-save-optim", "--no-load-optim"]

# name -> (CP, algorithm, LAGA, what it saves or loads)
RUNS = {
    "uninterrupted": (1, "megatron_cp_algo", False, ["--save", "{without}"]),
    "saved-with-laga": (2, "megatron_cp_algo", True,
                        ["--save", "{with}", "--exit-interval", str(SAVED_AT)]),
    "without-laga-cp1": (1, "megatron_cp_algo", False, ["--load", "{with}"]),
    "laga-ulysses": (2, "ulysses_cp_algo", True, ["--load", "{with}"]),
    "laga-from-without": (2, "kvallgather_cp_algo", True,
                          ["--load", "{without}", "--ckpt-step", str(SAVED_AT)]),
}
RESUMED = ["without-laga-cp1", "laga-ulysses", "laga-from-without"]
SAVED_FROM = {"without-laga-cp1": "saved-with-laga", "laga-ulysses": "saved-with-laga",
              "laga-from-without": "uninterrupted"}


@pytest.fixture(scope="module")
def resume_loop(host_sources, tmp_path_factory):
    """run(name): that run of RUNS, each once; the savers before the runs that load them."""
    require_loop_modules()
    workdir = tmp_path_factory.mktemp("resume")
    ready = real_loop.prepare(host_sources, workdir, real_loop.default_documents())
    folders = {"with": str(workdir / "saved-with-laga"), "without": str(workdir / "saved-without")}
    runs = {}

    def run(name):
        if name not in runs:
            if name in SAVED_FROM:
                run(SAVED_FROM[name])
            cp, algo, laga, files = RUNS[name]
            argv = real_loop.recipe(Path(ready["sources"]["MINDSPEED_LLM_SRC"]), cp, algo, laga,
                                    ready["data_path"], layout=SCHEDULE, without=SAVE_OPTIMIZER,
                                    extra=[f.format(**folders) for f in files])
            runs[name] = real_loop.run_loop(ready["sources"], workdir / name, cp, argv,
                                            timeout_s=compare.RUN_TIMEOUT_S)
        return runs[name]

    return run


def assert_same_iterations(run, ref, iterations):
    assert sorted(run.iterations) == list(iterations), sorted(run.iterations)
    for key, rtol in (("lm loss", compare.LOSS_RTOL), ("grad norm", compare.GRAD_NORM_RTOL)):
        got = [run.series(key)[sorted(run.iterations).index(i)] for i in iterations]
        want = [ref.series(key)[sorted(ref.iterations).index(i)] for i in iterations]
        errors = [abs(g - w) / abs(w) for g, w in zip(got, want)]
        assert max(errors) <= rtol, f"{key}: {got} vs uninterrupted {want} (relative {errors})"


@pytest.mark.timeout(3 * compare.RUN_TIMEOUT_S)
def test_saved_with_laga_equals_uninterrupted(resume_loop):
    """The save itself: LAGA at CP = 2 trains iterations 1-3 as the CP = 1 run does."""
    ref, saver = resume_loop("uninterrupted"), resume_loop("saved-with-laga")
    assert_ran(ref, laga=False)
    assert_ran(saver, laga=True)
    losses = ref.series("lm loss")
    assert max(losses) - min(losses) > 1e-3, f"the losses do not move: {losses}"
    assert_same_iterations(saver, ref, range(1, SAVED_AT + 1))


@pytest.mark.timeout(3 * compare.RUN_TIMEOUT_S)
@pytest.mark.parametrize("name", RESUMED)
def test_resume_across_the_flag(resume_loop, name):
    ref, resumed = resume_loop("uninterrupted"), resume_loop(name)
    assert "successfully loaded checkpoint" in resumed.log, resumed.log[-2000:]
    assert_ran(resumed, laga=RUNS[name][2])
    assert_same_iterations(resumed, ref, range(SAVED_AT + 1, ITERATIONS + 1))
