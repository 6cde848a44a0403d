"""Run MindSpeed-LLM's unmodified ``train_fsdp2.py`` on gloo CPU ranks, as a user would.

    torchrun --nproc-per-node N -m mindspeed_laga.launch train_fsdp2.py CONFIG.yaml [--s.key v ...]

What a CPU machine needs for that, and nothing in the host sources changes:

- a writable copy of MindSpeed-LLM 26.1.0 with its FSDP2 archive over it
  (tests/support/thirdparty.py: fsdp2_sources): the backend builds its dataset helper with
  ``make`` inside its source tree and runs its data converter by a path relative to the
  working folder, so the ranks run in that copy (built once per source and Python);
- a shrunk HF model folder: ``config.json`` from transformers' own config class and a
  word-level tokenizer of :data:`VOCAB` words (``tokenizers``), both written here;
- raw pretraining text (jsonl) that the backend converts itself, as it does a user's;
- tests/support/fsdp2/bootstrap first on PYTHONPATH: its ``sitecustomize`` installs the CPU
  stand-ins and records each rank's losses, grad norms and counters (``rank<R>.json``).

The YAML is the host's own GLM-5.2 system test's, its model and data sections pointed at
these files and its parallel sizes at one node of CPU ranks, fp32 (bf16 on CPU would hide
small differences), NPU-only fusions off.

``python tests/support/fsdp2/loop.py --cp 2 --cp-type ring [--laga]`` runs one case.
"""
from __future__ import annotations

import argparse
import json
import os
import random
import shutil
import subprocess
import sys
import sysconfig
import tempfile
import time
from dataclasses import dataclass, field
from pathlib import Path
from typing import List, Optional

TESTS = Path(__file__).resolve().parents[2]
BOOTSTRAP = Path(__file__).resolve().parent / "bootstrap"
LOOP_BOOTSTRAP = TESTS / "support" / "loop" / "bootstrap"
SYSTEM_TEST = "tests/pipeline/st/glm52/pretrain_glm52_38b_4k_fsdp2_A3.yaml"
SEQ_LENGTH = 32
VOCAB = 128
STEPS = 3
LAGA_KEY = "parallel.mla_latent_all_gather"

# the shrunk HF DeepSeek-V3: MLA with q-lora, one dense and one MoE layer (shared expert,
# grouped top-k router)
DEEPSEEK_V3 = dict(
    vocab_size=VOCAB, hidden_size=64, intermediate_size=128, moe_intermediate_size=32,
    num_hidden_layers=2, first_k_dense_replace=1, num_attention_heads=4, num_key_value_heads=4,
    n_routed_experts=4, num_experts_per_tok=2, n_group=2, topk_group=1, n_shared_experts=1,
    q_lora_rank=32, kv_lora_rank=32, qk_rope_head_dim=8, qk_nope_head_dim=16, v_head_dim=16,
    max_position_embeddings=SEQ_LENGTH * 2, tie_word_embeddings=False,
    bos_token_id=1, eos_token_id=1, pad_token_id=0)


# the shrunk GLM-5.2 (``glm_moe_dsa``; model_id glm52, MindSpeed-LLM's own model): DSA with
# fewer picks than keys, a layer that computes its picks and one that shares them, MoE
GLM52 = dict(
    vocab_size=VOCAB, hidden_size=64, intermediate_size=128, moe_intermediate_size=32,
    num_hidden_layers=3, mlp_layer_types=["dense", "sparse", "sparse"],
    indexer_types=["full", "shared", "full"], num_attention_heads=4, num_key_value_heads=4,
    n_routed_experts=4, num_experts_per_tok=2, n_group=1, topk_group=1, n_shared_experts=1,
    q_lora_rank=32, kv_lora_rank=32, qk_rope_head_dim=8, qk_nope_head_dim=16, v_head_dim=16,
    head_dim=8, index_topk=8, index_head_dim=16, index_n_heads=2,
    max_position_embeddings=SEQ_LENGTH * 2, tie_word_embeddings=False,
    bos_token_id=1, eos_token_id=1, pad_token_id=0)
