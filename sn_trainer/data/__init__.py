"""Datasets, sources and batching; ``SeededPerSample`` makes random augmentation exact."""
from .seeded import SeededPerSample

__all__ = ["SeededPerSample"]
