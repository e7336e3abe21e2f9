"""bamgen: compile positional priors (Bayesian Attention Mechanism) into fused attention kernels.

    bamgen build priors/generalized_gaussian.yaml      # writes generated/generalized_gaussian.py
    module = bamgen.load("generalized_gaussian")       # a shipped name or a file: cache and import
    optimizer = torch.optim.AdamW(bamgen.param_groups(model, weight_decay=0.1))   # priors: no decay
"""
__version__ = "0.1.0"

from .driver.cache import install_import_hook as _install_import_hook  # noqa: E402
from .errors import SpecError  # noqa: E402

__all__ = ["SpecError", "build", "load", "param_groups", "positions", "__version__"]

# Modules from bamgen.load are named bamgen._cache.<artifact>; this resolves those names in any
# process (unpickling, torch.multiprocessing), finding or rebuilding the artifact in the cache.
_install_import_hook()


def build(path, out_dir="generated", *, strategy=None, check=False):
    """Build one prior file (or shipped prior, by name) into ``out_dir``; see
    :func:`bamgen.driver.build.build_file`."""
    from .driver.build import build_file
    return build_file(path, out_dir, strategy=strategy, check=check)


def load(path, *, strategy=None, cache_dir=None):
    """Build a prior file, or a shipped prior by the name ``bamgen list`` prints, into a cache
    keyed by everything that decides its bytes, and import the module (picklable: see
    bamgen/driver/cache.py). ``cache_dir`` defaults to $BAMGEN_CACHE_DIR, else ~/.cache/bamgen."""
    from .driver.loader import load_prior
    return load_prior(path, strategy=strategy, cache_dir=cache_dir)


def param_groups(model, weight_decay=0.01, *, prior_lr=None):
    """Optimizer parameter groups that keep prior parameters out of weight decay; see
    :func:`bamgen.optim.param_groups`."""
    from .optim import param_groups as groups
    return groups(model, weight_decay, prior_lr=prior_lr)


def __getattr__(name):
    """bamgen.positions (grid(h, w), docs/positions.md), imported on first use: it needs torch,
    and the compiler does not."""
    if name == "positions":
        import importlib
        return importlib.import_module(".positions", __name__)
    raise AttributeError(f"module {__name__!r} has no attribute {name!r}")
