"""Subcommands of ``mindspeed-laga``: each module has ``add_parser(sub)`` and ``run(args)``."""
from . import bench, doctor, plan, verify

SUBCOMMANDS = {"verify": verify, "plan": plan, "bench": bench, "doctor": doctor}
