"""Proposers and drafter training for speculative decoding (built on the engine; see DESIGN.md)."""
