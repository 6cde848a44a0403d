"""Fine-tuning data for the real loop, built the way a MindSpeed-LLM user builds it.

- a tiny tokenizer, trained here in a second with the ``tokenizers`` package on the
  made-up sentences below (byte-level BPE, so every character of a prompt template has
  tokens) and saved as a Hugging Face tokenizer directory (``PreTrainedTokenizerFast``),
  so ``--tokenizer-type PretrainedFromHF`` loads it and nothing is downloaded;
- instruction data: an alpaca-style json (instruction, input, output) of made-up
  requests of varied lengths;
- MindSpeed-LLM's own ``preprocess_data.py`` turns it into the host's indexed dataset
  (``--handler-name AlpacaStyleInstructionHandler`` with a ``--prompt-type`` of
  ``configs/finetune/templates.json``), once unpacked (padded SFT) and once with
  ``--pack`` (packed SFT, trained with ``--reset-attention-mask``).
"""
from __future__ import annotations

import hashlib
import json
import os
import random
import shutil
import subprocess
import sys
import tempfile
from pathlib import Path
from typing import List

# the deepseek3 template's special tokens (DeepSeek-V3's own spellings); DeepSeek-V3's
# tokenizer pads with its EOS, so a packed sequence's padding tail is a run of one-token
# documents and the documents' ends reach the sequence's end (what the NPU's varlen
# attention requires of them)
BOS, EOS = "<｜begin▁of▁sentence｜>", "<｜end▁of▁sentence｜>"
PAD = EOS
SPECIAL = [BOS, EOS, "<｜User｜>", "<｜Assistant｜>"]
TOKENIZER_VOCAB = 400  # 256 bytes + specials + merges enough for one token per word
PROMPT_TYPE = "deepseek3"  # the stock tune recipe's --prompt-type
HANDLER = "AlpacaStyleInstructionHandler"
IGNORE = -100  # the label of a token without loss (prompt, padding)

WORDS = ("the cat dog bird sun moon tree river stone cloud red blue green small large quick "
         "slow sings runs reads writes counts finds lists sorts adds").split()
TASKS = ("Count the words", "Sort these items", "Translate to pig latin", "Name a colour",
         "Write a short line", "List the animals", "Add the numbers", "Describe the sky")


def sentences(rng: random.Random, count: int, low: int, high: int) -> List[str]:
    return [" ".join(rng.choice(WORDS) for _ in range(rng.randint(low, high)))
            for _ in range(count)]


def alpaca_records(count: int = 48, seed: int = 11) -> List[dict]:
    """Made-up instruction data: prompts and answers of varied lengths (so each padded
    sample has its own pad length). Each prompt is long and each answer short enough for
    the layout check_labels asks of the built dataset."""
    rng = random.Random(seed)
    return [dict(instruction=rng.choice(TASKS) + ".", input=sentences(rng, 1, 7, 9)[0],
                 output=sentences(rng, 1, 2, 6)[0] + ".") for _ in range(count)]


def boundary_positions(seq_length: int, cp_size: int) -> List[int]:
    """Where a CP split of the sequence starts a chunk (2·CP chunks: the zigzag's and,
    every other one, the contiguous split's)."""
    chunk = seq_length // (2 * cp_size)
    return list(range(chunk, seq_length, chunk))


