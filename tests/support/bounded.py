"""Every test bounded in time, so a hung rank or collective fails a test instead of the run.

The multi-rank runner (``mindspeed_laga.tools.spawn.run_on_ranks``) bounds each call
by its own ``timeout_s``; with pytest-timeout installed (the ``test`` extra)
this also puts a ceiling on every test that has no ``timeout`` marker and runs
without ``--timeout``, fixtures included.
"""
import pytest

DEFAULT_TIMEOUT_S = 900  # above the slowest module fixture on a loaded 2-core machine


def _timeout_configured(config) -> bool:
    if config.getoption("timeout", None) is not None:
        return True
    try:
        return bool(config.getini("timeout"))
    except ValueError:
        return False


def pytest_collection_modifyitems(config, items):
    if not config.pluginmanager.hasplugin("timeout") or _timeout_configured(config):
        return
    for item in items:
        if item.get_closest_marker("timeout") is None:
            item.add_marker(pytest.mark.timeout(DEFAULT_TIMEOUT_S))
