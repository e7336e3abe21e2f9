"""The common layouts of position tensors (docs/positions.md): grid(h, w) for the patches of an
image, grid(t, h, w) for a video's."""
from .runtime.positions import grid

__all__ = ["grid"]