def check_labels(built: dict, seq_length: int, cp_size: int) -> None:
    """The host's SFT loss shifts the labels by one inside each CP rank's shard
    (GPTModel's ``labels[:, 1:]`` with ``--is-instruction-dataset``, and the trainer's
    ``loss_mask[..., 1:]``): at CP > 1 the prediction of the first token of every chunk
    is dropped (zigzag: paired with another chunk's token), LAGA or not, so the host
    trains another model than at CP = 1 unless those labels are ignored. The data is made
    so that they are (prompt tokens and padding carry label -100), whatever the padding
    side: every sample is at most half a sequence and its first chunk + 1 labels are
    prompt. Raises if the built dataset breaks that."""
    import numpy
    from megatron.core.datasets.indexed_dataset import IndexedDataset

    positions = boundary_positions(seq_length, cp_size)
    padded = IndexedDataset(built["padded"] + "_packed_labels_document")
    for i in range(len(padded)):
        labels = numpy.asarray(padded[i])
        if len(labels) > seq_length // 2 or (labels[:positions[0] + 1] != IGNORE).any():
            raise RuntimeError(f"padded sample {i} breaks the CP-invariant layout: {labels}")
    packed = IndexedDataset(built["packed"] + "_packed_labels_document")
    for i in range(len(packed)):  # packed runs use a contiguous split: only the middle counts
        labels = numpy.asarray(packed[i])
        if labels[seq_length // 2] != IGNORE:
            raise RuntimeError(f"packed sequence {i} breaks the CP-invariant layout: {labels}")


def build_tokenizer(target: Path) -> Path:
    """A byte-level BPE tokenizer trained on made-up sentences, saved as an HF directory."""
    from tokenizers import Tokenizer, decoders, models, pre_tokenizers, trainers
    from transformers import PreTrainedTokenizerFast

    tokenizer = Tokenizer(models.BPE())
    tokenizer.pre_tokenizer = pre_tokenizers.ByteLevel(add_prefix_space=False)
    tokenizer.decoder = decoders.ByteLevel()
    trainer = trainers.BpeTrainer(vocab_size=TOKENIZER_VOCAB, special_tokens=SPECIAL,
                                  initial_alphabet=pre_tokenizers.ByteLevel.alphabet())
    corpus = sentences(random.Random(3), 200, 3, 12) + list(TASKS)
    tokenizer.train_from_iterator(corpus, trainer=trainer)
    fast = PreTrainedTokenizerFast(tokenizer_object=tokenizer, bos_token=BOS, eos_token=EOS,
                                   pad_token=PAD)
    fast.save_pretrained(str(target))
    return target


# mindspeed_llm imports torch_npu on import: the loop's CPU stand-ins stand in for it here
# too, then the host's script runs as its own __main__
RUN_WITH_STAND_INS = (
    "import runpy, sys\n"
    "from support import npu_host\n"
    "npu_host.install()\n"
    "sys.argv = sys.argv[1:]\n"
    "runpy.run_path(sys.argv[0], run_name='__main__')\n")


def preprocess(sources: dict, tokenizer: Path, data_json: Path, prefix: Path,
               pack_to: int = 0) -> None:
    """MindSpeed-LLM's preprocess_data.py, as its fine-tuning docs run it (in a subprocess:
    the host's own modules are imported there)."""
    llm_src = Path(sources["MINDSPEED_LLM_SRC"])
    command = [sys.executable, "-c", RUN_WITH_STAND_INS, str(llm_src / "preprocess_data.py"),
               "--input", str(data_json), "--tokenizer-type", "PretrainedFromHF",
               "--tokenizer-name-or-path", str(tokenizer), "--output-prefix", str(prefix),
               "--handler-name", HANDLER, "--prompt-type", PROMPT_TYPE,
               "--workers", "1", "--log-interval", "1000",
               "--cache-dir", str(prefix.parent / "hf-cache")]
    if pack_to:
        command += ["--pack", "--seq-length", str(pack_to)]
    tests = Path(__file__).resolve().parents[2]
    path = [str(tests), str(llm_src), sources["MINDSPEED_SRC"], sources["MEGATRON_SRC"]]
    env = dict(os.environ, PYTHONPATH=os.pathsep.join(path),
               HF_DATASETS_OFFLINE="1", HF_HUB_OFFLINE="1", TOKENIZERS_PARALLELISM="false")
    done = subprocess.run(command, cwd=prefix.parent, env=env, capture_output=True, text=True,
                          timeout=300)
    if done.returncode != 0:
        raise RuntimeError(f"preprocess_data.py failed:\n{done.stdout[-3000:]}\n"
                           f"{done.stderr[-6000:]}")


def build(sources: dict, folder: Path, seq_length: int, cp_size: int = 2) -> dict:
    """The tokenizer directory, its vocabulary size and both datasets' prefixes (the host
    appends ``_packed`` to an instruction dataset's prefix), checked for CP = ``cp_size``
    (check_labels); built once per folder (staged beside it and renamed into place, so
    concurrent builders never see half a dataset)."""
    done = folder / "built.json"
    if not done.is_file():
        folder.parent.mkdir(parents=True, exist_ok=True)
        staging = Path(tempfile.mkdtemp(prefix=".building-", dir=folder.parent))
        try:
            _build_into(sources, staging, seq_length, cp_size)
            try:
                staging.rename(folder)
            except OSError:  # a concurrent builder won
                if not done.is_file():
                    raise
        finally:
            shutil.rmtree(staging, ignore_errors=True)
    built = json.loads(done.read_text())
    return dict(built, **{key: str(folder / built[key]) for key in ("tokenizer", "padded", "packed")})


def _build_into(sources: dict, folder: Path, seq_length: int, cp_size: int) -> None:
    tokenizer = build_tokenizer(folder / "tokenizer")
    data_json = folder / "alpaca.json"
    data_json.write_text(json.dumps(alpaca_records(), indent=1))
    (folder / "padded").mkdir()
    (folder / "packed").mkdir()
    preprocess(sources, tokenizer, data_json, folder / "padded" / "alpaca")
    preprocess(sources, tokenizer, data_json, folder / "packed" / "alpaca", pack_to=seq_length)
    for cache in folder.glob("*/hf-cache"):
        shutil.rmtree(cache)
    from transformers import AutoTokenizer
    built = dict(tokenizer="tokenizer", vocab=len(AutoTokenizer.from_pretrained(str(tokenizer))),
                 padded="padded/alpaca", packed="packed/alpaca")
    code = ("import json, sys\nfrom support.loop.tune_data import check_labels\n"
            "check_labels(json.loads(sys.argv[1]), int(sys.argv[2]), int(sys.argv[3]))\n")
    tests = Path(__file__).resolve().parents[2]
    paths = {key: str(folder / built[key]) for key in ("padded", "packed")}
    checked = subprocess.run([sys.executable, "-c", code, json.dumps(paths), str(seq_length),
                              str(cp_size)], capture_output=True, text=True, timeout=120,
                             env=dict(os.environ, PYTHONPATH=os.pathsep.join(
                                 [str(tests), sources["MEGATRON_SRC"]])))
    if checked.returncode != 0:
        raise RuntimeError(checked.stderr[-3000:])
    (folder / "built.json").write_text(json.dumps(built))


def cached_folder(sources: dict) -> Path:
    """Where the data of this generator and these host sources is kept across runs (the
    test cache, keyed by this file's text and the MindSpeed-LLM source)."""
    from support.thirdparty import cache_dir

    key = hashlib.sha256(Path(__file__).read_bytes() + str(
        Path(sources["MINDSPEED_LLM_SRC"]).resolve()).encode()).hexdigest()[:16]
    return cache_dir().parent / "loop" / f"tune-data-{key}"
