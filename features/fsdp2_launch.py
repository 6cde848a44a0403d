"""The launcher's FSDP2 path: ``train_fsdp2.py CONFIG.yaml [--section.key value ...]``.

    torchrun <torchrun arguments> -m mindspeed_laga.launch train_fsdp2.py CONFIG.yaml ...

LAGA is on when ``parallel.mla_latent_all_gather`` is true: in the YAML's ``parallel``
section beside ``cp_size``/``cp_type``, or as ``--parallel.mla_latent_all_gather
[true|false]`` on the command line, which wins over the YAML as every other key does
(the host's own rule). The host's parser leaves unknown keys alone, so the key needs no
host change. With it on, every rank checks here, before the process group exists (so
before any collective), the release, the model folder's ``config.json``, ``cp_type``
and the sequence length, and exits naming the key and the fix; then LAGA's group enters
the host's CP table (patches/fsdp2/register.py).
"""
from __future__ import annotations

import os
from typing import Optional, Sequence

KEY = "parallel.mla_latent_all_gather"
TRUE, FALSE = ("yes", "true", "t", "y", "1"), ("no", "false", "f", "n", "0")


def is_fsdp2(script: str) -> bool:
    return os.path.basename(script) == "train_fsdp2.py"


def _bool(value, name: str) -> bool:
    if isinstance(value, bool):
        return value
    text = str(value).strip().lower()
    if text in TRUE or text in FALSE:
        return text in TRUE
    raise SystemExit(f"mindspeed_laga.launch: {name} takes true or false, got {value!r}")


def _yaml(args: Sequence[str]) -> dict:
    if not args or not args[0].endswith((".yaml", ".yml")):
        return {}
    import yaml
    with open(args[0], encoding="utf-8") as f:
        return yaml.safe_load(f) or {}


def setting(args: Sequence[str], name: str, default=None, flag_alone=None):
    """The value the host reads for ``section.key``: the last command-line override
    (``--name value`` or ``--name=value``; ``flag_alone`` for a bare flag), else the YAML's."""
    found = None
    for i, arg in enumerate(args):
        if arg == f"--{name}":
            nxt = args[i + 1] if i + 1 < len(args) else None
            found = flag_alone if nxt is None or nxt.startswith("--") else nxt
        elif arg.startswith(f"--{name}="):
            found = arg.split("=", 1)[1]
    if found is not None:
        return found
    section, key = name.split(".", 1)
    value = (_yaml(args).get(section) or {}).get(key)
    return default if value is None else value


def laga_requested(args: Sequence[str]) -> bool:
    return _bool(setting(args, KEY, False, flag_alone=True), KEY)


def install_fsdp2(args: Sequence[str]) -> Optional[str]:
    """With the key on: check and register (every rank alike); returns the model type, or
    None when the key is off. A refusal exits naming the key and the fix."""
    if not laga_requested(args):
        return None
    from mindspeed_laga.patches.fsdp2 import host, register
    try:
        host.check_release()
        config = host.model_config(str(setting(args, "model.model_name_or_path", "")))
        host.check_model(config)
        host.check_model_id(config["model_type"], setting(args, "model.model_id", None))
        cp_type = str(setting(args, "parallel.cp_type", "ulysses"))
        host.cp_algo(cp_type)
        check_sequence(args, cp_type)
        if _bool(setting(args, "data.reset_attention_mask", False, flag_alone=True),
                 "data.reset_attention_mask"):
            raise ValueError(f"{KEY}: data.reset_attention_mask (packed documents) is not "
                             f"covered on this backend; set it false or drop the key")
        register.forward_of(config["model_type"])  # the form exists before training starts
        register.register([config["model_type"]])
    except (ValueError, RuntimeError, ImportError) as exc:
        rank = os.environ.get("RANK")
        where = f" (rank {rank})" if rank is not None else ""
        raise SystemExit(f"mindspeed_laga.launch{where}: {exc}") from None
    return config["model_type"]


def check_sequence(args: Sequence[str], cp_type: str) -> None:
    """Every CP rank holds as many tokens: ``ring`` cuts the sequence into 2 x cp_size
    chunks, ``ulysses`` into cp_size slices (the host gives the first ranks one token
    more when it does not divide; LAGA's ranks must agree on one length)."""
    cp_size = int(setting(args, "parallel.cp_size", 1))
    length = setting(args, "data.cutoff_len", None)
    if cp_size <= 1 or length is None:
        return
    pieces = 2 * cp_size if cp_type == "ring" else cp_size
    if int(length) % pieces:
        raise ValueError(f"{KEY}: data.cutoff_len {length} does not split into {pieces} equal "
                         f"pieces (parallel.cp_type {cp_type}, cp_size {cp_size}); set "
                         f"data.cutoff_len to a multiple of {pieces}")
