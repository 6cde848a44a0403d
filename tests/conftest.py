"""Fixtures and plugins shared by the tests."""
from thirdparty import host_sources, release_host_sources  # noqa: F401  (the real host sources, unpacked once per run)

pytest_plugins = ["bounded_tests"]
