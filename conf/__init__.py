"""Hydra configuration groups, installed as ``tileinfer.conf`` (see pyproject.toml)."""
