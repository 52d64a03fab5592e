"""Structs shared across processes and layers: sampling parameters now, wire messages later."""
