"""A bamgen prior inside a Hugging Face transformers model (any family whose attention
dispatches through ALL_ATTENTION_FUNCTIONS: docs/huggingface.md has the table).

    from bamgen.integrations.transformers import apply_prior, from_pretrained
    model = apply_prior(model, "generalized_gaussian", rope="remove")
    model.save_pretrained(path); model = from_pretrained(path)

What :func:`apply_prior` changes in the model, and why each piece is needed:

- Every attention layer gets its own prior module (the generated ``nn.Module`` with the
  model's number of query heads) as the submodule ``bamgen_prior``: its parameters are in
  ``model.parameters()``, the state dict and ``bamgen.param_groups``.
- The model's attention implementation becomes ``"bamgen"``, registered with HF's
  ``AttentionInterface`` (the attention call: the layer's q, with k and v as the cache holds
  them, GQA heads kept) *and* ``AttentionMaskInterface``. Without a mask function of its own, HF
  hands a custom attention ``attention_mask=None`` and padding is silently ignored; bamgen's
  (bamgen/integrations/hf_layout.py) turns the token mask and the cache's sizes into
  ``key_mask`` and per-row offsets, right for dynamic and static caches.
- A forward pre-hook refuses a forward once another attention implementation is set
  (``set_attn_implementation("sdpa")`` after apply_prior): the layers would run without
  their priors, silently.
- ``rope="remove"`` replaces the rotary embedding with the identity (the prior is then the
  only positional encoding); ``"keep"`` leaves it.
- A forward pre-hook on the model (and on each transformers model inside it) hands a packed
  row's documents to the model in both of the forms attention reads, restarting
  ``position_ids`` and ``cu_seq_lens_q/k``: some families drop one of the collator's markers
  before attention, or number absolute positions across the whole row
  (bamgen/integrations/hf_layout.py, :func:`install_document_markers`).
- A forward pre-hook on the same models marks the masks a call is handed ready-made (by a
  multimodal model around): under torch.compile, every mask of a call (one per layer type) with
  an or-rule that one of them shows (the rule of Gemma 3's image tokens is read from the masks'
  form there, which its sliding layers' window hides), and causal where a compiled call's form does
  not tell (PaliGemma's, whose layers say bidirectional)
  (bamgen/integrations/hf_layout.py, :func:`mark_handed_masks`).
- A causal call whose mask lets blocks of queries see both ways (Gemma 3's and Gemma 4's
  images, PaliGemma's prefix) runs as one call per run of queries, eager
  (bamgen/integrations/hf_blocks.py).
- ``config.bamgen`` records the prior (a shipped name, or the prior file's text) and ``rope``;
  :func:`from_pretrained` reads it, rebuilds the model with the prior in place before the
  weights load (so the learned prior parameters load like any weight) and keeps ``"bamgen"``.
"""
from __future__ import annotations

import importlib
import inspect
import os
import re
import sys
import tempfile
from pathlib import Path
from types import ModuleType

import torch

from .hf_blocks import attend_by_runs
from .hf_layout import (PaddingLayout, install_document_markers, install_mask_marking,
                        install_read_scope, packed_documents, padding_layout,
                        transformers_models)
from .hf_variants import (LayerExtras, call_extras, forward_source, layer_extras, prior_source,
                          variant_module)

ATTN_IMPLEMENTATION = "bamgen"
PRIOR_ATTR = "bamgen_prior"
CONFIG_KEY = "bamgen"
ROPE_CHOICES = ("remove", "keep")


def apply_prior(model, prior, rope: str = "remove", shared: bool = False, **init):
    """Give every attention layer of ``model`` its own ``prior`` (a shipped prior's name, a
    prior file, or a generated module), or with ``shared=True`` one prior that every layer
    uses (as the BAM authors train), and route attention through it; ``init`` sets the prior
    parameters' initial values (as the generated module's ``init=``). Returns ``model``,
    changed in place."""
    if rope not in ROPE_CHOICES:
        raise ValueError(f"rope: expected one of {', '.join(map(repr, ROPE_CHOICES))}, got "
                         f"{rope!r} ('remove': the prior is the only positional encoding)")
    _check_model(model, rope)
    if not isinstance(shared, bool):
        raise ValueError(f"shared: expected True (one prior for every layer) or False (one per "
                         f"layer), got {shared!r}")
    module = resolve_prior(prior)
    _install(model, module, rope, init or None, shared)
    model.config.bamgen = {**prior_record(module), "rope": rope, "shared": shared}
    return model


