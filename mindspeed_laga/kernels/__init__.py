"""Attention kernels: what each declares (``registry.py``, ``declared/``: torch-free, what the
CLI's parser reads) and what they run (``dense.py``: ``attend``; one torch module per backend).

The names below are imported on first use, so that reading the registry (``mindspeed-laga
--help``, the cost model) does not import torch.
"""
from ..lazy import lazy

_LAZY = {"attend": ".dense", "held_keys": ".dense", "poison_rows": ".dense", "KeyIndex": ".dense",
         "KERNEL_TYPES": ".registry", "kernel_for": ".registry", "resolve": ".registry"}


__getattr__ = lazy(__name__, _LAZY)
