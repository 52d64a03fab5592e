"""Offline jobs of the CLI: ``generate``, ``init-drafter`` and ``drafter train``."""
