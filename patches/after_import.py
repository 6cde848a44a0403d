"""Run a callback once a host module has been imported, by whoever imports it.

The launcher and the FSDP2 registration both change a host module right after the host
imports it: importing it themselves would run the host package's imports before the
entry script's own set-up (``torch_npu`` first, on Ascend).
"""
from __future__ import annotations

import importlib.abc
import importlib.util
import sys


class AfterImport(importlib.abc.MetaPathFinder):
    """Calls ``callback(module)`` once module ``name`` has been executed (one shot)."""

    def __init__(self, name, callback):
        self.name, self.callback = name, callback

    def find_spec(self, fullname, path=None, target=None):
        if fullname != self.name:
            return None
        sys.meta_path.remove(self)  # one shot; also keeps find_spec below from finding us
        spec = importlib.util.find_spec(fullname)
        if spec is None or spec.loader is None:
            return spec
        exec_module, callback = spec.loader.exec_module, self.callback

        def exec_then_callback(module):
            exec_module(module)
            callback(module)

        spec.loader.exec_module = exec_then_callback
        return spec


def after_import(name: str, callback) -> None:
    """Install the one-shot hook for ``name`` ahead of every other finder."""
    sys.meta_path.insert(0, AfterImport(name, callback))
