"""The engine's workers, one module per commit boundary, and the shared transitions."""
