"""bamgen: compile positional priors (Bayesian Attention Mechanism) into fused attention kernels.

    bamgen build priors/generalized_gaussian.yaml      # writes generated/generalized_gaussian.py
    module = bamgen.load("priors/generalized_gaussian.yaml")   # build into a cache and import
"""
__version__ = "0.1.0"

from .errors import SpecError  # noqa: E402

__all__ = ["SpecError", "build", "load", "__version__"]


def build(path, out_dir="generated", *, strategy=None, check=False):
    """Build one prior file into ``out_dir``; see :func:`bamgen.codegen.build_file`."""
    from .codegen import build_file
    return build_file(path, out_dir, strategy=strategy, check=check)


def load(path, *, strategy=None, cache_dir=None):
    """Build a prior file into a cache keyed by its content hash and import the module."""
    from .loader import load_prior
    return load_prior(path, strategy=strategy, cache_dir=cache_dir)
