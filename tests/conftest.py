"""Fixtures and plugins shared by the tests."""
# the real host sources (master; every release pair), unpacked once per run
from thirdparty import host_sources, release_host_sources  # noqa: F401

pytest_plugins = ["bounded_tests"]
