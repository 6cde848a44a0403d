"""Fixtures and plugins shared by the tests."""
from thirdparty import host_sources  # noqa: F401  (session fixture: the real host sources)

pytest_plugins = ["bounded_tests"]
