pytest_plugins = ["bounded_tests"]
