"""Names a package imports on first use: ``__getattr__ = lazy(__name__, {name: ".module"})``.

So that importing a package (the CLI parsing its arguments, ``--help``) imports no torch
until a name that needs it is read.
"""
import importlib


def lazy(package: str, table: dict):
    """A module ``__getattr__`` that imports ``table[name]`` (relative to ``package``) on
    first use and keeps the value in the package's namespace."""
    def __getattr__(name):
        if name in table:
            module = importlib.import_module(package)
            value = getattr(importlib.import_module(table[name], package), name)
            setattr(module, name, value)
            return value
        raise AttributeError(f"module {package!r} has no attribute {name!r}")
    return __getattr__
