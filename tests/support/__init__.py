"""What test files share: models and batches, float64 reference models of the updates,
backend cases compared bit for bit, state snapshots, and the multi-rank run harness.
tests/ is on sys.path (pyproject's pytest `pythonpath`), so every folder imports it."""
