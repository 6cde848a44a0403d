"""Every configuration ``plan`` recommends is one LAGA's own checks accept: each row's
training flags, with the model and sizes the plan was asked for, go through the feature's
validation (``LAGAFeature.validate_args`` on the parser of tests/mindspeed/test_feature.py),
dense and sparse (``plan --dsa``) alike."""
from __future__ import annotations

import json

import pytest
from support.cli_runs import assert_one_line_error, run_cli
from support.laga_parser import parse

from mindspeed_laga.features import LAGAFeature

LAGA = "--mla-latent-all-gather"
DENSE = [
    ("--cp", "8"),
    ("--cp", "16", "--seq-len", "131072"),
    ("--cp", "4", "--cp-algo", "ulysses"),
    ("--cp", "16", "--cp-algo", "hybrid", "--ulysses-degree", "4"),
    ("--cp", "16", "--cp-algo", "hybrid", "--ulysses-degree", "8", "--device-memory", "1",
     "--num-layers", "4"),
    ("--npus-per-node", "8"),
    ("--npus-per-node", "4", "--cp", "16", "--seq-len", "65536"),
    ("--cp", "4", "--num-docs", "4"),
    ("--npus-per-node", "8", "--num-docs", "4"),
]
SPARSE = [
    ("--dsa", "deepseek-v3.2", "--cp", "16", "--seq-len", "131072"),
    ("--dsa", "glm-5", "--cp", "2"),
    ("--dsa", "glm-5", "--cp", "3", "--seq-len", "4101"),  # a multiple of CP, not of 2 x CP
]


def validate(argv):
    feature = LAGAFeature()
    args = parse(argv, feature)
    feature.validate_args(args)
    return args


def model_argv(heads: int, seq_len: int, cp: int, tp: int = 1) -> list:
    return ["--multi-latent-attention", "--disable-bias-linear", "--attention-dropout", "0.0",
            "--num-attention-heads", str(heads), "--seq-length", str(seq_len),
            "--context-parallel-size", str(cp), "--tensor-model-parallel-size", str(tp)]


def laga_rows(rows) -> list:
    """The rows that turn LAGA on (the host's own rows have nothing of LAGA's to check)."""
    return [r for r in rows if r and LAGA in r["flags"]]


@pytest.mark.parametrize("argv", DENSE, ids=[" ".join(a) for a in DENSE])
def test_every_dense_recommendation_validates(capsys, argv):
    code, out, err = run_cli(capsys, "plan", *argv, "--json")
    assert code == 0, err
    plan = json.loads(out)
    c, rec = plan["config"], plan["recommendation"]
    rows = laga_rows(rec[k] for k in ("best", "explicit", "host_best", "runner_up", "lean"))
    assert rec["best"]["flags"] in [r["flags"] for r in rows] or LAGA not in rec["best"]["flags"]
    documents = ["--reset-attention-mask", "--micro-batch-size", "1"] if c["doc_lens"] else []
    for row in rows:
        args = validate(model_argv(c["heads"], c["seq_len"], c["cp_size"], c["tp_size"]) + documents
                        + row["flags"].split())
        assert args.mla_latent_all_gather, row


@pytest.mark.parametrize("argv", SPARSE, ids=[" ".join(a) for a in SPARSE])
def test_every_sparse_recommendation_validates(capsys, argv):
    code, out, err = run_cli(capsys, "plan", *argv, "--json")
    assert code == 0, err
    table = json.loads(out)["dsa"]
    rec = table["recommendation"]
    assert rec["best"]["path"] == "laga"
    for row in laga_rows(rec["paths"].values()):
        validate(model_argv(table["dims"]["heads"], table["seq_len"], table["cp_size"])
                 + ["--enable-dsa-indexer"] + row["flags"].split())


@pytest.mark.parametrize("degree", ["16", "1"])
def test_a_hybrid_degree_laga_refuses_is_refused_by_plan(capsys, degree):
    # U = CP is ulysses and U = 1 a ring over every rank: MindSpeed and LAGA refuse both
    code, _, err = run_cli(capsys, "plan", "--cp", "16", "--cp-algo", "hybrid", "--ulysses-degree", degree)
    assert_one_line_error("plan", code, err, f"--ulysses-degree {degree}")
    # and the feature does refuse what plan would otherwise have recommended
    with pytest.raises(ValueError, match="--ulysses-degree-in-cp"):
        validate(model_argv(128, 16384, 16) + ["--context-parallel-algo", "hybrid_cp_algo",
                                               "--ulysses-degree-in-cp", degree, LAGA])
