"""What a Hugging Face family adds to a layer's attention, honoured as a prior of its own.

Some families pass their attention function more than q, k and v: a sliding window (Mistral,
Phi-3, Qwen 2/3 and Gemma 2/3's local layers: a query sees only the keys fewer than ``W``
tokens back) and a logit softcap (Gemma 2: the content score s becomes ``cap·tanh(s/cap)``).
In BAM's terms both are part of the logit: a window is a prior that is -oo beyond it, and the
softcap is a score. So the integration derives, from the user's prior file, a prior with the
window and the softcap written into it:

    log_prior: Piecewise((-oo, Abs(d) >= W), ((<the user's log_prior>), True))
    score:     <the user's score, s replaced by (cap*tanh(s/cap))>

and n, the number of keys a query may attend to (BAM-SSMax's log n), becomes Min(n, W).

It declares the same parameters, so the layer's prior module runs it with its own parameters
(``PriorAttention.forward_with``): a shared prior stays one set of parameters across local and
global layers, and save/reload is unchanged. The window is exact, so the GPU kernels skip the
key tiles beyond it (docs/priors.md, "block skipping"). docs/huggingface.md, "Sliding windows
and softcaps", has the user's side.
"""
from __future__ import annotations

import functools
import inspect
import json
import re
import tempfile
import warnings
from dataclasses import dataclass
from pathlib import Path
from types import ModuleType

import yaml


@dataclass(frozen=True)
class LayerExtras:
    """What one attention layer adds to the logit: the sliding window W (keys with |d| >= W are
    hidden; None: none) and the softcap (None: none)."""
    sliding_window: int | None = None
    softcap: float | None = None

    @property
    def plain(self) -> bool:
        return self.sliding_window is None and self.softcap is None

    def describe(self) -> str:
        parts = [f"sliding_window={self.sliding_window}"] if self.sliding_window is not None else []
        return ", ".join(parts + ([f"softcap={self.softcap}"] if self.softcap is not None else []))


def layer_extras(attention, config, with_mask_windows: bool = False):
    """The window and softcap that ``attention`` passes to its attention function, read from
    the layer as its forward reads them: its own ``sliding_window`` / ``attn_logit_softcapping``
    when it has them (Qwen 2/3, Gemma), else the config's window when its forward passes one
    (Mistral, Phi-3).

    ``with_mask_windows``: a list of the extras its calls may have, those above first, then,
    where the forward passes no window, those with the window a family may put into the mask
    alone (the layer's own ``sliding_window``, as Qwen2-MoE's, or the config's, as PhiMoE's);
    the mask tells each call which holds (``PaddingLayout.window``)."""
    source = forward_source(type(attention))
    softcap = getattr(attention, "attn_logit_softcapping", None) if "softcap" in source else None
    softcap = None if softcap is None else float(softcap)
    if "sliding_window" not in source:
        window = None
    elif hasattr(attention, "sliding_window"):
        window = attention.sliding_window
    else:
        window = getattr(config, "sliding_window", None)
    extras = LayerExtras(_window(window), softcap)
    if not with_mask_windows:
        return extras
    if "sliding_window" in source:
        return [extras]
    candidates = (getattr(attention, "sliding_window", None), getattr(config, "sliding_window", None))
    windows = [w for w in candidates if isinstance(w, int) and not isinstance(w, bool) and w > 0]
    return [extras] + [LayerExtras(w, softcap) for w in dict.fromkeys(windows)]


def call_extras(sliding_window, softcap) -> LayerExtras:
    """The extras of one attention call (HF's keyword arguments)."""
    return LayerExtras(_window(sliding_window), None if softcap is None else float(softcap))


def _window(value) -> int | None:
    if value is None:
        return None
    if isinstance(value, bool) or int(value) != value or value < 1:
        raise ValueError(f"sliding_window: expected a positive number of tokens, got {value!r}")
    return int(value)


@functools.lru_cache(maxsize=None)
def forward_source(cls: type) -> str:
    """The source of the forward a class defines itself ("" when it defines none or its source
    cannot be read): how the integration learns what a layer passes to attention."""
    forward = cls.__dict__.get("forward")
    try:
        return inspect.getsource(forward) if forward is not None else ""
    except (OSError, TypeError):
        return ""


