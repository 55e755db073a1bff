"""One process's life: supervision and redo, consuming, the outbox publisher, batching, logs,
probes, metrics, fault points."""
