"""``LAGAFeature``: LAGA as a MindSpeed feature, enabled by ``--mla-latent-all-gather``.

Built like MindSpeed's ``MLAFeature``: it registers its flags, validates them
after Megatron's validation and registers two patches: a wrapper around
MindSpeed-LLM's ``CustomMLASelfAttention.forward``, and one around Megatron's
``get_model`` that refuses a built model LAGA would leave unchanged
(patches/mindspeed_llm/model_check.py). MindSpeed-LLM has no
plugin hook, so ``python -m mindspeed_laga.launch`` adds the feature to
``MindSpeedFeaturesManager.FEATURES_LIST`` (see docs/INTEGRATION.md).
"""
from __future__ import annotations

import logging
import os
import sys
import warnings
from argparse import ArgumentParser, Namespace

from .dsa_checks import check_index_share
from .laga_args import (FEATURE_NAME, FLAG, context_parallel_algo, options_without_laga,
                        register_laga_args)
from .laga_checks import check_laga_args, context_parallel_size

try:  # the real base when MindSpeed is installed, so MindSpeed treats us as its own
    from mindspeed.features_manager.feature import MindSpeedFeature as _Base
except ImportError:
    from .base import MindSpeedFeatureBase as _Base

logger = logging.getLogger(__name__)

MLA_FORWARD = ("mindspeed_llm.tasks.models.transformer.multi_latent_attention."
               "CustomMLASelfAttention.forward")
# checked after each rank builds its model: an MLA module LAGA patched is in it
GET_MODEL = "megatron.training.training.get_model"


class LAGAFeature(_Base):
    """Latent All-Gather Attention for MLA under context parallelism."""

    def __init__(self):
        super().__init__(FEATURE_NAME, optimization_level=2)

    def register_args(self, parser: ArgumentParser):
        register_laga_args(parser)

    def validate_args(self, args: Namespace):
        # MindSpeed validates every feature, enabled or not
        if not getattr(args, self.feature_name, False):
            _refuse_options_without_laga(args)
            return
        if self._level_too_low(args):
            return  # MindSpeed will not apply the feature: nothing of it to validate
        if not check_laga_args(args):
            logger.warning("%s has no effect with --context-parallel-size 1: MLA attends to the "
                           "whole sequence locally", FLAG)
            return
        self._check_host_release(args)

    @staticmethod
    def _check_host_release(args: Namespace) -> None:
        """Before training: the installed MindSpeed-LLM/MindSpeed pair is a tested release
        (UnsupportedHostError naming the tested ones otherwise), logged by name, and the
        options this release's forward cannot take are refused (ValueError)."""
        import importlib.util
        if importlib.util.find_spec("mindspeed_llm") is None:
            return  # no MindSpeed-LLM: the patch has no target, nothing of LAGA runs
        from mindspeed_laga.patches.mindspeed_llm.host import check_mindspeed_llm_release
        release = check_mindspeed_llm_release()
        found = f"{FLAG}: {release.found()}"  # the facts it shows, not a release it may not be
        logger.info(found)
        if os.environ.get("RANK", "0") == "0":  # the start-up log, once per job
            print(found, flush=True)
        check_index_share(args, release)  # GLM-5.2's shared picks: where the host has them
        algo = context_parallel_algo(args)
        if getattr(args, "reset_attention_mask", False) and not release.takes_documents(algo):
            other = (f"use --context-parallel-algo {' or '.join(release.document_algos)}, "
                     if release.document_algos else "")
            raise ValueError(f"{FLAG} with --reset-attention-mask and {algo} is not supported "
                             f"on MindSpeed-LLM {release.name}: {release.documents_refused}. "
                             f"{other.capitalize()}drop --reset-attention-mask, install a newer "
                             f"release, or drop {FLAG}")

    def _level_too_low(self, args: Namespace) -> bool:
        """Warn, and True, when MindSpeed's --optimization-level filters this feature out:
        it registers a feature's patches only when the feature's level is at most
        --optimization-level (is_need_apply), so the flag alone would do nothing."""
        level = getattr(args, "optimization_level", None)
        if level is None or level >= self.optimization_level:
            return False
        message = (f"{FLAG} is not applied: MindSpeed registers features of optimization level "
                   f"{self.optimization_level} only with --optimization-level "
                   f"{self.optimization_level} or above, and this run has --optimization-level "
                   f"{level}. Pass --optimization-level {self.optimization_level} (MindSpeed's "
                   f"default) or drop {FLAG}")
        logger.warning(message)
        warnings.warn(message, stacklevel=3)
        return True

    def register_patches(self, patch_manager, args: Namespace):
        # args here come from MindSpeed-LLM's early parse_known_args: unknown
        # Megatron flags such as --context-parallel-size are still strings
        if context_parallel_size(args) == 1:
            return
        from mindspeed_laga.patches.mindspeed_llm.forward import laga_mla_forward_wrapper
        from mindspeed_laga.patches.mindspeed_llm.model_check import laga_model_check_wrapper
        patch_manager.register_patch(MLA_FORWARD, laga_mla_forward_wrapper)
        patch_manager.register_patch(GET_MODEL, laga_model_check_wrapper)


def _refuse_options_without_laga(args: Namespace) -> None:
    """A ``--mla-laga-*`` option without ``--mla-latent-all-gather`` would do nothing: every
    rank parses the same command line, so every rank refuses it here, before training."""
    given = options_without_laga(args, sys.argv[1:])
    if given:
        raise ValueError(f"{', '.join(given)} {'acts' if len(given) == 1 else 'act'} only with "
                         f"{FLAG}, which is off: add {FLAG} to train with LAGA, or drop "
                         f"{', '.join(given)}")
