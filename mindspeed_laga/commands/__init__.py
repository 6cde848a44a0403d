"""Subcommands of ``mindspeed-laga``: each module has ``add_parser(sub)`` and ``run(args)``."""
import importlib

_NAMES = ("verify", "plan", "bench")


def _load():
    found = {}
    for name in _NAMES:
        try:
            found[name] = importlib.import_module(f"{__name__}.{name}")
        except ModuleNotFoundError as exc:
            if exc.name != f"{__name__}.{name}":
                raise
    return found


SUBCOMMANDS = _load()