def from_pretrained(path, **kwargs):
    """Load a model saved (``save_pretrained``) after :func:`apply_prior`: the prior recorded
    in its config comes back with its learned values, and attention stays bamgen's. ``kwargs``
    go to the model class's ``from_pretrained`` (``torch_dtype``, ``device_map``, ...)."""
    from transformers import AutoConfig
    register()
    config = AutoConfig.from_pretrained(path, **_config_kwargs(kwargs))
    record = getattr(config, CONFIG_KEY, None)
    part = None if isinstance(record, dict) else _part_with_prior(config)
    if part is not None:   # a multimodal model whose language model took the prior
        record = getattr(getattr(config, part), CONFIG_KEY)
    if not isinstance(record, dict):
        raise ValueError(f"{path}: its config has no '{CONFIG_KEY}' entry; it was not saved "
                         f"from a model with a prior (use apply_prior, then save_pretrained)")
    cls = _with_prior(_model_class(config), record, part)
    if part is None:   # (a composite's other parts keep their own attention)
        kwargs.setdefault("attn_implementation", ATTN_IMPLEMENTATION)
    return cls.from_pretrained(path, **kwargs)


def _part_with_prior(config) -> str | None:
    """The sub-config (text_config, ...) of a composite model's config that records a prior:
    apply_prior was given the language model inside (docs/huggingface.md)."""
    for name in getattr(config, "sub_configs", None) or {}:
        if isinstance(getattr(getattr(config, name, None), CONFIG_KEY, None), dict):
            return name
    return None


def resolve_prior(prior) -> ModuleType:
    """A generated module from a shipped name, a prior file, or a module itself."""
    if isinstance(prior, ModuleType):
        if not isinstance(getattr(prior, "PRIOR", None), dict):
            raise ValueError(f"prior: module {prior.__name__} is not a bamgen generated module "
                             f"(it has no PRIOR); pass a prior name, a prior file or bamgen.load(...)")
        return prior
    if isinstance(prior, (str, os.PathLike)):
        import bamgen
        return bamgen.load(prior)
    raise ValueError(f"prior: expected a shipped prior's name, a prior file's path or a generated "
                     f"module, got {type(prior).__name__}")


def _check_positions(module: ModuleType) -> None:
    """A prior over several position channels (``positions: C``) reads its positions from
    tensors only (pos_q, pos_k), which a transformers model never passes to its attention:
    every forward would fail, so it is refused here (docs/huggingface.md, "Reference")."""
    channels = getattr(module.TRAITS, "channels", 1)
    if channels > 1:
        raise ValueError(f"prior: {module.PRIOR['name']!r} reads {channels} position channels "
                         f"(positions: {channels}), given only as pos_q and pos_k tensors, which "
                         f"a Hugging Face model does not pass to its attention; use a prior of "
                         f"token positions (one channel: d, i, j), or call the prior module "
                         f"yourself with pos_q and pos_k")


def prior_record(module: ModuleType) -> dict:
    """How config.bamgen names ``module`` so that another process can load it again: a
    shipped prior by name, else the prior file's text (from bamgen.load's cache), else the
    module's import name (a module built into the user's own package)."""
    record = {"strategy": module.PRIOR["strategy"]}
    found = prior_source(module)
    if found is not None and found.shipped is not None:
        return {"prior": found.shipped, **record}
    if found is not None:
        return {"prior_source": found.text, "prior_source_name": found.file_name, **record}
    return {"prior_module": module.__name__, **record}


def load_record(record: dict) -> ModuleType:
    """The generated module that ``record`` (config.bamgen) names."""
    import bamgen
    strategy = record.get("strategy")
    if "prior" in record:
        return _shipped_module(record["prior"], strategy) or bamgen.load(record["prior"],
                                                                          strategy=strategy)
    if "prior_source" in record:
        with tempfile.TemporaryDirectory() as folder:
            name = Path(record.get("prior_source_name") or "prior.yaml").name
            path = Path(folder) / name
            path.write_text(record["prior_source"], encoding="utf-8")
            return bamgen.load(path, strategy=strategy)
    if "prior_module" in record:
        return importlib.import_module(record["prior_module"])
    raise ValueError(f"config.{CONFIG_KEY}: names no prior (expected 'prior', 'prior_source' or "
                     f"'prior_module'), got keys {sorted(record)}")


def _shipped_module(name: str, strategy: str | None) -> ModuleType | None:
    """The installed build of shipped prior ``name`` (bamgen.generated), if it was built with
    ``strategy``: no build needed."""
    from ..resources import GENERATED_PACKAGE, shipped_prior
    if shipped_prior(name) is None:
        return None
    try:
        module = importlib.import_module(f"{GENERATED_PACKAGE}.{name}")
    except ImportError:
        return None
    return module if strategy in (None, module.PRIOR["strategy"]) else None


