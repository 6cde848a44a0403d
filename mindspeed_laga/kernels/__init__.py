"""Attention kernels: what each declares (``registry.py``, ``declared/``: torch-free, what the
CLI's parser reads) and what they run (``dense.py``: ``attend``; one torch module per backend).

The names below are imported on first use, so that reading the registry (``mindspeed-laga
--help``, the cost model) does not import torch.
"""
import importlib

_LAZY = {"attend": ".dense", "held_keys": ".dense", "poison_rows": ".dense", "KeyIndex": ".dense",
         "KERNEL_TYPES": ".registry", "kernel_for": ".registry", "resolve": ".registry"}


def __getattr__(name):
    if name in _LAZY:
        value = getattr(importlib.import_module(_LAZY[name], __name__), name)
        globals()[name] = value
        return value
    raise AttributeError(f"module {__name__!r} has no attribute {name!r}")