# name -> (model_type, shrunk config, model.model_id, attention class, environment): the DSA
# indexer's ReLU scores tie at 0 across the k-th pick, whose order torch.topk leaves open;
# the GLM runs order ties by position in every rank, as LAGA's sparse form does
POSITION_ORDERED_TOPK = {"LAGA_LOOP_POSITION_ORDERED_TOPK": "1"}
MODELS = {"deepseek_v3": ("deepseek_v3", DEEPSEEK_V3, None, "DeepseekV3Attention", {}),
          "glm52": ("glm_moe_dsa", GLM52, "glm52", "GlmMoeDsaAttention", POSITION_ORDERED_TOPK)}


def writable_llm(llm_src: Path) -> Path:
    """A copy of the MindSpeed-LLM tree with its FSDP2 dataset helper built (once)."""
    from support.loop.real_loop import _built_once
    from support.thirdparty import cache_dir
    import hashlib

    suffix = sysconfig.get_config_var("EXT_SUFFIX")
    key = hashlib.sha256(f"{Path(llm_src).resolve()}|{suffix}".encode()).hexdigest()[:16]
    helper = Path("mindspeed_llm") / "fsdp2" / "data" / "megatron_data"

    def build(staging: Path):
        copy = staging / "MindSpeed-LLM"
        shutil.copytree(llm_src, copy, symlinks=False)
        includes = subprocess.run([sys.executable, "-m", "pybind11", "--includes"], check=True,
                                  capture_output=True, text=True).stdout.split()
        subprocess.run([os.environ.get("CXX", "g++"), "-O3", "-Wall", "-shared", "-std=c++11",
                        "-fPIC", *includes, "helpers.cpp", "-o", f"helpers_cpp{suffix}"],
                       cwd=copy / helper, check=True, capture_output=True, timeout=300)
        (copy / ".helper-built").touch()

    target = cache_dir().parent / "fsdp2" / f"llm-{key}"
    return _built_once(target, Path("MindSpeed-LLM") / ".helper-built", build) / "MindSpeed-LLM"


def write_model(folder: Path, model: str = "deepseek_v3", **overrides) -> Path:
    """config.json of the shrunk model (a key of MODELS) and a word-level tokenizer of VOCAB
    words."""
    import importlib
    from tokenizers import Tokenizer, models, pre_tokenizers
    from transformers import PreTrainedTokenizerFast

    folder.mkdir(parents=True, exist_ok=True)
    model_type = MODELS[model][0]
    module = importlib.import_module(f"transformers.models.{model_type}.configuration_{model_type}")
    class_name = "".join(p.capitalize() for p in model_type.split("_")) + "Config"
    config_class = getattr(module, class_name)
    model_config = config_class(**{**MODELS[model][1], **overrides})
    model_config.save_pretrained(folder)
    if MODELS[model][2] is not None:  # a registered model_id loads weights: transformers' own
        _write_weights(folder, model_config)
    vocab = {"<pad>": 0, "<eos>": 1, "<unk>": 2, **{f"w{i}": i for i in range(3, VOCAB)}}
    tokenizer = Tokenizer(models.WordLevel(vocab, unk_token="<unk>"))
    tokenizer.pre_tokenizer = pre_tokenizers.WhitespaceSplit()
    PreTrainedTokenizerFast(tokenizer_object=tokenizer, pad_token="<pad>", eos_token="<eos>",
                            unk_token="<unk>", bos_token="<eos>").save_pretrained(folder)
    return folder


def _write_weights(folder: Path, model_config, seed: int = 1234):
    """Random weights of the HF model class (the names the host's model loads), in fp32."""
    import torch
    from transformers import AutoModelForCausalLM

    with torch.random.fork_rng(devices=[]):
        torch.manual_seed(seed)
        AutoModelForCausalLM.from_config(model_config, torch_dtype=torch.float32) \
            .save_pretrained(folder)


def write_text(path: Path, documents: int = 60, seed: int = 7) -> Path:
    """jsonl of documents of random words, most shorter than a sequence."""
    rng = random.Random(seed)
    with open(path, "w") as f:
        for _ in range(documents):
            words = [f"w{rng.randrange(3, VOCAB)}" for _ in range(rng.randint(5, 40))]
            f.write(json.dumps({"text": " ".join(words)}) + "\n")
    return path