def register() -> None:
    """Register bamgen's attention and mask functions with transformers (idempotent)."""
    from transformers import AttentionInterface
    from transformers.masking_utils import AttentionMaskInterface
    AttentionInterface.register(ATTN_IMPLEMENTATION, bamgen_attention)
    AttentionMaskInterface.register(ATTN_IMPLEMENTATION, padding_layout)


def bamgen_attention(module, query, key, value, attention_mask, dropout=0.0, scaling=None,
                     sliding_window=None, softcap=None, **kwargs):
    """HF's attention call, through the layer's prior: q [B, Hq, Nq, D], k/v [B, Hk, Nk, D]
    (the cache's slots); returns ([B, Nq, Hq, D], None) as HF's attention functions do. A
    sliding window or softcap runs as the prior derived with it (bamgen/integrations/hf_variants.py)."""
    prior = getattr(module, PRIOR_ATTR, None)
    if prior is None:
        raise ValueError(f"attn_implementation={ATTN_IMPLEMENTATION!r} needs the layer's prior: "
                         f"call bamgen.integrations.transformers.apply_prior(model, prior)")
    layout = attention_mask
    if not isinstance(layout, PaddingLayout):
        raise ValueError(
            f"attention_mask: bamgen's attention takes the layout its mask function builds from "
            f"the 2-D token mask, got {type(layout).__name__}"
            f"{' of shape ' + str(tuple(layout.shape)) if hasattr(layout, 'shape') else ''}; "
            f"pass a 2-D attention_mask (or none), not a prepared 4-D mask")
    if dropout:
        raise ValueError(_dropout_message(module, dropout))
    for name, what in _UNHONOURED.items():
        if kwargs.get(name) is not None:
            raise ValueError(f"model type {_family(module)!r}: its attention passes {name} "
                             f"({what}), which bamgen's attention does not model; use a family "
                             f"whose attention passes none")
    causal = _direction(module, layout, kwargs.get("is_causal"))
    if not causal and prior._bamgen_prior.traits.causal_only:
        raise ValueError(f"model type {_family(module)!r}: its attention here is bidirectional "
                         f"(the layer's is_causal, or the call's is_causal=False), and the prior "
                         f"{prior._bamgen_prior.traits.name!r} is causal only (causal_only: true, "
                         f"defined for keys at or before their query); use a causal decoder, "
                         f"without is_causal=False, or a prior defined both ways")
    if layout.window_inclusive:
        # HF's bidirectional window shows the keys W away (|q - k| <= W), as its eager
        # attention applies it: bamgen's hides |d| >= W + 1 (the attention's own window is
        # W for Mistral, W + 1 for ModernBERT's, which counts it so itself)
        sliding_window = layout.window + 1
    elif sliding_window is None and layout.window is not None:
        # the family put its window into the mask alone (Qwen2-MoE, PhiMoE): honoured alike
        if not causal:
            raise ValueError(f"model type {_family(module)!r}: its mask has a sliding window "
                             f"({layout.window}) that its attention does not pass, in "
                             f"bidirectional attention, which bamgen does not model")
        sliding_window = layout.window
    packed = packed_documents(layout, query, key, kwargs) or (None, None)
    call = dict(causal=causal, scale=scaling,
                q_offset=layout.q_offset, k_offset=layout.k_offset, key_mask=layout.key_mask,
                cu_seqlens_q=packed[0], cu_seqlens_k=packed[1])
    extras = call_extras(sliding_window, softcap)
    query, key, value, width = _same_head_dim(query, key, value, call)

    def attend(extras: LayerExtras, query, key, value, **call):
        if extras.plain:
            return prior(query, key, value, **call)
        return prior.forward_with(_variant(module, prior, extras), query, key, value, **call)
    if causal and layout.both_ways:   # blocks of queries that see both ways (images, a prefix)
        if layout.seen is None or packed[0] is not None:
            raise ValueError(_both_ways_message(module))
        out = attend_by_runs(attend, extras, query, key, value, call, layout.seen)
    else:
        out = attend(extras, query, key, value, **call)
    return out[..., :width].transpose(1, 2).contiguous(), None


