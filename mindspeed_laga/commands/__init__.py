"""Subcommands of ``mindspeed-laga``: each module has ``add_parser(sub)`` and ``run(args)``."""
from . import bench, plan, verify

SUBCOMMANDS = {"verify": verify, "plan": plan, "bench": bench}