def config(llm: Path, model: Path, data: Path, cp: int, cp_type: str, nproc: int,
           model_id: Optional[str] = None) -> dict:
    """The system test's YAML, pointed at these files and shrunk to ``nproc`` CPU ranks."""
    import yaml

    cfg = yaml.safe_load((llm / SYSTEM_TEST).read_text())
    cfg["model"].update(model_id=model_id, model_name_or_path=str(model), train_from_scratch=True,
                        init_model_with_meta_device=False, tokenizer_name_or_path=str(model))
    if model_id is None:
        del cfg["model"]["model_id"]
    cfg["data"].update(dataset={"file_name": str(data)}, cutoff_len=SEQ_LENGTH, max_samples=None,
                       preprocessing_num_workers=None, append_eod=True)
    cfg["parallel"].update(fsdp_size=nproc, ep_size=1, ep_fsdp_size=1, recompute=False,
                           cp_size=cp, cp_type=cp_type, param_dtype="fp32", reduce_dtype="fp32")
    cfg["training"].update(max_steps=STEPS, gradient_accumulation_steps=2, lr=3e-3, min_lr=3e-4,
                           dataloader_num_workers=0, output_dir="output", save_steps=0)
    # the NPU fusions off (their CPU stand-ins are the sparse-form tests' business); the
    # indexer loss coefficient as the system test sets it
    cfg["optimization"] = {key: False if isinstance(value, bool) else value
                           for key, value in cfg["optimization"].items()}
    return cfg


@dataclass
class Fsdp2Run:
    """One run: per optimizer step the micro-batch losses and grad norm (rank 0), the log,
    each rank's counters and per-region steady-state record."""
    log: str
    steps: List[dict]
    counts: List[dict]
    steady: List[dict] = field(default_factory=list)
    seconds: float = 0.0
    indexer_losses: List[Optional[float]] = field(default_factory=list)  # per step (DSA)
    payloads: List[dict] = field(default_factory=list)  # per rank: region -> [[kind, bytes]]

    def values_per_token(self, kind: str, tokens: int, itemsize: int = 4) -> set:
        """Values per local token of every ``kind`` collective LAGA's layer calls issued
        outside backward, as a set over ranks and calls."""
        return {payload // (tokens * itemsize) for rank in self.payloads
                for region, calls in rank.items() if region.startswith("forward.")
                for k, payload in calls if k == kind}

    def losses(self) -> List[float]:
        return [sum(step["losses"]) for step in self.steps]

    def grad_norms(self) -> List[float]:
        return [step["grad_norm"] for step in self.steps]


class Fsdp2Failed(RuntimeError):
    def __init__(self, message: str, log: str = ""):
        super().__init__(message)
        self.log = log


def run(llm: Path, sources: dict, workdir: Path, nproc: int, cfg: dict, overrides=(),
        laga: bool = False, timeout_s: float = 300, every_rank_exits: bool = False,
        attention: str = "DeepseekV3Attention", extra_env=None) -> Fsdp2Run:
    """torchrun ... -m mindspeed_laga.launch train_fsdp2.py CONFIG.yaml overrides, in ``llm``."""
    import yaml
    from support.loop.real_loop import EVERY_RANK_MONITOR_S, python_shims, torchrun

    workdir.mkdir(parents=True, exist_ok=True)
    record = workdir / "record"
    shutil.rmtree(record, ignore_errors=True)
    record.mkdir()
    config_path = workdir / "config.yaml"
    config_path.write_text(yaml.safe_dump(cfg))
    path = [str(BOOTSTRAP), str(llm), sources["MINDSPEED_SRC"], sources["MEGATRON_SRC"]]
    env = dict(os.environ, PYTHONPATH=os.pathsep.join(path), LAGA_FSDP2_RECORD=str(record),
               PATH=os.pathsep.join([str(python_shims(workdir)), os.environ.get("PATH", "")]),
               LAGA_LOOP_TESTS=str(TESTS), LAGA_FSDP2_ATTENTION=attention,
               TRAINING_BACKEND="mindspeed_fsdp", OMP_NUM_THREADS="1", PYTHONUNBUFFERED="1",
               TOKENIZERS_PARALLELISM="false", HF_HUB_OFFLINE="1")
    env.update(extra_env or {})
    if every_rank_exits:
        env["PET_MONITOR_INTERVAL"] = str(EVERY_RANK_MONITOR_S)
    argv = [str(config_path), *overrides] + ([f"--{LAGA_KEY}", "true"] if laga else [])
    start = time.monotonic()
    text = torchrun(["train_fsdp2.py", *argv], nproc, env, llm, workdir / "log.txt", timeout_s,
                    Fsdp2Failed)
    ranks = [json.loads((record / f"rank{r}.json").read_text()) for r in range(nproc)]
    return Fsdp2Run(log=text, steps=ranks[0]["steps"], counts=[r["counts"] for r in ranks],
                    indexer_losses=ranks[0].get("indexer_losses", []),
                    payloads=[r.get("payloads", {}) for r in ranks],
                    steady=[r["steady_state"] for r in ranks], seconds=time.monotonic() - start)