def _both_ways_message(module) -> str:
    """Why a causal call whose mask lets some queries see keys after them is refused, naming
    where the rule comes from: the config's ``use_bidirectional_attention`` where the layers
    stay causal (Step3p7's: its mask says both ways; an eager call reads the rule and runs both
    ways, a compiled one cannot), else the inputs (Gemma 3's and PaliGemma's images)."""
    family = _family(module)
    bidirectional = getattr(getattr(module, "config", None), "use_bidirectional_attention", False)
    # (True, not Gemma 4's "vision", whose rule comes from the inputs; PaliGemma's layers say
    # is_causal=False)
    if bidirectional is True and getattr(module, "is_causal", True):
        return (f"model type {family!r}: its config's use_bidirectional_attention=True ORs into "
                f"the causal mask a rule that lets queries see keys after them, which bamgen "
                f"runs both ways only where it can evaluate the rule, on eager calls; under "
                f"torch.compile (dynamo reads no mask function's rules) it cannot, so call the "
                f"model uncompiled, or build it with use_bidirectional_attention=False (causal)")
    return (f"model type {family!r}: its mask lets some queries see keys after them (a rule "
            f"OR-ed into the causal mask: Gemma 3's and Gemma 4's image tokens attend both ways "
            f"within an image, PaliGemma's prefix), which bamgen runs block by block on eager "
            f"calls alone, where each query's keys are one range and no documents are packed; "
            f"under torch.compile it cannot evaluate the rule over the tokens: call the model "
            f"uncompiled, or use inputs without that rule (text alone; compiled, text without "
            f"token_type_ids, mm_token_type_ids or pixel_values)")


def _direction(module, layout: PaddingLayout, call_is_causal) -> bool:
    """Whether the call is causal: the call's is_causal (HF passes config.is_causal, or the model
    call's own is_causal=, to every layer: a decoder made bidirectional, its mask built
    bidirectional alike), else the direction of the mask HF built for the call, as HF's eager
    attention applies it, where its form tells one, else the layer's. A layer that says
    bidirectional runs causal where HF built the call's mask causal (PaliGemma's Gemma layers:
    ``use_bidirectional_attention``, the causal rule in the mask alone), so that a rule OR-ed
    into that mask (PaliGemma's prefix, Gemma 3's images) runs by blocks alike; a layer that says
    causal runs both ways where a rule OR-ed into its causal mask makes it the same both ways
    (Step3p7's ``use_bidirectional_attention``: its layers keep is_causal=True)."""
    if call_is_causal is not None:
        return bool(call_is_causal)
    if layout.causal_rule is not None:
        return layout.causal_rule
    return bool(getattr(module, "is_causal", True))


def _same_head_dim(query, key, value, call: dict):
    """q, k, v with one head dim, as bamgen's attention takes them, and v's own width: a family
    whose values are narrower or wider than its queries and keys (multi-head latent attention:
    DeepSeek-V2/V3, Kimi, MiniCPM3...) has its values, or its queries and keys, padded with
    zeros (q.k and the output's first columns unchanged; the scale is fixed first), as HF pads
    them for FlashAttention."""
    width, qk = value.shape[-1], key.shape[-1]
    pad = torch.nn.functional.pad
    if width < qk:
        value = pad(value, (0, qk - width))
    elif width > qk:
        if call["scale"] is None:
            call["scale"] = qk ** -0.5
        query, key = pad(query, (0, width - qk)), pad(key, (0, width - qk))
    return query, key, value, width


# What some families add to the logit that the prior does not model: refused by apply_prior
# (_check_model), and here again should a call pass it anyway.
_UNHONOURED = {"s_aux": "attention sinks: a learned per-head logit in every softmax",
               "position_bias": "a relative position bias added to the logits"}


def _family(module) -> str:
    return getattr(getattr(module, "config", None), "model_type", None) or type(module).__name__


def _dropout_message(module, dropout: float) -> str:
    """Which setting gives the layer its attention dropout, as the family names it: the layer
    reads an attribute copied from the config when it was built (GPT-2's attn_dropout.p from
    attn_pdrop, BioGPT's dropout from attention_probs_dropout_prob, Llama's attention_dropout),
    so the config field whose value it is, among those of attention dropout."""
    config = getattr(module, "config", None)
    fields = config.to_dict() if hasattr(config, "to_dict") else {}
    names = [name for name, value in fields.items()
             if "drop" in name and "att" in name and isinstance(value, (int, float))
             and not isinstance(value, bool) and float(value) == float(dropout)]
    setting = (" or ".join(f"config.{name}" for name in names) if names
               else "the attention dropout probability of its config")
    example = f" (from_pretrained(..., {names[0]}=0.0))" if names else ""
    return (f"model type {_family(module)!r}: attention dropout {dropout} (from {setting}) is "
            f"not supported, bamgen's attention has no dropout; build the model with "
            f"{setting} = 0.0{example}: its layers read it when they are built")


