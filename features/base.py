"""A stand-in for ``mindspeed.features_manager.feature.MindSpeedFeature``.

Used only when MindSpeed is not importable (CI, Megatron-LM-only users), so
``LAGAFeature`` can be built, parsed and validated anywhere. Same constructor,
hooks and ``is_need_apply`` rule as MindSpeed's base: a feature named
``mla-latent-all-gather`` is on when ``args.mla_latent_all_gather`` is truthy
and its optimization level does not exceed ``args.optimization_level``.
"""
from __future__ import annotations

from argparse import ArgumentParser, Namespace


class MindSpeedFeatureBase:
    """Hooks a MindSpeed feature may override; all default to doing nothing."""

    def __init__(self, feature_name: str, optimization_level: int = 2):
        self.feature_name = feature_name.lower().strip().replace("-", "_")
        self.optimization_level = optimization_level
        # MindSpeed applies level-0 features unconditionally
        self.default_patches = self.optimization_level == 0

    def is_need_apply(self, args: Namespace):
        return (self.optimization_level <= args.optimization_level
                and getattr(args, self.feature_name, None)) or self.default_patches

    def register_args(self, parser: ArgumentParser):
        pass

    def pre_validate_args(self, args: Namespace):
        pass

    def validate_args(self, args: Namespace):
        pass

    def post_validate_args(self, args: Namespace):
        pass

    def pre_register_patches(self, patch_manager, args: Namespace):
        pass

    def register_patches(self, patch_manager, args: Namespace):
        pass

    def incompatible_check(self, global_args, check_args):
        if getattr(global_args, self.feature_name, None) and getattr(global_args, check_args, None):
            raise AssertionError(f"{self.feature_name} and {check_args} are incompatible.")

    def dependency_check(self, global_args, check_args):
        enabled = getattr(global_args, self.feature_name, None)
        if enabled and not getattr(global_args, check_args, None):
            raise AssertionError(f"{self.feature_name} requires {check_args}.")
