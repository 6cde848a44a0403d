"""The tooling that measures and explains the core: cost model, CLI, runners; the core never imports it."""