# (the layer prior's class, the extras) -> the derived prior (bamgen.runtime Prior), filled by
# apply_prior for every layer's extras, so that a compiled forward only reads it
_VARIANTS: dict[tuple[type, LayerExtras], object] = {}


def _variant(attention, prior, extras: LayerExtras):
    """The derived prior that runs ``prior`` with ``extras``: built by apply_prior, or here on
    an eager call whose extras the layer did not show at install time."""
    key = (type(prior), extras)
    found = _VARIANTS.get(key)
    if found is None:
        if torch.compiler.is_compiling():
            raise ValueError(f"{extras.describe()}: this layer did not show it to apply_prior, "
                             f"so its prior is not built; run the model once before compiling")
        family = getattr(getattr(attention, "config", None), "model_type", type(attention).__name__)
        found = _prepare_variant(type(prior), extras, family)
    return found


def _prepare_variant(cls: type, extras: LayerExtras, family: str):
    """Build (once) and record the derived prior of the prior class ``cls`` with ``extras``."""
    key = (cls, extras)
    if key not in _VARIANTS:
        derived = variant_module(sys.modules[cls.__module__], extras, family)
        _VARIANTS[key] = getattr(derived, derived.PRIOR["class_name"])._bamgen_prior
    return _VARIANTS[key]