@dataclass(frozen=True)
class PriorSource:
    """A generated module's prior file: its text and file name, and the shipped prior's name
    when it is one (unchanged)."""
    text: str
    file_name: str
    shipped: str | None = None


def prior_source(module: ModuleType) -> PriorSource | None:
    """The prior file of a generated module: a shipped prior's file, or the source that
    bamgen.load recorded beside the build; None for a module built elsewhere."""
    import hashlib
    from ..resources import shipped_prior
    info = module.PRIOR
    shipped = shipped_prior(info["name"])
    if shipped is not None:
        data = shipped.read_bytes()
        if hashlib.sha256(data).hexdigest() == info["source_hash"]:
            return PriorSource(data.decode("utf-8"), shipped.name, info["name"])
    manifest = Path(getattr(module, "__file__", "") or ".").parent / "build.json"
    if manifest.is_file():
        built = json.loads(manifest.read_text(encoding="utf-8"))
        return PriorSource(built["source"], built["source_name"])
    return None


def derived_source(text: str, extras: LayerExtras) -> str:
    """The prior file that adds ``extras`` to the prior file ``text`` (same parameters)."""
    spec = yaml.safe_load(text)
    if extras.sliding_window is not None:
        w = extras.sliding_window
        # n, the keys a query may attend to, is at most the window's W
        for field in ("log_prior", "density", "score"):
            if field in spec:
                spec[field] = _replace_name(str(spec[field]), "n", f"Min(n, {w})")
        if isinstance(spec.get("let"), dict):
            spec["let"] = {name: _replace_name(str(expr), "n", f"Min(n, {w})")
                           for name, expr in spec["let"].items()}
        if "log_prior" in spec:
            spec["log_prior"] = f"Piecewise((-oo, Abs(d) >= {w}), (({spec['log_prior']}), True))"
        else:
            spec["density"] = f"Piecewise((0, Abs(d) >= {w}), (({spec['density']}), True))"
    if extras.softcap is not None:
        cap = repr(extras.softcap)
        spec["score"] = _replace_name(str(spec.get("score", "s + log_prior")), "s",
                                      f"({cap}*tanh(s/{cap}))")
    spec["name"] = _variant_name(str(spec["name"]), extras)
    spec["description"] = f"{spec.get('description') or spec['name']} ({extras.describe()})"
    return yaml.safe_dump(spec, sort_keys=False, allow_unicode=True)


def _replace_name(formula: str, name: str, replacement: str) -> str:
    """``formula`` with every use of the symbol ``name`` replaced (the content score s, the key
    count n); names that contain the letter (``ssmax``, ``sinh``, ``n0``) are other names."""
    return re.sub(rf"(?<![\w.]){re.escape(name)}(?!\w)", replacement, formula)


def _variant_name(name: str, extras: LayerExtras) -> str:
    if extras.sliding_window is not None:
        name += f"_window{extras.sliding_window}"
    if extras.softcap is not None:
        name += "_softcap" + re.sub(r"\W", "_", format(extras.softcap, "g"))
    return name


def variant_module(module: ModuleType, extras: LayerExtras, family: str) -> ModuleType:
    """The generated module of ``module``'s prior with ``extras`` (built once, then cached like
    any bamgen.load), or a ValueError naming the family and the feature when it cannot be."""
    what = f"model type {family!r}: its attention's {extras.describe()}"
    found = prior_source(module)
    if found is None:
        raise ValueError(f"{what} is honoured by a prior derived from the prior file, but the "
                         f"module {module.__name__} carries no prior file; pass the prior's file "
                         f"or a shipped prior's name to apply_prior")
    return _build(derived_source(found.text, extras), Path(found.file_name or "prior").stem)


@functools.lru_cache(maxsize=None)
def _build(source: str, stem: str) -> ModuleType:
    """bamgen.load of a derived prior file; its strategy is the cost model's (a window changes
    what pays: the kernels skip the key tiles beyond it)."""
    import bamgen
    from ..errors import PriorWarning
    with tempfile.TemporaryDirectory() as folder:
        path = Path(folder) / f"{stem}.yaml"
        path.write_text(source, encoding="utf-8")
        with warnings.catch_warnings():   # (the user's prior has said its warnings: this copy
            warnings.simplefilter("ignore", PriorWarning)   # names a file they never wrote)
            return bamgen.load(path)
