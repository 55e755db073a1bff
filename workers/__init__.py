"""custody workers: one package per layer (docs/architecture.md, pyproject.toml)."""
