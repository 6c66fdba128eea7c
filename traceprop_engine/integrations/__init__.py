"""Integrations with other training frameworks (each imports its framework lazily)."""
