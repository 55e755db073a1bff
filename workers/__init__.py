"""custody workers: one module per worker, one commit boundary each."""