def prepare(sources: dict, workdir: Path, model: str = "deepseek_v3", **overrides) -> dict:
    """The writable host tree, the model folder and the raw text, for every case of a module."""
    llm = writable_llm(Path(sources["MINDSPEED_LLM_SRC"]))
    model = write_model(workdir / "model", model, **overrides)
    data = write_text(workdir / "text.jsonl")
    return dict(llm=llm, model=model, data=data, sources=sources)


def runner(sources: dict, workdir: Path, timeout_s: float, model: str = "deepseek_v3"):
    """case(name, cp=1, cp_type="ulysses", laga=False, nproc=cp, overrides=(), ...): each
    name run once in ``workdir / name``, all on one model folder and text (:func:`prepare`);
    ``run.workdir`` is ``workdir``."""
    ready = prepare(sources, workdir, model)
    _, _, model_id, attention, model_env = MODELS[model]
    runs = {}

    def case(name, cp=1, cp_type="ulysses", laga=False, nproc=None, overrides=(), **kwargs):
        if name not in runs:
            nproc = nproc or cp
            cfg = config(ready["llm"], ready["model"], ready["data"], cp, cp_type, nproc,
                         model_id=model_id)
            runs[name] = run(ready["llm"], ready["sources"], workdir / name, nproc, cfg,
                             overrides, laga=laga, timeout_s=timeout_s, attention=attention,
                             extra_env=model_env, **kwargs)
        return runs[name]

    case.workdir = workdir
    return case


def main():
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--cp", type=int, default=1)
    parser.add_argument("--cp-type", default="ulysses")
    parser.add_argument("--nproc", type=int, default=2)
    parser.add_argument("--laga", action="store_true")
    parser.add_argument("--model", default="deepseek_v3", choices=sorted(MODELS))
    parser.add_argument("--workdir", default=None)
    args, overrides = parser.parse_known_args()
    sys.path.insert(0, str(TESTS))
    from support.thirdparty import find_fsdp2_sources

    workdir = Path(args.workdir or tempfile.mkdtemp(prefix="laga-fsdp2-"))
    ready = prepare(find_fsdp2_sources(), workdir, args.model)
    _, _, model_id, attention, model_env = MODELS[args.model]
    cfg = config(ready["llm"], ready["model"], ready["data"], args.cp, args.cp_type, args.nproc,
                 model_id=model_id)
    result = run(ready["llm"], ready["sources"], workdir / "run", args.nproc, cfg, overrides,
                 laga=args.laga, attention=attention, extra_env=model_env)
    for i, step in enumerate(result.steps):
        indexer = result.indexer_losses[i] if i < len(result.indexer_losses) else None
        print(i + 1, json.dumps(dict(step, indexer_loss=indexer)))
    print("counts per rank:", json.dumps(result.counts))
    print(f"{result.seconds:.1f} s; workdir {workdir}")


if __name__ == "__main__":
    main()
