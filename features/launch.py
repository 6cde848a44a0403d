"""Run a MindSpeed-LLM training script with ``--mla-latent-all-gather`` available.

    python -m mindspeed_laga.launch pretrain_gpt.py <its arguments>   (entry: mindspeed_laga/launch.py)
    torchrun <launcher arguments> -m mindspeed_laga.launch pretrain_gpt.py <its arguments>
    torchrun <launcher arguments> -m mindspeed_laga.launch train_fsdp2.py CONFIG.yaml [--s.key v ...]

``train_fsdp2.py`` (MindSpeed-LLM's FSDP2 backend) takes the YAML key
``parallel.mla_latent_all_gather`` instead of the flag (fsdp2_launch.py); every other
script gets the flag as follows.

MindSpeed-LLM builds its argument parser from
``MindSpeedFeaturesManager.FEATURES_LIST`` and rejects unknown flags, and it
has no plugin hook. So this launcher makes sure ``LAGAFeature`` is in that
list from the moment the list exists, and stays there whenever MindSpeed or
MindSpeed-LLM resets it (``set_features_list``); then it runs the script as
``__main__`` with its arguments.

It imports nothing of MindSpeed itself: the features-manager module is patched
right after the script's own imports load it, so the script's import order
(``torch_npu.contrib.transfer_to_npu`` before MindSpeed) is unchanged.
"""
from __future__ import annotations

import importlib.util
import os
import runpy
import sys

from mindspeed_laga.patches.after_import import after_import

from .fsdp2_launch import install_fsdp2, is_fsdp2

MANAGER_MODULE = "mindspeed.features_manager.features_manager"
USAGE = ("usage: python -m mindspeed_laga.launch <training script> [script arguments]\n"
         "   or: torchrun <torchrun arguments> -m mindspeed_laga.launch <training script> "
         "[script arguments]")


def main(argv=None) -> None:
    argv = list(sys.argv[1:] if argv is None else argv)
    script, script_args = split_script(argv)
    if is_fsdp2(script):  # MindSpeed-LLM's FSDP2 backend: a YAML key, not a Megatron flag
        install_fsdp2(script_args)
    else:
        install_laga_feature()
    sys.argv = [script, *script_args]
    sys.path.insert(0, os.path.dirname(os.path.abspath(script)))  # as `python script.py` does
    runpy.run_path(script, run_name="__main__")


def split_script(argv):
    """(script, its arguments). Options before the script (``python -m
    torch.distributed.launch`` puts ``--local-rank=N`` there) go to the script."""
    for i, arg in enumerate(argv):
        if not arg.startswith("-"):
            if not os.path.isfile(arg):
                raise SystemExit(
                    f"mindspeed_laga.launch: training script {arg!r} not found\n{USAGE}")
            return arg, argv[i + 1:] + argv[:i]
    raise SystemExit(USAGE)


def install_laga_feature() -> None:
    """Put LAGAFeature into MindSpeed's features list now or as soon as it exists."""
    if importlib.util.find_spec("mindspeed") is None:
        raise SystemExit("mindspeed_laga.launch: MindSpeed is not importable. LAGA's MindSpeed "
                         "feature needs MindSpeed and MindSpeed-LLM (install both, see "
                         "docs/INTEGRATION.md); Megatron-LM users without MindSpeed call "
                         "mindspeed_laga.patch_megatron_mla() instead.")
    module = sys.modules.get(MANAGER_MODULE)
    if module is not None:
        keep_laga_in_features_list(module)
    else:
        after_import(MANAGER_MODULE, keep_laga_in_features_list)


def keep_laga_in_features_list(manager_module) -> None:
    """Add LAGAFeature to FEATURES_LIST and re-add it after every set_features_list."""
    manager = manager_module.MindSpeedFeaturesManager
    if getattr(manager, "_laga_keeps_feature", False):
        return
    set_list = manager.set_features_list  # bound classmethod

    def set_features_list_with_laga(cls, features_list):
        set_list(features_list)
        _add_laga(cls.FEATURES_LIST)

    manager.set_features_list = classmethod(set_features_list_with_laga)
    manager._laga_keeps_feature = True
    _add_laga(manager.FEATURES_LIST)


def _add_laga(features_list) -> None:
    # imported here: by now MindSpeed's feature base is loaded, so LAGAFeature subclasses it
    from . import LAGAFeature
    if not any(isinstance(f, LAGAFeature) for f in features_list):
        # last, so its validate_args sees the values MLA and CP features settled
        features_list.append(LAGAFeature())


if __name__ == "__main__":
    main()