class IdentityRotary(torch.nn.Module):
    """Stands in for a model's rotary embedding under ``rope="remove"``: cos = 1 and sin = 0,
    so HF's ``apply_rotary_pos_emb`` leaves q and k as they are; or, for a family whose
    rotary embedding gives complex ``freqs_cis`` (Llama 4, DeepSeek-V2: ``torch.polar``), the
    complex 1 over its ``head_dim / 2`` pairs of channels, which q and k are multiplied by.

    ``widths``: a family whose rotary embedding serves each layer type over its own width
    (Gemma 4: sliding layers of ``head_dim``, global ones of ``global_head_dim``, the layer
    type its forward's third argument) gets each type's width; any other call, ``head_dim``."""

    def __init__(self, head_dim: int, complex_: bool = False, widths: dict | None = None):
        super().__init__()
        self.head_dim = head_dim
        self.complex_ = complex_
        self.widths = dict(widths or {})

    def forward(self, x, position_ids, *args, **kwargs):   # (Gemma 3 adds the layer type)
        layer_type = args[0] if args else kwargs.get("layer_type")
        width = getattr(self, "widths", {}).get(layer_type, self.head_dim)
        # [batch, tokens]: multimodal RoPE's position_ids carry a leading axis of sections
        # ([3, batch, tokens], Qwen2-VL's), which its cos and sin do not
        tokens = position_ids.shape[-2:]
        if self.complex_:
            return torch.ones((*tokens, width // 2), dtype=torch.complex64, device=x.device)
        shape = (*tokens, width)
        ones = torch.ones(shape, dtype=x.dtype, device=x.device)
        return ones, torch.zeros_like(ones)

    def extra_repr(self):
        widths = getattr(self, "widths", {})
        return (f"head_dim={self.head_dim}" + (f", widths={widths}" if widths else "")
                + (", complex" if self.complex_ else ""))


def _both_ways_windows(config, every: list[LayerExtras]) -> list[LayerExtras]:
    """For a model made bidirectional by its config (``is_causal=False``: HF then builds its
    sliding masks with its bidirectional overlay, |q - k| <= W), the extras of its windows one
    wider, which its calls run (``PaddingLayout.window_inclusive``): built with the others, so
    that a compiled call finds them."""
    if getattr(config, "is_causal", True):
        return []
    return [LayerExtras(extras.sliding_window + 1, extras.softcap)
            for extras in every if extras.sliding_window is not None]


def _install(model, module: ModuleType, rope: str, init: dict | None, shared: bool = False) -> None:
    """Attach a prior to every attention layer (shared: one prior, a submodule of the base
    model, that every layer reads), remove RoPE if asked, switch attention."""
    _check_positions(module)   # (apply_prior's and from_pretrained's way in alike)
    register()
    config = model.config
    cls = getattr(module, module.PRIOR["class_name"])
    layers = _attention_layers(model)
    family = getattr(config, "model_type", type(model).__name__)
    every = [extras for attention in layers for extras in layer_extras(attention, config, True)]
    for extras in dict.fromkeys(every + _both_ways_windows(config, every)):
        if not extras.plain:   # before any change to the model: a refusal leaves it as it was
            _prepare_variant(cls, extras, family)

    _remove_priors(model, layers)

    def build(attention):
        # Built on a real device even inside HF's meta-device loading context (the module checks
        # its initial values); HF then loads the checkpoint's values into it.
        weight = next(attention.parameters())
        device = torch.device("cpu") if weight.device.type == "meta" else weight.device
        with device:
            return cls(config.num_attention_heads, init=init, device=device)
    if shared:
        # One set of parameters, registered once (state dict key "<base>.bamgen_prior.*", so
        # save_pretrained sees no shared tensors); each layer holds a plain reference to it,
        # not a submodule, and autograd sums the layers' gradients into it.
        prior = build(layers[0])
        setattr(getattr(model, model.base_model_prefix, model), PRIOR_ATTR, prior)
        for attention in layers:
            attention.__dict__[PRIOR_ATTR] = prior
    else:
        for attention in layers:
            setattr(attention, PRIOR_ATTR, build(attention))
    if rope == "remove":
        _remove_rotary(model)
    model.set_attn_implementation(ATTN_IMPLEMENTATION)
    install_document_markers(model)
    install_mask_marking(model)
    install_read_scope(model)
    _install_implementation_check(model)


def _remove_priors(model, layers) -> None:
    """apply_prior again replaces the prior: the earlier one goes whichever way it was held (one
    per layer, or shared: a submodule of the base model that each layer references), or its
    parameters would stay in parameters(), the optimizer and the state dict, never used."""
    base = getattr(model, model.base_model_prefix, model)
    for holder in (base, *layers):
        holder._modules.pop(PRIOR_ATTR, None)
        holder.__dict__.pop(PRIOR_ATTR, None)


def _install_implementation_check(model) -> None:
    """Register (once) :func:`_runs_its_priors` on ``model`` and on every transformers model
    inside it, each of which a user may call directly (``model.model(ids)`` for hidden
    states)."""
    for module in transformers_models(model):
        if _runs_its_priors not in module._forward_pre_hooks.values():
            module.register_forward_pre_hook(_runs_its_priors, with_kwargs=True)


def _runs_its_priors(model, args, kwargs) -> None:
    """A forward pre-hook (apply_prior's) that refuses, by name, a call that would run otherwise
    than the priors say, silently:
    - the layers' priors run only through the "bamgen" attention implementation, so a model
      switched to another one after apply_prior (``set_attn_implementation("sdpa")``) would
      run without them: with RoPE removed, with no positional encoding at all;
    - bamgen's kernels never hold a row's attention weights whole, so output_attentions=True
      (the call's, or the config's) would return none (an empty tuple)."""
    if kwargs.get("output_attentions", getattr(model.config, "output_attentions", False)):
        raise ValueError("output_attentions=True: bamgen's attention does not form the attention "
                         "weights (its kernels never hold them whole), so it cannot return "
                         "them; call without output_attentions (and with "
                         "config.output_attentions = False)")
    implementation = getattr(model.config, "_attn_implementation", None)
    if implementation != ATTN_IMPLEMENTATION:
        raise ValueError(f"attn_implementation: this model's attention layers hold bamgen priors "
                         f"(apply_prior), which only attn_implementation="
                         f"{ATTN_IMPLEMENTATION!r} runs, but it is now {implementation!r} (set "
                         f"after apply_prior); call model.set_attn_implementation("
                         f"{ATTN_IMPLEMENTATION!r}) to run them, or compare against a copy of "
                         f"the model made before apply_prior")


def _attention_layers(model) -> list[torch.nn.Module]:
    """The model's attention modules: those whose forward dispatches through transformers'
    ALL_ATTENTION_FUNCTIONS (read from their class's source, not from a list of model types)."""
    return [m for m in model.modules() if _dispatches_attention(type(m))]


def _dispatches_attention(cls: type) -> bool:
    return cls.__module__.startswith("transformers.") and "ALL_ATTENTION_FUNCTIONS" in forward_source(cls)


def _rotary_modules(model) -> list[tuple[torch.nn.Module, str, dict]]:
    """(parent, attribute, rotary widths) of each rotary embedding: a module with an
    ``inv_freq`` buffer (or one per layer type, ``<type>_inv_freq``, as Gemma 3's and Gemma
    4's) whose forward(x, position_ids, ...) gives (cos, sin) over 2 * len(inv_freq) channels;
    the widths by layer type (None: the plain ``inv_freq``)."""
    found = []
    for parent in model.modules():
        for name, child in parent.named_children():
            widths = {_rotary_layer_type(key): 2 * buffer.shape[-1]
                      for key, buffer in child.named_buffers(recurse=False)
                      if key == "inv_freq" or key.endswith("_inv_freq")}
            if widths:
                found.append((parent, name, widths))
    return found


def _rotary_layer_type(buffer_name: str) -> str | None:
    """The layer type an ``inv_freq`` buffer serves: ``sliding_attention_inv_freq`` (and its
    ``sliding_attention_original_inv_freq`` copy) serve ``sliding_attention``; ``inv_freq``,
    None."""
    name = buffer_name.removesuffix("inv_freq").removesuffix("_")
    return name.removesuffix("original").removesuffix("_") or None


def _remove_rotary(model) -> None:
    """Every rotary embedding becomes the identity over its own width (partial rotary, as
    GPT-NeoX's and Phi-3's, included), each layer type's over its own (Gemma 4's)."""
    for parent, name, widths in _rotary_modules(model):
        complex_ = "torch.polar" in forward_source(type(getattr(parent, name)))
        setattr(parent, name, IdentityRotary(max(widths.values()), complex_, widths))


def _check_model(model, rope: str) -> None:
    """A transformers model whose attention bamgen can take over, or a ValueError naming the
    family and the feature that stops it."""
    config = getattr(model, "config", None)
    if config is None or not hasattr(model, "set_attn_implementation"):
        raise ValueError(f"model: expected a Hugging Face transformers model, got "
                         f"{type(model).__name__}")
    family = getattr(config, "model_type", type(model).__name__)
    if _head_count(config, family) is None:
        raise ValueError(_composite_message(model, family))
    layers = _attention_layers(model)
    if not layers:
        raise ValueError(f"model type {family!r}: no attention layer dispatches through "
                         f"transformers' ALL_ATTENTION_FUNCTIONS (its attention is its own "
                         f"code), so bamgen cannot replace it; use a family whose attention "
                         f"does (Llama, Mistral, Qwen2, Gemma, Phi-3, GPT-NeoX, GPT-2, ...: "
                         f"the table in docs/huggingface.md)")
    if getattr(config, "is_encoder_decoder", False) or getattr(config, "add_cross_attention", False):
        raise ValueError(f"model type {family!r}: encoder-decoder models (and decoders with "
                         f"cross-attention) are not supported: bamgen's attention takes a "
                         f"decoder's self-attention, not cross-attention to an encoder's tokens "
                         f"(and their padding) nor an encoder's relative position bias (T5's); "
                         f"use a decoder-only model")
    for attention in layers:
        source = forward_source(type(attention))
        if re.search(r"\battention_mask\[", _class_source(type(attention))):
            raise ValueError(f"model type {family!r}: its attention reads the mask tensor itself "
                             f"({type(attention).__name__} indexes attention_mask: a sparse-"
                             f"attention indexer, as DeepSeek-V3.2's and GLM-MoE-DSA's, or a "
                             f"dynamic mask, as Doge's, picks the keys each query sees), which "
                             f"bamgen's attention replaces by its padding layout and does not "
                             f"model; use a family with dense attention")
        if "s_aux" in source and getattr(attention, "sinks", True) is not None:
            raise ValueError(f"model type {family!r}: its attention has sinks (s_aux: a "
                             f"learned per-head logit in every softmax), which the prior does "
                             f"not model (its outputs would change); bamgen cannot take over "
                             f"this family's attention: use a model without attention sinks")
    if "chunked_attention" in (getattr(config, "layer_types", None) or ()):
        raise ValueError(f"model type {family!r}: chunked attention (layer_types "
                         f"'chunked_attention', attention_chunk_size="
                         f"{getattr(config, 'attention_chunk_size', None)}: a query sees only the "
                         f"keys of its own chunk) lives in the mask alone, which bamgen's attention "
                         f"does not model; build the model with every layer type "
                         f"'full_attention' (layer_types=['full_attention'] * num_hidden_layers)")
    removed = any(isinstance(m, IdentityRotary) for m in model.modules())
    if rope == "keep" and removed:
        raise ValueError(f"model type {family!r}: rope='keep', but an earlier apply_prior removed "
                         f"this model's rotary embedding (rope='remove'), so there is none to "
                         f"keep: pass rope='remove' to replace its prior, or start from the model "
                         f"as it was built to add a prior to RoPE")
    if rope == "remove" and not _rotary_modules(model) and not removed:
        raise ValueError(f"model type {family!r}: rope='remove' found no rotary embedding (a "
                         f"module with an inv_freq buffer) to remove; its positions come from "
                         f"elsewhere (absolute embeddings?): pass rope='keep' to add the prior "
                         f"to them")


def _head_count(config, family: str) -> int | None:
    """config.num_attention_heads, over which every layer's prior is built, or a ValueError
    where the config sets it per layer (transformers' heterogeneous configs, as Step3p7's
    ``num_sliding_attention_heads``: reading it raises transformers' own error)."""
    try:
        return getattr(config, "num_attention_heads", None)
    except RuntimeError as error:   # (AmbiguousGlobalPerLayerAttributeError)
        if type(error).__name__ != "AmbiguousGlobalPerLayerAttributeError":
            raise
    fields = config.to_dict()
    sliding = fields.get("num_sliding_attention_heads")
    source = f" from num_sliding_attention_heads={sliding}" if sliding is not None else ""
    fix = (f"num_sliding_attention_heads={fields.get('num_attention_heads')} (or unset)"
           if sliding is not None else "one head count for every layer")
    raise ValueError(f"model type {family!r}: its config sets num_attention_heads per layer "
                     f"(per_layer_config {fields.get('per_layer_config')}{source}), and bamgen "
                     f"builds every layer's prior over one number of query heads, the config's "
                     f"num_attention_heads; build the model with {fix}")


def _class_source(cls: type) -> str:
    """The source of a class's own methods ("" where it cannot be read): a layer's helpers (Doge's
    prepare_dynamic_mask) read what its forward hands them."""
    try:
        return inspect.getsource(cls)
    except (OSError, TypeError):
        return ""


def _model_of(model, part: str):
    """The model inside a composite ``model`` configured by its sub-config ``part``."""
    from transformers import PreTrainedModel
    sub = getattr(model.config, part)
    for name, inner in model.named_modules():
        if name and isinstance(inner, PreTrainedModel) and inner.config is sub:
            return inner
    raise ValueError(f"model type {model.config.model_type!r}: no model inside it is configured "
                     f"by its {part}, whose config records the prior")


def _composite_message(model, family: str) -> str:
    """Why a model whose config has no head count (a multimodal model: its settings in
    ``text_config``, ``vision_config``...) is refused, and the language model inside it that
    apply_prior takes instead."""
    from transformers import PreTrainedModel
    text = getattr(model.config, "text_config", None)
    inside = [name for name, module in model.named_modules()
              if name and isinstance(module, PreTrainedModel) and module.config is text]
    fix = (f"apply the prior to its language model, apply_prior(model.{inside[0]}, ...) (the "
           f"whole model then runs and generates with it)" if inside else
           "apply the prior to a decoder-only language model")
    parts = ", ".join(getattr(model.config, "sub_configs", None) or {})
    if not parts:
        return (f"model type {family!r}: its config has no num_attention_heads, from which "
                f"bamgen reads the number of query heads; {fix}")
    return (f"model type {family!r}: its config has no num_attention_heads (a composite model, "
            f"its parts configured in {parts}); bamgen takes a language model's "
            f"self-attention, not a vision or audio encoder's: {fix}")


_CONFIG_KWARGS = ("cache_dir", "revision", "local_files_only", "token", "trust_remote_code")


def _config_kwargs(kwargs: dict) -> dict:
    return {k: kwargs[k] for k in _CONFIG_KWARGS if k in kwargs}


def _model_class(config):
    """The class the checkpoint was saved from (config.architectures), else the causal LM."""
    import transformers
    for name in getattr(config, "architectures", None) or []:
        cls = getattr(transformers, name, None)
        if cls is not None:
            return cls
    from transformers import AutoModelForCausalLM
    return AutoModelForCausalLM._model_mapping[type(config)]


def _with_prior(cls: type, record: dict, part: str | None = None) -> type:
    """A subclass of ``cls`` (same name, so saving records the same architecture) that builds
    the prior ``record`` names before HF loads the weights into it: the prior's parameters then
    load from the checkpoint like any other weight, with no unexpected keys. The prior module is
    loaded here, outside the meta-device context HF builds the model under. part: the
    sub-config whose model (a composite's language model) took the prior, None for the whole."""
    module, rope = load_record(record), record.get("rope", "remove")
    shared = bool(record.get("shared", False))

    def __init__(self, config, *args, **kwargs):
        cls.__init__(self, config, *args, **kwargs)
        _install(self if part is None else _model_of(self, part), module, rope, None, shared)

    return type(cls.__name__, (cls,), {"__init__": __init__, "__module__": cls.__module__,
                                       "__qualname__": cls.__qualname__})


def _register_if_installed() -> None:
    """A model pickled whole with its priors (torch.save(model), a spawned worker's argument)
    imports this module as it is unpickled, since its hooks live here: registering the "bamgen"
    attention implementation here lets it run in a fresh process, where no apply_prior or
    from_pretrained has registered it."""
    from importlib.util import find_spec
    if find_spec("transformers") is not None:
        register()


_register_if_installed()
