"""Integrations with training frameworks (imported on demand: they need extra packages)."""
