"""A prior inside Hugging Face transformers models (bamgen/integrations/transformers.py).

Tiny random-init models built from a config (nothing is downloaded), on the CPU, as a user
would use them: train with an optimizer over bamgen.param_groups, save_pretrained and load
back, generate() on a left-padded batch with every cache kind, a right-padded training batch.
"Equals each sequence alone" compares logits at float32 rounding (1e-5, as tests/runtime/test_masks.py:
the batched call may split its rows into other parts than the single call) and tokens exactly.
"""
import copy
import math
import subprocess
import sys

import torch
import transformers
from transformers import (GPT2Config, GPT2LMHeadModel, LlamaConfig, LlamaForCausalLM,
                          MistralConfig, MistralForCausalLM, Qwen2Config, Qwen2ForCausalLM)

import bamgen
import bamgen.generated.generalized_gaussian as ggd
import pytest
from bamgen.integrations.transformers import IdentityRotary, apply_prior, from_pretrained

TINY = dict(hidden_size=64, num_hidden_layers=2, num_attention_heads=4, num_key_value_heads=2,
            intermediate_size=128, vocab_size=100, pad_token_id=0)
PAD = 0
CLOSE = dict(rtol=1e-5, atol=1e-5)


def tiny_llama(seed=0, prior=ggd, rope="remove", **init):
    torch.manual_seed(seed)
    model = LlamaForCausalLM(LlamaConfig(**TINY)).eval()
    return apply_prior(model, prior, rope=rope, **init)


def prior_params(model):
    return {name: p.detach().clone() for name, p in model.named_parameters() if "bamgen_prior" in name}


def left_padded(prompts):
    width = max(len(p) for p in prompts)
    ids = torch.tensor([[PAD] * (width - len(p)) + p for p in prompts])
    return ids, (ids != PAD).long()


PROMPTS = [[5, 6, 7, 8, 9, 10, 11], [11, 12, 13], [40, 41, 42, 43, 44]]

# A prior of the key's absolute position j as well as d: right only if every row's positions
# start at 0 at its first real token (a prior of d alone cannot tell wrong offsets).
ABSOLUTE = """name: absolute_tilt
log_prior: -Abs(d) / b - Abs(j - 2) / 4
params:
  b: {init: "2**(8*(h + 1)/H)", domain: positive}
"""


@pytest.fixture(scope="module")
def absolute(tmp_path_factory):
    folder = tmp_path_factory.mktemp("absolute")
    (folder / "absolute_tilt.yaml").write_text(ABSOLUTE)
    return bamgen.load(folder / "absolute_tilt.yaml", cache_dir=folder / "cache")


def test_train_three_steps_updates_every_prior():
    model = tiny_llama().train()
    groups = bamgen.param_groups(model, weight_decay=0.1)
    no_decay = {id(p) for p in groups[1]["params"]}
    priors = [p for name, p in model.named_parameters() if "bamgen_prior" in name]
    assert len(priors) == 2 * 3 and all(id(p) in no_decay for p in priors)   # 2 layers x alpha, beta, mu
    before = prior_params(model)
    optimizer = torch.optim.AdamW(groups, lr=1e-2)
    ids = torch.randint(1, 100, (2, 12), generator=torch.Generator().manual_seed(1))
    for _ in range(3):
        loss = model(ids, labels=ids).loss
        optimizer.zero_grad()
        loss.backward()
        assert torch.isfinite(loss)
        for p in priors:
            assert p.grad is not None and torch.isfinite(p.grad).all() and p.grad.abs().sum() > 0
        optimizer.step()
    after = prior_params(model)
    assert all(not torch.equal(before[k], after[k]) for k in before)


def test_save_and_reload_restores_the_learned_prior(tmp_path):
    model = tiny_llama()
    with torch.no_grad():   # learned values, unlike any init
        for name, p in model.named_parameters():
            if "bamgen_prior" in name:
                p.add_(torch.linspace(-0.3, 0.2, p.numel()))
    ids = torch.randint(1, 100, (2, 9), generator=torch.Generator().manual_seed(2))
    want = model(ids).logits
    model.save_pretrained(tmp_path)
    loaded, info = from_pretrained(tmp_path, output_loading_info=True)
    assert not info["unexpected_keys"] and not info["missing_keys"]
    assert isinstance(loaded, LlamaForCausalLM) and type(loaded).__name__ == "LlamaForCausalLM"
    assert loaded.config._attn_implementation == "bamgen"
    assert loaded.config.bamgen["prior"] == "generalized_gaussian"
    assert isinstance(loaded.model.rotary_emb, IdentityRotary)
    got, expected = prior_params(loaded.eval()), prior_params(model)
    assert got.keys() == expected.keys() and all(torch.equal(got[k], expected[k]) for k in got)
    assert torch.equal(loaded(ids).logits, want)


def test_a_second_prior_replaces_the_first_and_reloads_alike(tmp_path):
    """apply_prior on a model that already has one (RoPE removed by it): rope='remove' replaces
    the prior (there is no rotary embedding left to remove, and none comes back on reload);
    rope='keep' is refused, since the model no longer has the RoPE it would keep (it was once
    recorded, and the reload rebuilt a rotary embedding the model had not run: logits off by 6)."""
    model = tiny_llama(prior="laplace")
    with pytest.raises(ValueError, match="rope='keep'.* an earlier apply_prior removed"):
        apply_prior(model, "t5", rope="keep")
    assert model.config.bamgen["prior"] == "laplace"   # (the refusal changed nothing)
    model = apply_prior(model, "t5")
    assert model.config.bamgen["prior"] == "t5" and model.config.bamgen["rope"] == "remove"
    ids = torch.randint(1, 100, (2, 9), generator=torch.Generator().manual_seed(2))
    want = model(ids).logits
    model.save_pretrained(tmp_path)
    loaded = from_pretrained(tmp_path)
    assert isinstance(loaded.model.rotary_emb, IdentityRotary)
    assert torch.equal(loaded.eval()(ids).logits, want)


def test_a_plain_load_reports_the_prior_as_unexpected(tmp_path):
    """Why from_pretrained exists: HF's own loader drops the prior and goes back to sdpa."""
    tiny_llama().save_pretrained(tmp_path)
    plain, info = LlamaForCausalLM.from_pretrained(tmp_path, output_loading_info=True)
    assert any("bamgen_prior" in key for key in info["unexpected_keys"])
    assert plain.config._attn_implementation != "bamgen"


def test_a_prior_file_is_recorded_and_rebuilt(tmp_path, monkeypatch):
    monkeypatch.setenv("BAMGEN_CACHE_DIR", str(tmp_path / "cache"))
    source = tmp_path / "slopes.yaml"
    source.write_text("name: slopes\nlog_prior: -Abs(d) / b\n"
                      "params:\n  b: {init: \"2**(8*(h + 1)/H)\", domain: positive}\n")
    model = tiny_llama(prior=source, b=[1.0, 2.0, 4.0, 8.0])
    assert model.config.bamgen["prior_source"] == source.read_text()
    model.save_pretrained(tmp_path / "model")
    loaded = from_pretrained(tmp_path / "model").eval()
    ids = torch.randint(1, 100, (1, 6), generator=torch.Generator().manual_seed(3))
    assert torch.equal(loaded(ids).logits, model(ids).logits)
    values = loaded.model.layers[0].self_attn.bamgen_prior.prior_params()["b"]
    torch.testing.assert_close(values, torch.tensor([1.0, 2.0, 4.0, 8.0]))


CACHES = {"dynamic": {}, "no cache": {"use_cache": False},
          "static": {"cache_implementation": "static"}}


@pytest.mark.parametrize("cache", list(CACHES))
def test_generate_left_padded_equals_each_prompt_alone(cache, absolute):
    model = tiny_llama(prior=absolute)
    ids, mask = left_padded(PROMPTS)
    settings = dict(max_new_tokens=4, do_sample=False, output_logits=True,
                    return_dict_in_generate=True, pad_token_id=PAD, **CACHES[cache])
    batch = model.generate(ids, attention_mask=mask, **settings)
    for b, prompt in enumerate(PROMPTS):
        alone = model.generate(torch.tensor([prompt]), **settings)
        assert batch.sequences[b, ids.shape[1]:].tolist() == alone.sequences[0, len(prompt):].tolist()
        for step, logits in enumerate(alone.logits):
            torch.testing.assert_close(batch.logits[step][b:b + 1], logits, **CLOSE,
                                       msg=lambda m: f"row {b}, step {step}: {m}")


def test_generate_with_a_static_cache_object(absolute):
    """A StaticCache passed by hand: its slots past the prompt are unwritten, the prompt starts
    at slot 0 (q_offset = Nk - Nq would put it at the end)."""
    model = tiny_llama(seed=1, prior=absolute)
    ids, mask = left_padded(PROMPTS[:2])
    cache = transformers.StaticCache(config=model.config, max_cache_len=32)
    settings = dict(max_new_tokens=3, do_sample=False, pad_token_id=PAD)
    got = model.generate(ids, attention_mask=mask, past_key_values=cache, **settings)
    want = model.generate(ids, attention_mask=mask, use_cache=False, **settings)
    assert got.tolist() == want.tolist()


def test_right_padding_in_training_equals_the_unpadded_rows(absolute):
    model = tiny_llama(seed=2, prior=absolute)
    rows = [[3, 4, 5, 6, 7, 8], [9, 10, 11]]
    ids = torch.tensor([row + [PAD] * (6 - len(row)) for row in rows])
    mask = (ids != PAD).long()
    labels = ids.masked_fill(mask == 0, -100)
    out = model(ids, attention_mask=mask, labels=labels)
    assert torch.isfinite(out.loss)
    for b, row in enumerate(rows):
        alone = model(torch.tensor([row])).logits
        torch.testing.assert_close(out.logits[b:b + 1, :len(row)], alone, **CLOSE)


def test_rope_keep_keeps_the_rotary_embedding():
    removed, kept = tiny_llama(rope="remove"), tiny_llama(rope="keep")
    assert isinstance(removed.model.rotary_emb, IdentityRotary)
    assert not isinstance(kept.model.rotary_emb, IdentityRotary)
    ids = torch.randint(1, 100, (1, 8), generator=torch.Generator().manual_seed(4))
    assert not torch.allclose(removed(ids).logits, kept(ids).logits)


FAMILIES = {
    "mistral": (MistralConfig, MistralForCausalLM, dict(sliding_window=None)),
    "qwen2": (Qwen2Config, Qwen2ForCausalLM, {}),
}


@pytest.mark.parametrize("family", list(FAMILIES))
def test_other_families_decode_with_a_cache_as_without(family):
    config_cls, model_cls, extra = FAMILIES[family]
    torch.manual_seed(5)
    model = apply_prior(model_cls(config_cls(**TINY, **extra)).eval(), "generalized_gaussian")
    ids = torch.randint(1, 100, (2, 7), generator=torch.Generator().manual_seed(5))
    full = model(ids).logits
    prefill = model(ids[:, :5], use_cache=True)
    step = model(ids[:, 5:], past_key_values=prefill.past_key_values, use_cache=True).logits
    torch.testing.assert_close(step, full[:, 5:], **CLOSE)


def test_a_window_and_a_softcap_change_the_familys_own_attention():
    """The configs below make both bite (the family-wide tests would pass vacuously if a
    window of 4 or a softcap of 1.0 changed nothing at 11 tokens)."""
    ids = torch.randint(1, 100, (1, 11), generator=torch.Generator().manual_seed(1))
    for family, off in (("mistral", dict(sliding_window=None)),
                        ("gemma2", dict(attn_logit_softcapping=None)),
                        ("gemma2", dict(sliding_window=64)),
                        ("qwen2_moe", dict(sliding_window=64)),
                        ("phimoe", dict(sliding_window=None))):
        with_it, without = family_model(family)(ids).logits, family_model(family, **off)(ids).logits
        assert (with_it - without).abs().max() > 1e-3, (family, off)


def test_a_windowed_layer_runs_a_prior_that_is_minus_infinity_beyond_the_window():
    """Gemma 2's local layers run the prior with their window and softcap written in, its global
    layers the prior with the softcap alone; both read the layer's own parameters."""
    from bamgen.integrations.hf_variants import LayerExtras, layer_extras
    model = apply_prior(family_model("gemma2"), ggd)
    layers = [layer.self_attn for layer in model.model.layers]
    assert [layer_extras(a, model.config) for a in layers] == [LayerExtras(4, 1.0), LayerExtras(None, 1.0)]
    local = transformers_variant(layers[0])
    assert local.traits.window and local.traits.params == ggd._prior.traits.params
    q, k, v = (torch.randn(1, 4, 9, 16, generator=torch.Generator().manual_seed(s)) for s in (1, 2, 3))
    got = layers[0].bamgen_prior.forward_with(local, q, k, v)
    scores = torch.einsum("bhid,bhjd->bhij", q.double(), k.double()) / 4.0
    d = torch.arange(9)[:, None] - torch.arange(9)[None, :]
    values = {n: t.double()[:, None, None] for n, t in layers[0].bamgen_prior.prior_params().items()}
    prior = -((d - values["mu"]).abs() / values["alpha"]) ** values["beta"]
    logits = (torch.tanh(scores) + prior).masked_fill((d < 0) | (d >= 4), -torch.inf)
    want = torch.softmax(logits, -1) @ v.double()
    torch.testing.assert_close(got.double(), want, rtol=1e-5, atol=1e-5)


def test_a_windowed_layer_runs_a_prior_written_as_a_density():
    """The shipped Cauchy prior is a density, which a window makes 0 beyond it (the derived
    file's Piecewise((0, Abs(d) >= W), (density, True))): its log is taken per branch (-oo
    beyond the window), where it was refused with a division by zero on every windowed family,
    Mistral's default config among them."""
    from bamgen.integrations.hf_variants import LayerExtras, layer_extras
    model = apply_prior(family_model("gemma2"), "cauchy")
    layers = [layer.self_attn for layer in model.model.layers]
    assert layer_extras(layers[0], model.config) == LayerExtras(4, 1.0)
    local = transformers_variant(layers[0])
    q, k, v = (torch.randn(1, 4, 9, 16, generator=torch.Generator().manual_seed(s)) for s in (1, 2, 3))
    got = layers[0].bamgen_prior.forward_with(local, q, k, v)
    scores = torch.einsum("bhid,bhjd->bhij", q.double(), k.double()) / 4.0
    d = torch.arange(9)[:, None] - torch.arange(9)[None, :]
    values = {n: t.double()[:, None, None] for n, t in layers[0].bamgen_prior.prior_params().items()}
    prior = -torch.log1p(((d - values["mu"]) / values["gamma"]) ** 2)
    logits = (torch.tanh(scores) + prior).masked_fill((d < 0) | (d >= 4), -torch.inf)
    want = torch.softmax(logits, -1) @ v.double()
    torch.testing.assert_close(got.double(), want, rtol=1e-5, atol=1e-5)


KEYWORD_PRIOR = """name: decay_rate
log_prior: -lambda*Abs(d) - in*log(1 + Abs(d))
params:
  lambda: {init: 0.25, domain: positive}
  in: {init: 0.1}
"""


def test_a_prior_with_python_keywords_as_names_trains_saves_and_reloads(tmp_path, monkeypatch):
    """Parameters named lambda and in (Python keywords): Gemma 2's local layers run the derived
    prior (window and softcap written around the user's formula) with the layer's own lambda,
    bamgen.param_groups trains them, and save_pretrained / from_pretrained brings them back."""
    monkeypatch.setenv("BAMGEN_CACHE_DIR", str(tmp_path / "cache"))
    source = tmp_path / "decay_rate.yaml"
    source.write_text(KEYWORD_PRIOR)
    model = apply_prior(family_model("gemma2"), source, **{"lambda": [0.1, 0.2, 0.4, 0.8]})
    layer = model.model.layers[0].self_attn
    local = transformers_variant(layer)
    assert local.traits.window and local.traits.param_names == ("lambda", "in")
    q, k, v = (torch.randn(1, 4, 9, 16, generator=torch.Generator().manual_seed(s)) for s in (1, 2, 3))
    got = layer.bamgen_prior.forward_with(local, q, k, v)
    scores = torch.einsum("bhid,bhjd->bhij", q.double(), k.double()) / 4.0
    d = (torch.arange(9)[:, None] - torch.arange(9)[None, :]).double()
    values = {n: t.double()[:, None, None] for n, t in layer.bamgen_prior.prior_params().items()}
    prior = -values["lambda"] * d.abs() - values["in"] * torch.log1p(d.abs())
    logits = (torch.tanh(scores) + prior).masked_fill((d < 0) | (d >= 4), -torch.inf)
    torch.testing.assert_close(got.double(), torch.softmax(logits, -1) @ v.double(),
                               rtol=1e-5, atol=1e-5)
    model.train()
    optimizer = torch.optim.AdamW(bamgen.param_groups(model, weight_decay=0.1), lr=1e-2)
    ids = torch.randint(1, 100, (2, 9), generator=torch.Generator().manual_seed(2))
    before = prior_params(model)
    model(ids, labels=ids).loss.backward()
    optimizer.step()
    after = prior_params(model)
    assert sorted(after) == sorted(f"model.layers.{n}.self_attn.bamgen_prior.raw_{p}"
                                   for n in (0, 1) for p in ("lambda", "in"))
    assert all(not torch.equal(before[key], after[key]) for key in after)
    want = model.eval()(ids).logits
    model.save_pretrained(tmp_path / "model")
    loaded = from_pretrained(tmp_path / "model").eval()
    assert torch.equal(loaded(ids).logits, want)


@pytest.mark.parametrize("family", ["mistral", "gemma2"])
def test_windowed_families_generate_alike_with_every_cache(family):
    """Generation past the window (7 prompt tokens, 6 new, a window of 4) through the sliding
    caches: no cache, the dynamic cache and the static one give the same tokens with a prior,
    and with the zero prior (RoPE kept) the family's own eager attention's tokens."""
    batch, mask = left_padded([[5, 6, 7, 8, 9, 10, 11], [11, 12, 13]])
    caches = {"none": dict(use_cache=False), "dynamic": {}, "static": dict(cache_implementation="static")}

    def generated(model, cache):
        out = model.generate(batch, attention_mask=mask, max_new_tokens=6, do_sample=False,
                             pad_token_id=PAD, **caches[cache])
        return out[:, batch.shape[1]:].tolist()
    own = generated(family_model(family, seed=4), "static")
    zero = apply_prior(family_model(family, seed=4), "uniform", rope="keep")
    assert all(generated(zero, cache) == own for cache in caches), family
    model = apply_prior(family_model(family, seed=4), ggd)
    alone = generated(model, "none")
    assert all(generated(model, cache) == alone for cache in ("dynamic", "static")), family

def transformers_variant(attention):
    from bamgen.integrations.hf_variants import layer_extras
    from bamgen.integrations.transformers import _VARIANTS
    prior = attention.bamgen_prior
    return _VARIANTS[(type(prior), layer_extras(attention, attention.config))]


def test_derived_priors_keep_the_users_formulas():
    """The prior file a window and a softcap derive: the score's s (not ssmax's or sinh's) is
    capped, n (the keys a query may attend to) is at most the window, a density prior is 0
    beyond the window, and the parameters are the user's."""
    import yaml
    from bamgen.integrations.hf_variants import LayerExtras, derived_source
    from bamgen.resources import shipped_prior
    ssmax = yaml.safe_load(derived_source(shipped_prior("bam_ssmax").read_text(), LayerExtras(8, 30.0)))
    assert ssmax["name"] == "bam_ssmax_window8_softcap30"
    assert ssmax["score"] == "((30.0*tanh(s/30.0)) + log_prior) * ssmax * log(Min(n, 8))"
    assert ssmax["log_prior"].startswith("Piecewise((-oo, Abs(d) >= 8), ((-exp(ta) * (Abs(j - i - 2*sinh(tm))")
    density = "name: wide\ndensity: exp(-(d/b)**2)\nparams:\n  b: {init: 4.0, domain: positive}\n"
    derived = yaml.safe_load(derived_source(density, LayerExtras(3, None)))
    assert derived["density"] == "Piecewise((0, Abs(d) >= 3), ((exp(-(d/b)**2)), True))"
    assert derived["params"] == yaml.safe_load(density)["params"] and "score" not in derived


def test_a_windowed_ssmax_counts_the_keys_inside_the_window():
    """BAM-SSMax's log n under a window of 4: n is the keys a query may attend to, min(i + 1, 4)
    causally, checked against a float64 reference of the whole logit."""
    from bamgen.integrations.hf_variants import LayerExtras
    from bamgen.integrations.transformers import _prepare_variant
    import bamgen.generated.bam_ssmax as ssmax
    variant = _prepare_variant(ssmax.BamSsmaxAttention, LayerExtras(4, None), "test")
    layer = ssmax.BamSsmaxAttention(2)
    q, k, v = (torch.randn(1, 2, 9, 16, generator=torch.Generator().manual_seed(s)) for s in (4, 5, 6))
    got = layer.forward_with(variant, q, k, v)
    p = {n: t.double()[:, None, None] for n, t in layer.prior_params().items()}
    i, j = torch.arange(9)[:, None], torch.arange(9)[None, :]
    d = i - j
    log_prior = -torch.exp(p["ta"]) * ((j - i - 2 * torch.sinh(p["tm"])).abs() + 1e-5) ** p["tb"]
    n = torch.clamp(i + 1, max=4).double()
    scores = torch.einsum("bhid,bhjd->bhij", q.double(), k.double()) / 4.0
    logits = ((scores + log_prior) * p["ssmax"] * torch.log(n)).masked_fill((d < 0) | (d >= 4), -torch.inf)
    want = torch.softmax(logits, -1) @ v.double()
    torch.testing.assert_close(got.double(), want, rtol=1e-5, atol=1e-5)


def test_a_prior_without_its_file_is_refused_for_a_windowed_family(tmp_path, monkeypatch):
    """A module built into the user's own package carries no prior file to derive the window's
    prior from: named, with the fix, before anything changes."""
    import importlib
    import sys
    from click.testing import CliRunner
    from bamgen.cli import main
    (tmp_path / "slopes.yaml").write_text("name: slopes\nlog_prior: -Abs(d) / b\n"
                                          "params:\n  b: {init: 2.0, domain: positive}\n")
    res = CliRunner().invoke(main, ["build", str(tmp_path / "slopes.yaml"), "-o", str(tmp_path / "pkg")])
    assert res.exit_code == 0, res.output
    monkeypatch.syspath_prepend(str(tmp_path / "pkg"))
    module = importlib.import_module("slopes")
    try:
        model = family_model("mistral")
        with pytest.raises(ValueError, match=r"model type 'mistral': its attention's "
                                             r"sliding_window=4 .* pass the prior's file"):
            apply_prior(model, module)
        assert model.config._attn_implementation == "eager" and not hasattr(model.config, "bamgen")
        apply_prior(family_model("mistral", sliding_window=None), module)   # no window: it runs
    finally:
        sys.modules.pop("slopes", None)


def test_unsupported_model_and_bad_arguments_are_named():
    gpt2 = GPT2LMHeadModel(GPT2Config(n_embd=32, n_layer=1, n_head=2, vocab_size=50))
    with pytest.raises(ValueError, match="model type 'gpt2': rope='remove' found no rotary embedding"):
        apply_prior(gpt2, ggd)
    llama = LlamaForCausalLM(LlamaConfig(**TINY))
    with pytest.raises(ValueError, match="rope: expected one of"):
        apply_prior(llama, ggd, rope="none")
    with pytest.raises(ValueError, match="prior: expected"):
        apply_prior(llama, 3)
    with pytest.raises(ValueError, match="init: unknown parameter 'sigma'"):
        apply_prior(llama, ggd, sigma=1.0)
    bloom = tiny_auto("bloom", hidden_size=32, n_layer=1, n_head=2, vocab_size=50)
    with pytest.raises(ValueError, match=r"model type 'bloom': no attention layer dispatches "
                                         r"through .* use a family whose attention does"):
        apply_prior(bloom, "uniform", rope="keep")
    assert_untouched(bloom)


def tiny_auto(family, **config):
    torch.manual_seed(0)
    cfg = transformers.AutoConfig.for_model(family, **config)
    auto = (transformers.AutoModelForSeq2SeqLM if cfg.is_encoder_decoder
            else transformers.AutoModelForCausalLM)
    return auto.from_config(cfg).eval()


def assert_untouched(model):
    assert model.config._attn_implementation != "bamgen" and not hasattr(model.config, "bamgen")
    assert not any("bamgen_prior" in name for name, _ in model.named_parameters())


def test_a_family_with_attention_sinks_is_refused():
    """gpt-oss adds a learned per-head logit (a sink) to every softmax: the prior does not
    model it, so taking its attention over would change the model (silently, were it taken)."""
    model = tiny_auto("gpt_oss", hidden_size=32, num_hidden_layers=2, num_attention_heads=4,
                      num_key_value_heads=2, head_dim=8, intermediate_size=32, vocab_size=128,
                      num_local_experts=4, num_experts_per_tok=2)
    with pytest.raises(ValueError, match=r"model type 'gpt_oss': its attention has sinks"):
        apply_prior(model, "uniform", rope="keep")
    assert_untouched(model)


ENCODER_DECODERS = {
    "t5": dict(d_model=32, d_kv=8, d_ff=32, num_layers=1, num_heads=2, vocab_size=64),
    "bart": dict(d_model=32, encoder_layers=1, decoder_layers=1, encoder_attention_heads=2,
                 decoder_attention_heads=2, encoder_ffn_dim=32, decoder_ffn_dim=32, vocab_size=64),
}


@pytest.mark.parametrize("family", list(ENCODER_DECODERS))
def test_encoder_decoder_models_are_refused(family):
    """T5's relative position bias and BART's cross-attention over a padded encoder batch are
    not what bamgen's attention takes: refused by name, the model left as it was."""
    model = tiny_auto(family, **ENCODER_DECODERS[family])
    with pytest.raises(ValueError, match=rf"model type '{family}': encoder-decoder models .* "
                                         rf"use a decoder-only model"):
        apply_prior(model, "uniform", rope="keep")
    assert_untouched(model)


def test_a_prior_that_needs_position_tensors_is_refused_and_one_of_tokens_runs():
    """alibi_2d reads two position channels, given only as pos_q / pos_k, which no HF model
    passes: refused up front, not at every forward. forget_gate reads one channel, so it runs
    on the token positions (d = i - j) like any prior of d."""
    model = LlamaForCausalLM(LlamaConfig(**TINY)).eval()
    with pytest.raises(ValueError, match=r"prior: 'alibi_2d' reads 2 position channels .* "
                                         r"pos_q and pos_k"):
        apply_prior(model, "alibi_2d")
    assert_untouched(model)
    ids = torch.randint(1, 100, (1, 7), generator=torch.Generator().manual_seed(4))
    assert torch.isfinite(apply_prior(model, "forget_gate")(ids).logits).all()


DROPOUT_FIELDS = {
    "gpt2": ("attn_pdrop", dict(n_embd=32, n_layer=1, n_head=2, vocab_size=64)),
    "gpt_bigcode": ("attn_pdrop", dict(n_embd=32, n_layer=1, n_head=2, vocab_size=64)),
    "biogpt": ("attention_probs_dropout_prob",
               dict(hidden_size=32, num_hidden_layers=1, num_attention_heads=2,
                    intermediate_size=32, vocab_size=64)),
    "llama": ("attention_dropout", dict(hidden_size=32, num_hidden_layers=1, num_attention_heads=2,
                                        intermediate_size=32, vocab_size=64)),
}


@pytest.mark.parametrize("family", list(DROPOUT_FIELDS))
def test_the_dropout_error_names_the_config_field_the_family_reads(family):
    """Each family reads its attention dropout from its own config field: the error names that
    one, and building the model with it at 0.0 trains."""
    field, config = DROPOUT_FIELDS[family]
    ids = torch.randint(1, 64, (1, 6), generator=torch.Generator().manual_seed(5))
    model = apply_prior(tiny_auto(family, **config, **{field: 0.25}), "uniform", rope="keep")
    with pytest.raises(ValueError, match=rf"model type '{family}': attention dropout 0.25 "
                                         rf"\(from config\.{field}\) .* config\.{field} = 0\.0"):
        model.train()(ids)
    model = apply_prior(tiny_auto(family, **config, **{field: 0.0}), "uniform", rope="keep")
    model.train()(ids, labels=ids).loss.backward()

def test_documents_packed_by_position_ids_each_see_only_themselves(absolute):
    """HF's packed training format (DataCollatorWithFlattening): one row, no attention_mask,
    position_ids restarting at every document; each document gives what it gives alone."""
    model = tiny_llama(seed=7, prior=absolute)
    docs = [[3, 4, 5, 6], [7, 8, 9], [10, 11, 12, 13, 14]]
    ids = torch.tensor([sum(docs, [])])
    positions = torch.tensor([[i for doc in docs for i in range(len(doc))]])
    packed = model(ids, position_ids=positions).logits
    start = 0
    for doc in docs:
        alone = model(torch.tensor([doc])).logits
        torch.testing.assert_close(packed[:, start:start + len(doc)], alone, **CLOSE)
        start += len(doc)
    with pytest.raises(ValueError, match="position_ids: documents packed into a batch of 2"):
        model(ids.repeat(2, 1), position_ids=positions.repeat(2, 1))


@pytest.mark.parametrize("prior", ["t5", "fire"])
def test_vector_priors_train_save_and_reload(tmp_path, prior):
    """T5's bucket table (a [H, 32] vector per layer) and FIRE's MLP (its hidden layer shared by
    the heads) inside a model: every bucket a 12-token batch trains gets a gradient and moves,
    as do FIRE's c, L, w1 and w2; save/reload gives the same parameters and logits. FIRE's b2
    adds the same value to every score of a head, which softmax ignores: its gradient is 0 up
    to rounding (and b1's is where no ReLU changes side within a row)."""
    model = tiny_llama(prior=prior).train()
    priors = {name: p for name, p in model.named_parameters() if "bamgen_prior" in name}
    short = {name: name.rsplit(".", 1)[-1].removeprefix("raw_") for name in priors}
    assert {short[n]: tuple(p.shape) for n, p in priors.items()} == (
        {"w": (4, 32)} if prior == "t5" else
        {"c": (1,), "L": (1,), "w1": (32,), "b1": (32,), "w2": (4, 32), "b2": (4,)})
    before = prior_params(model)
    optimizer = torch.optim.AdamW(bamgen.param_groups(model, weight_decay=0.1), lr=1e-2)
    ids = torch.randint(1, 100, (2, 12), generator=torch.Generator().manual_seed(1))
    for _ in range(3):
        loss = model(ids, labels=ids).loss
        optimizer.zero_grad()
        loss.backward()
        for name, p in priors.items():
            assert torch.isfinite(p.grad).all(), name
            if short[name] == "w":   # d = 0..10: the last position predicts no label, so its
                assert (p.grad[:, :11] != 0).all(), name   # row, the only one at d = 11, sends none
            elif short[name] == "b2":
                assert p.grad.abs().max() < 1e-12, name
            elif short[name] != "b1":
                assert (p.grad != 0).any(), name
        optimizer.step()
    after = prior_params(model)
    assert [k for k in before if torch.equal(before[k], after[k]) and not k.endswith(("b1", "b2"))] == []
    model.eval().save_pretrained(tmp_path)
    loaded = from_pretrained(tmp_path).eval()
    got = prior_params(loaded)
    assert got.keys() == after.keys() and all(torch.equal(got[k], after[k]) for k in got)
    assert torch.equal(loaded(ids).logits, model(ids).logits)


DOCS = [[3, 4, 5, 6, 7], [8, 9, 10], [11, 12, 13, 14, 15, 16, 17]]
COLLATOR_OPTIONS = {   # DataCollatorWithFlattening's ways of marking the documents
    "position_ids": dict(),
    "cu_seq_lens": dict(return_flash_attn_kwargs=True, return_position_ids=False),
    "cu_seq_lens+position_ids": dict(return_flash_attn_kwargs=True),
    "seq_idx": dict(return_seq_idx=True, return_position_ids=False),
}


@pytest.mark.parametrize("option", COLLATOR_OPTIONS)
def test_every_collator_packing_option_gives_each_document_alone(option, absolute):
    """DataCollatorWithFlattening, each option as a user would set it: the packed row's logits
    and per-token losses equal each document's alone (documents never mix; with
    return_position_ids=False only cu_seq_lens_q/k or seq_idx says where they start)."""
    model = tiny_llama(seed=5, prior=absolute)
    batch = collated(option)
    assert ("position_ids" in batch) == COLLATOR_OPTIONS[option].get("return_position_ids", True)
    assert_each_document_alone(model, batch, model(**batch).logits)


def collated(option):
    """DOCS packed by DataCollatorWithFlattening with one of its options."""
    from transformers import DataCollatorWithFlattening
    return DataCollatorWithFlattening(**COLLATOR_OPTIONS[option])([{"input_ids": doc} for doc in DOCS])


def assert_each_document_alone(model, batch, logits, what=""):
    """The packed row's logits and per-token losses (``batch`` from :func:`collated`, ``logits``
    the model's on it) equal each document's alone."""
    losses = torch.nn.functional.cross_entropy(logits[0, :-1], batch["labels"][0, 1:],
                                               reduction="none", ignore_index=-100)
    start = 0
    for doc in DOCS:
        ids = torch.tensor([doc])
        alone = model(ids).logits
        torch.testing.assert_close(logits[:, start:start + len(doc)], alone, **CLOSE,
                                   msg=lambda m: f"{what} document at {start}: {m}")
        alone_losses = torch.nn.functional.cross_entropy(alone[0, :-1], ids[0, 1:], reduction="none")
        torch.testing.assert_close(losses[start:start + len(doc) - 1], alone_losses, **CLOSE,
                                   msg=lambda m: f"{what} losses of the document at {start}: {m}")
        start += len(doc)


def test_packing_arguments_that_cannot_hold_are_refused():
    model = tiny_llama()
    ids = torch.tensor([sum(DOCS, [])])
    cu = torch.tensor([0, 5, 8, 15], dtype=torch.int32)
    with pytest.raises(ValueError, match="cu_seq_lens_q and cu_seq_lens_k come together"):
        model(ids, cu_seq_lens_q=cu)
    with pytest.raises(ValueError, match=r"packed documents are taken in one row \(batch size 1, got 2\)"):
        model(ids.repeat(2, 1), cu_seq_lens_q=cu, cu_seq_lens_k=cu)



# Families whose own code keeps a collator marker from attention (transformers 5.23):
# Persimmon's attention drops position_ids, GPT-BigCode's model does not pass them to its
# layers, StableLM's decoder layer drops seq_idx and cu_seq_lens; GPT-2, GPT-BigCode, OPT and
# BioGPT number positions with absolute embeddings, from position_ids alone. (config, rope)
MARKER_FAMILIES = {
    "persimmon": (dict(hidden_size=64, num_hidden_layers=2, num_attention_heads=4,
                       intermediate_size=128, vocab_size=100), "remove"),
    "gpt_bigcode": (dict(n_embd=64, n_layer=2, n_head=4, vocab_size=100, attn_pdrop=0.0,
                         bos_token_id=1, eos_token_id=1), "keep"),
    "stablelm": (dict(hidden_size=64, num_hidden_layers=2, num_attention_heads=4,
                      num_key_value_heads=2, intermediate_size=128, vocab_size=100), "remove"),
    "gpt2": (dict(n_embd=64, n_layer=2, n_head=4, vocab_size=100, attn_pdrop=0.0,
                  bos_token_id=1, eos_token_id=1), "keep"),
    "opt": (dict(hidden_size=64, num_hidden_layers=2, num_attention_heads=4, ffn_dim=128,
                 word_embed_proj_dim=64, vocab_size=100), "keep"),
    "biogpt": (dict(hidden_size=64, num_hidden_layers=2, num_attention_heads=4,
                    intermediate_size=128, vocab_size=100, attention_probs_dropout_prob=0.0), "keep"),
}


def marker_family(family, prior):
    config, rope = MARKER_FAMILIES[family]
    return apply_prior(tiny_auto(family, **config), prior, rope=rope)


@pytest.mark.parametrize("family", MARKER_FAMILIES)
def test_every_collator_option_keeps_documents_apart_where_the_family_drops_a_marker(family, absolute):
    """The families that keep one of the collator's markers from attention, or read positions
    from absolute embeddings: every option of DataCollatorWithFlattening gives each document's
    logits and per-token losses alone (the marker a family drops is handed to it in the form
    it passes on; without that, each family mixed documents under one option or another)."""
    model = marker_family(family, absolute)
    for option in COLLATOR_OPTIONS:
        batch = collated(option)
        assert_each_document_alone(model, batch, model(**batch).logits, f"{family}, {option}:")


def test_packed_rows_that_cannot_hold_are_refused_where_the_family_drops_the_marker():
    """A batch of packed rows, or packed markers with a cache, is refused by name in the
    families that drop the marker the attention would check (where they mixed silently)."""
    persimmon, stablelm = marker_family("persimmon", ggd), marker_family("stablelm", ggd)
    ids = torch.tensor([sum(DOCS, [])] * 2)
    positions = torch.tensor([[i for doc in DOCS for i in range(len(doc))]] * 2)
    with pytest.raises(ValueError, match="position_ids: documents packed into a batch of 2"):
        persimmon(ids, position_ids=positions)
    seq_idx = torch.tensor([[d for d, doc in enumerate(DOCS) for _ in doc]] * 2)
    with pytest.raises(ValueError, match=r"packed documents are taken in one row \(batch size 1, got 2\)"):
        stablelm(ids, seq_idx=seq_idx)
    cache = stablelm(ids[:1, :3], use_cache=True).past_key_values
    with pytest.raises(ValueError, match="packed documents are taken in one row .* no cache"):
        stablelm(ids[:1, 3:], seq_idx=seq_idx[:1, 3:], past_key_values=cache)


@pytest.mark.parametrize("family, option", [("persimmon", "position_ids"), ("stablelm", "seq_idx"),
                                            ("gpt2", "cu_seq_lens")])
def test_packed_documents_stay_apart_compiled_where_the_family_drops_a_marker(family, option, absolute):
    """The markers handed to such a family are computed inside the compiled graph: no graph
    break, and the compiled packed row gives each document alone."""
    import torch._dynamo as dynamo
    model = marker_family(family, absolute)
    batch = collated(option)
    inputs = {name: value for name, value in batch.items() if name != "labels"}   # (GPT-2's loss
    dynamo.reset()                                    # function breaks the graph on its own)
    explained = dynamo.explain(lambda **kw: model(**kw).logits)(**inputs)
    assert explained.graph_break_count == 0, explained.break_reasons
    dynamo.reset()
    compiled = torch.compile(lambda **kw: model(**kw).logits, backend="aot_eager", fullgraph=True)
    assert_each_document_alone(model, batch, compiled(**inputs), f"{family}, {option}, compiled:")

def _compile_batches():
    """A packed row (position_ids restarting) and a left-padded batch, at three lengths."""
    for n in (12, 16, 20):
        ids = torch.randint(1, 100, (1, n), generator=torch.Generator().manual_seed(n))
        cut = n // 3
        positions = torch.cat([torch.arange(cut), torch.arange(n - cut)])[None]
        yield "packed", dict(input_ids=ids, position_ids=positions, labels=ids)
        ids = torch.randint(1, 100, (2, n), generator=torch.Generator().manual_seed(n + 1))
        mask = torch.ones(2, n, dtype=torch.long)
        mask[0, :3] = 0
        yield "padded", dict(input_ids=ids, attention_mask=mask, labels=ids.masked_fill(mask == 0, -100))


def test_a_model_with_a_prior_compiles_fullgraph_without_breaks_or_recompiles():
    """torch.compile on the HF model itself: no graph break (torch._dynamo.explain) on a packed
    row or a padded batch, fullgraph and dynamic, one graph per kind of batch for three
    lengths, and every gradient (the prior's included) equal to eager."""
    import torch._dynamo as dynamo
    from torch._dynamo.testing import CompileCounterWithBackend
    eager = tiny_llama(seed=9).train()
    compiled_model = tiny_llama(seed=9).train()
    for kind, batch in list(_compile_batches())[:2]:
        dynamo.reset()
        explained = dynamo.explain(lambda **kw: compiled_model(**kw).loss)(**batch)
        assert explained.graph_break_count == 0, (kind, explained.break_reasons)
    dynamo.reset()
    counter = CompileCounterWithBackend("aot_eager")
    step = torch.compile(lambda **kw: compiled_model(**kw).loss, backend=counter, fullgraph=True,
                         dynamic=True)
    frames = []
    for kind, batch in _compile_batches():
        frames.append(counter.frame_count)
        want = eager(**batch).loss
        want_grads = torch.autograd.grad(want, list(eager.parameters()))
        got = step(**batch)
        got_grads = torch.autograd.grad(got, list(compiled_model.parameters()))
        torch.testing.assert_close(got, want, **CLOSE)
        for (name, _), a, b in zip(eager.named_parameters(), got_grads, want_grads):
            torch.testing.assert_close(a, b, rtol=1e-4, atol=1e-5, msg=lambda m: f"{kind} {name}: {m}")
    frames.append(counter.frame_count)
    assert frames[2:] == [frames[2]] * 5, frames   # compiled for the first length: no recompile



@pytest.mark.full
def test_a_model_with_a_prior_compiles_with_inductor_once_for_every_length():
    """The same with inductor, the default backend (about a minute on 2 cores: make test-full):
    padded batches at three lengths, one graph, loss and every prior gradient equal to eager."""
    import torch._dynamo as dynamo
    from torch._dynamo.testing import CompileCounterWithBackend
    eager = tiny_llama(seed=9).train()
    compiled_model = tiny_llama(seed=9).train()
    dynamo.reset()
    counter = CompileCounterWithBackend("inductor")
    step = torch.compile(lambda **kw: compiled_model(**kw).loss, backend=counter, fullgraph=True,
                         dynamic=True)
    frames = []
    for n in (12, 17, 23):
        ids = torch.randint(1, 100, (2, n), generator=torch.Generator().manual_seed(n))
        mask = torch.ones_like(ids)
        mask[0, :3] = 0
        batch = dict(input_ids=ids, attention_mask=mask, labels=ids.masked_fill(mask == 0, -100))
        want = eager(**batch).loss
        got = step(**batch)
        frames.append(counter.frame_count)
        torch.testing.assert_close(got, want, **CLOSE)
        priors = [(name, p) for name, p in compiled_model.named_parameters() if "bamgen_prior" in name]
        got_grads = torch.autograd.grad(got, [p for _, p in priors])
        want_grads = torch.autograd.grad(want, [eager.get_parameter(name) for name, _ in priors])
        for (name, _), a, b in zip(priors, got_grads, want_grads):
            torch.testing.assert_close(a, b, rtol=1e-4, atol=1e-6, msg=lambda m: f"{n} {name}: {m}")
    assert frames == [frames[0]] * 3, frames

def test_trainer_three_steps_with_packed_documents(tmp_path):
    """transformers' Trainer (bamgen[hf] brings accelerate) on a model with a prior, batches
    from DataCollatorWithFlattening: three steps, a finite loss, and the prior's parameters
    move (their gradients reach the optimizer Trainer builds)."""
    from transformers import DataCollatorWithFlattening, Trainer, TrainingArguments
    model = tiny_llama(seed=2).train()
    before = prior_params(model)
    rows = [{"input_ids": torch.randint(1, 100, (n,), generator=torch.Generator().manual_seed(n)).tolist()}
            for n in (7, 12, 5, 9, 11, 6)]
    args = TrainingArguments(output_dir=str(tmp_path), max_steps=3, per_device_train_batch_size=2,
                             learning_rate=1e-2, logging_steps=1, report_to=[], save_strategy="no",
                             use_cpu=True, dataloader_num_workers=0, seed=0)
    trainer = Trainer(model=model, args=args, train_dataset=rows,
                      data_collator=DataCollatorWithFlattening())
    result = trainer.train()
    assert result.global_step == 3 and math.isfinite(result.training_loss)
    after = prior_params(model)
    assert all(not torch.equal(before[name], after[name]) for name in before), "a prior did not move"


def test_a_shared_prior_is_one_set_of_parameters_whose_gradient_sums_the_layers(tmp_path):
    """apply_prior(..., shared=True), as the BAM authors train: one prior for every layer. Its
    parameters appear once (named_parameters, param_groups), its gradient is the sum of the
    gradients per-layer priors with the same values get, and it survives save_pretrained
    (safetensors) and from_pretrained: the same logits, every layer still reading one prior."""
    per_layer = tiny_llama(seed=4).train()
    torch.manual_seed(4)
    shared = apply_prior(LlamaForCausalLM(LlamaConfig(**TINY)), ggd, shared=True).train()
    names = [n for n, _ in shared.named_parameters() if "bamgen_prior" in n]
    assert names == ["model.bamgen_prior.raw_alpha", "model.bamgen_prior.raw_beta",
                     "model.bamgen_prior.raw_mu"], names
    layers = [layer.self_attn for layer in shared.model.layers]
    assert all(a.bamgen_prior is shared.model.bamgen_prior for a in layers)
    grouped = [p for group in bamgen.param_groups(shared) for p in group["params"]]
    assert len(grouped) == len({id(p) for p in grouped}) == len(list(shared.parameters()))

    ids = torch.randint(1, 100, (2, 10), generator=torch.Generator().manual_seed(3))
    a, b = per_layer(ids, labels=ids), shared(ids, labels=ids)
    torch.testing.assert_close(b.logits, a.logits, **CLOSE)
    a.loss.backward()
    b.loss.backward()
    for name, p in shared.model.bamgen_prior.named_parameters():
        summed = sum(layer.self_attn.bamgen_prior.get_parameter(name).grad
                     for layer in per_layer.model.layers)
        torch.testing.assert_close(p.grad, summed, rtol=1e-5, atol=1e-7)

    with torch.no_grad():
        for p in shared.model.bamgen_prior.parameters():
            p.add_(0.05)   # learned values, not the init
    shared.eval()
    shared.save_pretrained(tmp_path)          # safetensors: no shared tensors to refuse
    assert (tmp_path / "model.safetensors").exists()
    back = from_pretrained(tmp_path).eval()
    assert all(layer.self_attn.bamgen_prior is back.model.bamgen_prior for layer in back.model.layers)
    for (n1, p1), (n2, p2) in zip(shared.model.bamgen_prior.named_parameters(),
                                  back.model.bamgen_prior.named_parameters()):
        assert n1 == n2 and torch.equal(p1, p2), n1
    torch.testing.assert_close(back(ids).logits, shared(ids).logits, rtol=0, atol=0)



# Every decoder family whose attention goes through ALL_ATTENTION_FUNCTIONS in the pinned
# transformers, found from the model (bamgen/integrations/transformers.py keeps no list):
# (config class, model class, config extras, rope). Sliding windows of 4 tokens (Mistral for
# every layer, Qwen 2 and Gemma 2/3 for their local layers) and Gemma 2's logit softcap at 1.0
# over scores that reach it (weights drawn 10x the default's scale), so that both bite at the
# tests' lengths; GPT-2's positions are absolute embeddings, kept.
EVERY_FAMILY = {
    "llama": ("LlamaConfig", "LlamaForCausalLM", {}, "remove"),
    "mistral": ("MistralConfig", "MistralForCausalLM", dict(sliding_window=4), "remove"),
    "qwen2": ("Qwen2Config", "Qwen2ForCausalLM",
              dict(sliding_window=4, use_sliding_window=True, max_window_layers=1), "remove"),
    "qwen3": ("Qwen3Config", "Qwen3ForCausalLM", dict(head_dim=16), "remove"),
    "olmo2": ("Olmo2Config", "Olmo2ForCausalLM", {}, "remove"),
    "gemma2": ("Gemma2Config", "Gemma2ForCausalLM",
               dict(head_dim=16, sliding_window=4, attn_logit_softcapping=1.0,
                    final_logit_softcapping=None, initializer_range=0.2), "remove"),
    "gemma3": ("Gemma3TextConfig", "Gemma3ForCausalLM", dict(head_dim=16, sliding_window=4), "remove"),
    "phi3": ("Phi3Config", "Phi3ForCausalLM", dict(eos_token_id=1, bos_token_id=1), "remove"),
    "gpt_neox": ("GPTNeoXConfig", "GPTNeoXForCausalLM", dict(eos_token_id=1, bos_token_id=1), "remove"),
    "gpt2": ("GPT2Config", "GPT2LMHeadModel", dict(attn_pdrop=0.0), "keep"),
    # families whose sliding window lives in the mask alone (their attention passes none):
    # Qwen2-MoE on its sliding layers (layer 0 here), PhiMoE on every layer
    "qwen2_moe": ("Qwen2MoeConfig", "Qwen2MoeForCausalLM",
                  dict(sliding_window=4, use_sliding_window=True, max_window_layers=1,
                       num_experts=4, num_experts_per_tok=2, moe_intermediate_size=32,
                       shared_expert_intermediate_size=32), "remove"),
    "phimoe": ("PhimoeConfig", "PhimoeForCausalLM",
               dict(sliding_window=4, num_local_experts=4, num_experts_per_tok=2), "remove"),
    # Llama 4's rotary embedding gives complex freqs_cis (chunked layers off: refused)
    "llama4": ("Llama4TextConfig", "Llama4ForCausalLM",
               dict(head_dim=16, intermediate_size_mlp=128, num_local_experts=2,
                    layer_types=["full_attention"] * 2), "remove"),
}


def family_model(family, seed=0, attn="eager", **changes):
    config, model, extra, _ = EVERY_FAMILY[family]
    torch.manual_seed(seed)
    cfg = getattr(transformers, config)(**TINY, **{**extra, **changes})
    cfg._attn_implementation = attn
    return getattr(transformers, model)(cfg).eval()


@pytest.mark.parametrize("family", list(EVERY_FAMILY))
def test_a_zero_prior_equals_the_familys_own_attention(family):
    """NoPE as the prior, RoPE kept: bamgen's attention must give the family's eager attention
    exactly (its scaling, GQA, partial rotary, sliding windows, softcap), padded rows included."""
    own = family_model(family)
    ids = torch.randint(1, 100, (2, 11), generator=torch.Generator().manual_seed(1))
    mask = torch.ones_like(ids)
    mask[1, :4] = 0
    want = own(ids, attention_mask=mask).logits
    got = apply_prior(family_model(family), "uniform", rope="keep")(ids, attention_mask=mask).logits
    torch.testing.assert_close(got[0], want[0], **CLOSE)
    torch.testing.assert_close(got[1, 4:], want[1, 4:], **CLOSE)


@pytest.mark.parametrize("family", list(EVERY_FAMILY))
def test_every_family_trains_and_generates_each_prompt_as_alone(family):
    """A training step sends every prior parameter a gradient; a left-padded batch generates
    greedily what each prompt generates alone, with the cache and without."""
    model = apply_prior(family_model(family, seed=2), ggd, rope=EVERY_FAMILY[family][3])
    ids = torch.randint(1, 100, (2, 9), generator=torch.Generator().manual_seed(2))
    model.train()
    model(ids, labels=ids).loss.backward()
    grads = {n: p.grad for n, p in model.named_parameters() if "bamgen_prior" in n}
    assert len(grads) == 3 * model.config.num_hidden_layers, sorted(grads)   # one prior per layer
    assert all(g is not None and torch.isfinite(g).all() and (g != 0).any() for g in grads.values())
    model.eval()
    batch, mask = left_padded(PROMPTS)
    for cache in (True, False):
        out = model.generate(batch, attention_mask=mask, max_new_tokens=4, do_sample=False,
                             pad_token_id=PAD, use_cache=cache)
        for row, prompt in enumerate(PROMPTS):
            alone = model.generate(torch.tensor([prompt]), max_new_tokens=4, do_sample=False,
                                   pad_token_id=PAD, use_cache=cache)
            assert out[row, batch.shape[1]:].tolist() == alone[0, len(prompt):].tolist(), (family, cache, row)


def test_a_softcapped_family_trains_under_autocast():
    """Gemma 2's softcapped layers run a logit that is not s + f(d) (the CPU's general path):
    under torch.autocast (Trainer's bf16=True) its forward raised 'Input dtypes must be the
    same'. It runs in bfloat16, as eager attention under autocast, and every prior parameter
    gets a finite gradient."""
    model = apply_prior(family_model("gemma2", seed=2), ggd).train()
    ids = torch.randint(1, 100, (2, 9), generator=torch.Generator().manual_seed(2))
    with torch.autocast("cpu", dtype=torch.bfloat16):
        out = model(ids, labels=ids)
    assert out.logits.dtype == torch.bfloat16
    out.loss.backward()
    grads = [p.grad for n, p in model.named_parameters() if "bamgen_prior" in n]
    assert len(grads) == 6 and all(g is not None and torch.isfinite(g).all() for g in grads)


def test_a_shared_prior_serves_local_and_global_layers_and_compiles(tmp_path):
    """Gemma 2 with one shared prior: its local layers (window and softcap) and global layers
    (softcap) read the same parameters, which every layer's gradient reaches; the model has
    no graph break and its fullgraph training step equals eager; save and reload keep it."""
    import torch._dynamo as dynamo
    model = apply_prior(family_model("gemma2", seed=3), ggd, shared=True).train()
    eager = apply_prior(family_model("gemma2", seed=3), ggd, shared=True).train()
    ids = torch.randint(1, 100, (2, 10), generator=torch.Generator().manual_seed(3))
    mask = torch.ones_like(ids)
    mask[0, :3] = 0
    batch = dict(input_ids=ids, attention_mask=mask, labels=ids.masked_fill(mask == 0, -100))
    dynamo.reset()
    explained = dynamo.explain(lambda **kw: model(**kw).loss)(**batch)
    assert explained.graph_break_count == 0, explained.break_reasons
    dynamo.reset()
    step = torch.compile(lambda **kw: model(**kw).loss, backend="aot_eager", fullgraph=True)
    got, want = step(**batch), eager(**batch).loss
    torch.testing.assert_close(got, want, **CLOSE)
    got.backward()
    want.backward()
    for (name, a), b in zip(model.model.bamgen_prior.named_parameters(),
                            eager.model.bamgen_prior.parameters()):
        assert torch.isfinite(a.grad).all() and (a.grad != 0).any(), name
        torch.testing.assert_close(a.grad, b.grad, rtol=1e-4, atol=1e-6)
    model.eval().save_pretrained(tmp_path)
    back = from_pretrained(tmp_path).eval()
    torch.testing.assert_close(back(ids, attention_mask=mask).logits,
                               model(ids, attention_mask=mask).logits, rtol=0, atol=0)


def test_the_trainer_tutorial_script_runs(tmp_path):
    """examples/hf_trainer.py (docs/huggingface.md's second tutorial): a shared prior through
    Trainer with packed documents and torch.compile, saved, loaded back and generating."""
    import subprocess
    import sys
    from tests.helpers import ROOT
    res = subprocess.run([sys.executable, str(ROOT / "examples" / "hf_trainer.py"), "--steps", "2",
                          "--compile-backend", "aot_eager", "--out", str(tmp_path)],
                         cwd=ROOT, capture_output=True, text=True, timeout=600)
    assert res.returncode == 0, res.stderr[-3000:]
    assert "trained 2 steps" in res.stdout and "generated: [[" in res.stdout, res.stdout
    assert (tmp_path / "model.safetensors").exists()


def test_a_window_in_the_mask_alone_is_honoured():
    """Qwen2-MoE and PhiMoE put their sliding window into the mask and pass none to attention:
    bamgen reads it from the mask (HF's local_size), where it was silently dropped (logits off
    by 0.2-0.3 against the family's own attention at 11 tokens, window 4)."""
    from bamgen.integrations.hf_layout import PaddingLayout
    for family in ("qwen2_moe", "phimoe"):
        model = apply_prior(family_model(family), "uniform", rope="keep")
        seen = []
        hook = lambda module, args, kwargs: seen.append(kwargs["attention_mask"])
        handles = [layer.self_attn.register_forward_pre_hook(hook, with_kwargs=True)
                   for layer in model.model.layers]
        ids = torch.randint(1, 100, (1, 11), generator=torch.Generator().manual_seed(1))
        model(ids)
        for handle in handles:
            handle.remove()
        assert all(isinstance(layout, PaddingLayout) for layout in seen)
        want = [4, None] if family == "qwen2_moe" else [4, 4]
        assert [layout.window for layout in seen] == want, family


def test_chunked_attention_is_refused_and_llama4_without_it_removes_rope():
    """Llama 4's chunked layers see only their own chunk of keys, a rule in the mask alone
    that bamgen's attention does not take: refused by name, the model left as it was. Without
    them, rope="remove" replaces its complex rotary embedding (freqs_cis) with the complex 1:
    the same logits as the family's own attention with every rotary frequency 0."""
    torch.manual_seed(0)
    chunked = transformers.Llama4ForCausalLM(transformers.Llama4TextConfig(
        **TINY, head_dim=16, intermediate_size_mlp=128, num_local_experts=2,
        attention_chunk_size=4)).eval()
    with pytest.raises(ValueError, match=r"model type 'llama4_text': chunked attention .*"
                                         r"\(layer_types=\['full_attention'\]"):
        apply_prior(chunked, "uniform", rope="keep")
    assert_untouched(chunked)
    own = family_model("llama4")
    own.model.rotary_emb.inv_freq.zero_()
    ids = torch.randint(1, 100, (2, 11), generator=torch.Generator().manual_seed(1))
    got = apply_prior(family_model("llama4"), "uniform", rope="remove")(ids).logits
    torch.testing.assert_close(got, own(ids).logits, **CLOSE)


@pytest.mark.parametrize("v_head_dim", [8, 24])
def test_values_narrower_or_wider_than_the_keys(v_head_dim):
    """DeepSeek-V3's multi-head latent attention has values of another head dim than its
    queries and keys (16 here): padded with zeros to one width, the zero prior gives the
    family's own attention, padded rows included; the prior trains, and a left-padded batch
    decodes with the cache as each prompt's full forward. It was refused deep in the call
    (k and v must have the same shape)."""
    def deepseek(seed=0):
        torch.manual_seed(seed)
        cfg = transformers.DeepseekV3Config(
            **{**TINY, "num_key_value_heads": 4}, kv_lora_rank=16, q_lora_rank=16,
            qk_rope_head_dim=8, qk_nope_head_dim=8, v_head_dim=v_head_dim, n_routed_experts=4,
            num_experts_per_tok=2, moe_intermediate_size=32, first_k_dense_replace=1, n_group=1,
            topk_group=1, eos_token_id=None)
        cfg._attn_implementation = "eager"
        return transformers.DeepseekV3ForCausalLM(cfg).eval()
    ids = torch.randint(1, 100, (2, 11), generator=torch.Generator().manual_seed(1))
    mask = torch.ones_like(ids)
    mask[1, :4] = 0
    want = deepseek()(ids, attention_mask=mask).logits
    got = apply_prior(deepseek(), "uniform", rope="keep")(ids, attention_mask=mask).logits
    torch.testing.assert_close(got[0], want[0], **CLOSE)
    torch.testing.assert_close(got[1, 4:], want[1, 4:], **CLOSE)
    model = apply_prior(deepseek(seed=2), ggd).train()
    model(ids, labels=ids).loss.backward()
    grads = [p.grad for n, p in model.named_parameters() if "bamgen_prior" in n]
    assert len(grads) == 6 and all(g is not None and (g != 0).any() for g in grads)
    model.eval()
    batch, mask = left_padded(PROMPTS)
    out = model.generate(batch, attention_mask=mask, max_new_tokens=4, do_sample=False,
                         pad_token_id=PAD, output_scores=True, return_dict_in_generate=True)
    for row, prompt in enumerate(PROMPTS):
        full = torch.tensor([prompt + out.sequences[row, batch.shape[1]:].tolist()])
        logits = model(full).logits[0, len(prompt) - 1:-1]
        torch.testing.assert_close(torch.stack([s[row] for s in out.scores]), logits, **CLOSE)


def _tiny_llava():
    """A Llava of a tiny Llama and a one-layer SigLIP tower (image token 110: 4 patches)."""
    text = LlamaConfig(**{**TINY, "vocab_size": 120})
    vision = transformers.SiglipVisionConfig(hidden_size=32, num_hidden_layers=1,
                                             num_attention_heads=2, intermediate_size=64,
                                             image_size=32, patch_size=16)
    torch.manual_seed(0)
    return transformers.LlavaForConditionalGeneration(transformers.LlavaConfig(
        text_config=text, vision_config=vision, image_token_index=110,
        vision_feature_layer=-1, vision_feature_select_strategy="full")).eval()


def test_a_multimodal_model_is_refused_and_its_language_model_takes_the_prior():
    """Llava's config keeps its heads in text_config and its SigLIP tower's attention goes
    through ALL_ATTENTION_FUNCTIONS too: apply_prior failed with AttributeError ('LlavaConfig'
    object has no attribute 'num_attention_heads'). It is refused by name, the model left as
    it was, and the message's way (the language model inside) runs: a left-padded batch with
    images generates what each row generates alone."""
    model = _tiny_llava()
    with pytest.raises(ValueError, match=r"model type 'llava': its config has no "
                                         r"num_attention_heads .* apply_prior\(model\.model\.language_model"):
        apply_prior(model, ggd)
    assert_untouched(model)
    apply_prior(model.model.language_model, ggd)
    image = [110] * 4   # 4 patches of 16x16
    prompts = [image + [5, 6, 7, 8, 9, 10, 11], image + [11, 12, 13]]
    batch, mask = left_padded(prompts)
    pixels = torch.randn(2, 3, 32, 32, generator=torch.Generator().manual_seed(3))
    out = model.generate(batch, attention_mask=mask, pixel_values=pixels, max_new_tokens=4,
                         do_sample=False, pad_token_id=PAD)
    for row, prompt in enumerate(prompts):
        alone = model.generate(torch.tensor([prompt]), pixel_values=pixels[row:row + 1],
                               max_new_tokens=4, do_sample=False, pad_token_id=PAD)
        assert out[row, batch.shape[1]:].tolist() == alone[0, len(prompt):].tolist(), row


def test_another_attention_implementation_set_after_apply_prior_is_refused():
    """set_attn_implementation("sdpa") after apply_prior ran the model without its priors,
    silently (with RoPE removed, with no positional encoding at all: logits off by 0.02 on a
    tiny Llama). The forward is now refused by name, the base model's called alone too, and set
    back to "bamgen" it runs the priors again. Llava switched whole reaches its language model's prior the same way; its
    vision tower alone switched is no concern of the prior's."""
    model = tiny_llama()
    ids = torch.tensor([[5, 6, 7, 8, 9]])
    with torch.no_grad():
        want = model(ids).logits
        model.set_attn_implementation("sdpa")
        with pytest.raises(ValueError, match=r"attn_implementation: .* hold bamgen priors .* "
                                             r"now 'sdpa' .*set_attn_implementation\('bamgen'\)"):
            model(ids)
        with pytest.raises(ValueError, match="now 'sdpa'"):
            model.generate(ids, max_new_tokens=2, do_sample=False)
        with pytest.raises(ValueError, match="now 'sdpa'"):   # the base model, called alone
            model.model(ids)
        model.set_attn_implementation("bamgen")
        torch.testing.assert_close(model(ids).logits, want, rtol=0, atol=0)

    llava = _tiny_llava()
    apply_prior(llava.model.language_model, ggd)
    pixels = torch.randn(1, 3, 32, 32, generator=torch.Generator().manual_seed(3))
    image = torch.tensor([[110] * 4 + [5, 6, 7]])
    with torch.no_grad():
        want = llava(input_ids=image, pixel_values=pixels).logits
        llava.set_attn_implementation({"vision_config": "sdpa"})
        torch.testing.assert_close(llava(input_ids=image, pixel_values=pixels).logits, want,
                                   rtol=1e-6, atol=1e-6)
        llava.set_attn_implementation("sdpa")
        with pytest.raises(ValueError, match="now 'sdpa'"):
            llava(input_ids=image, pixel_values=pixels)


def test_a_multimodal_model_whose_language_model_took_the_prior_reloads_whole(tmp_path, caplog):
    """The prior applied to Llava's language model is recorded in its text_config; from_pretrained
    found no record at the top and refused the checkpoint. It now builds the prior into the
    language model again, loads its learned values with the rest (no missing or unexpected
    key), and leaves the vision tower's attention as it was."""
    model = _tiny_llava()
    apply_prior(model.model.language_model, ggd, alpha=3.0)
    ids = torch.tensor([[110] * 4 + [5, 6, 7, 8, 9]])
    pixels = torch.randn(1, 3, 32, 32, generator=torch.Generator().manual_seed(3))
    with torch.no_grad():
        want = model(ids, pixel_values=pixels).logits
    model.save_pretrained(tmp_path)
    with caplog.at_level("WARNING"):
        back = from_pretrained(tmp_path).eval()
    assert not [r for r in caplog.records if "were not used" in r.getMessage()
                or "newly initialized" in r.getMessage()], caplog.text
    assert back.model.language_model.config._attn_implementation == "bamgen"
    assert back.model.vision_tower.config._attn_implementation != "bamgen"
    layer = back.model.language_model.layers[0].self_attn
    assert torch.allclose(layer.bamgen_prior.prior_params()["alpha"], torch.full((4,), 3.0))
    with torch.no_grad():
        torch.testing.assert_close(back(ids, pixel_values=pixels).logits, want, rtol=0, atol=0)


def test_a_decoder_made_bidirectional_by_is_causal_stays_bidirectional():
    """HF lets a decoder attend both ways (config.is_causal=False, or a call's is_causal=False,
    as embedding models train): the model hands attention is_causal=False, which eager and
    SDPA follow; bamgen's attention read the layer's own is_causal (True) and stayed causal,
    silently (logits off by 0.5). The zero prior now equals the family's own attention both
    ways, padded rows included."""
    def llama(**config):
        torch.manual_seed(0)
        cfg = LlamaConfig(**TINY, **config)
        cfg._attn_implementation = "eager"
        return LlamaForCausalLM(cfg).eval()
    ids = torch.randint(1, 100, (2, 9), generator=torch.Generator().manual_seed(1))
    mask = torch.ones_like(ids)
    mask[1, :3] = 0
    want = llama(is_causal=False)(ids, attention_mask=mask).logits
    got = apply_prior(llama(is_causal=False), "uniform", rope="keep")(ids, attention_mask=mask).logits
    torch.testing.assert_close(got[0], want[0], **CLOSE)
    torch.testing.assert_close(got[1, 3:], want[1, 3:], **CLOSE)
    model = apply_prior(llama(), "uniform", rope="keep")
    torch.testing.assert_close(model(ids, is_causal=False).logits, llama()(ids, is_causal=False).logits, **CLOSE)
    torch.testing.assert_close(model(ids).logits, llama()(ids).logits, **CLOSE)


# windowed families made bidirectional: Qwen3 windowed on its first layer; Qwen2-MoE and PhiMoE
# put their window into the mask alone
BIDIRECTIONAL_WINDOWS = {"mistral": {}, "qwen2": {}, "gemma2": {}, "qwen2_moe": {}, "phimoe": {},
                         "qwen3": dict(sliding_window=4, use_sliding_window=True, max_window_layers=1,
                                       layer_types=["sliding_attention", "full_attention"])}


@pytest.mark.parametrize("family", list(BIDIRECTIONAL_WINDOWS))
def test_a_windowed_decoder_made_bidirectional_sees_its_window_as_eager(family):
    """HF builds a bidirectional call's window (config.is_causal=False, or the call's) with its
    own overlay, which shows the keys up to W away either side (|q - k| <= W): one key more
    than its causal window. bamgen hid |d| >= W and the zero prior was off against the
    family's eager attention, silently (0.14 to 1.9 here, 6.5 in an outside test), and
    Qwen2-MoE's and PhiMoE's mask-alone window was refused. Now equal, by the config and by
    the call, padded rows included (11 tokens, window 4)."""
    changes = BIDIRECTIONAL_WINDOWS[family]
    ids = torch.randint(1, 100, (2, 11), generator=torch.Generator().manual_seed(1))
    mask = torch.ones_like(ids)
    mask[1, :3] = 0
    by_config = dict(attention_mask=mask)
    by_call = dict(attention_mask=mask, is_causal=False)
    for config, call in (({"is_causal": False}, by_config), ({}, by_call)):
        want = family_model(family, **changes, **config)(ids, **call).logits
        model = apply_prior(family_model(family, **changes, **config), "uniform", rope="keep")
        got = model(ids, **call).logits
        torch.testing.assert_close(got[0], want[0], **CLOSE)
        torch.testing.assert_close(got[1, 3:], want[1, 3:], **CLOSE)


def test_a_compiled_bidirectional_window_equals_eager():
    """A compiled call cannot read the mask function's overlay: it reads which of HF's builders
    made the mask, and the prior of the wider window is built by apply_prior for a model made
    bidirectional by its config, so the compiled call has no graph break and equals eager."""
    ids = torch.randint(1, 100, (2, 11), generator=torch.Generator().manual_seed(1))
    mask = torch.ones_like(ids)
    mask[1, :3] = 0
    model = apply_prior(family_model("mistral", is_causal=False), "uniform", rope="keep")
    compiled = torch.compile(lambda **kw: model(**kw).logits, backend="eager", fullgraph=True)
    with torch.no_grad():
        want = family_model("mistral", is_causal=False)(ids, attention_mask=mask).logits
        got = compiled(input_ids=ids, attention_mask=mask)
    torch.testing.assert_close(got[0], want[0], **CLOSE)
    torch.testing.assert_close(got[1, 3:], want[1, 3:], **CLOSE)


def test_a_family_whose_attention_indexes_the_mask_is_refused():
    """GLM-MoE-DSA's sparse attention (as DeepSeek-V3.2's) indexes the mask tensor to pick the
    keys each query sees: apply_prior took it and every forward failed with TypeError:
    'PaddingLayout' object is not subscriptable. Refused by name, the model left as it was."""
    model = tiny_auto("glm_moe_dsa", vocab_size=100, hidden_size=64, intermediate_size=128,
                      moe_intermediate_size=32, num_hidden_layers=2, num_attention_heads=4,
                      num_key_value_heads=4, n_routed_experts=4, num_experts_per_tok=2,
                      kv_lora_rank=16, q_lora_rank=16, qk_rope_head_dim=8, v_head_dim=16,
                      qk_nope_head_dim=8, index_topk=4, index_head_dim=16, index_n_heads=2,
                      head_dim=8, first_k_dense_replace=1, pad_token_id=0)
    with pytest.raises(ValueError, match=r"model type 'glm_moe_dsa': its attention reads the "
                                         r"mask tensor itself"):
        apply_prior(model, "uniform", rope="keep")
    assert_untouched(model)
    # Doge's dynamic mask: its forward hands attention_mask to a helper of the class, which
    # indexes it (every forward failed: 'PaddingLayout' object has no attribute 'dtype')
    doge = tiny_auto("doge", vocab_size=100, hidden_size=32, intermediate_size=64,
                     num_hidden_layers=2, num_attention_heads=4, num_key_value_heads=2,
                     sliding_window=4)
    with pytest.raises(ValueError, match=r"model type 'doge': its attention reads the mask "
                                         r"tensor itself .* Doge's"):
        apply_prior(doge, "uniform", rope="keep")
    assert_untouched(doge)


def test_multimodal_rope_is_removed_in_a_language_model():
    """Qwen2-VL's M-RoPE hands its rotary embedding position_ids [3, batch, tokens] (a section
    per axis) for cos and sin of [batch, tokens, head_dim]: IdentityRotary gave [3, batch, ...]
    and every forward of its language model with rope="remove" failed (the size of tensor a
    must match...). Now a left-padded batch with images generates each row as alone."""
    text = dict(**{**TINY, "vocab_size": 200}, eos_token_id=None, bos_token_id=None,
                rope_parameters={"rope_type": "default", "mrope_section": [2, 3, 3],
                                 "rope_theta": 10000.0})
    vision = dict(depth=1, embed_dim=32, hidden_size=64, num_heads=2, patch_size=14,
                  spatial_merge_size=2, temporal_patch_size=2, in_chans=3)
    torch.manual_seed(0)
    model = transformers.Qwen2VLForConditionalGeneration(transformers.Qwen2VLConfig(
        text_config=text, vision_config=vision, image_token_id=150, video_token_id=151,
        vision_start_token_id=152, vision_end_token_id=153)).eval()
    apply_prior(model.model.language_model, ggd, rope="remove")
    image = [152, 150, 153]   # one merged token of a 2x2 patch grid
    prompts = [image + [5, 6, 7, 8, 9, 10], image + [11, 12, 13]]
    batch, mask = left_padded(prompts)
    pixels = torch.randn(8, 1176, generator=torch.Generator().manual_seed(2))
    grid = torch.tensor([[1, 2, 2], [1, 2, 2]])
    out = model.generate(batch, attention_mask=mask, pixel_values=pixels, image_grid_thw=grid,
                         mm_token_type_ids=(batch == 150).long(), max_new_tokens=4,
                         do_sample=False, pad_token_id=PAD)
    for row, prompt in enumerate(prompts):
        ids = torch.tensor([prompt])
        alone = model.generate(ids, pixel_values=pixels[4 * row:4 * row + 4],
                               image_grid_thw=grid[row:row + 1], mm_token_type_ids=(ids == 150).long(),
                               max_new_tokens=4, do_sample=False, pad_token_id=PAD)
        assert out[row, batch.shape[1]:].tolist() == alone[0, len(prompt):].tolist(), row


def _tiny_gemma3(window=64, **text):
    """A Gemma 3 (eager attention) of a tiny language model (sliding-window layers of
    ``window``) and a one-layer SigLIP tower (image token 110: 4 patches)."""
    text = dict(**{**TINY, "vocab_size": 120}, head_dim=16, sliding_window=window, **text)
    vision = dict(hidden_size=32, num_hidden_layers=1, num_attention_heads=2,
                  intermediate_size=64, image_size=32, patch_size=16)
    torch.manual_seed(0)
    config = transformers.Gemma3Config(
        text_config=text, vision_config=vision, mm_tokens_per_image=4, image_token_index=110,
        boi_token_index=111, eoi_token_index=112)
    config._attn_implementation = config.text_config._attn_implementation = "eager"
    return transformers.Gemma3ForConditionalGeneration(config).eval()


def _tiny_gemma3_with_images():
    """A Gemma 3 of two sliding-window layers, the prior in place."""
    model = _tiny_gemma3()
    apply_prior(model.model.language_model, "uniform", rope="keep")
    return model


def _tiny_embedding_gemma():
    """EmbeddingGemma's form: a Gemma 3 text model made bidirectional (its layers is_causal=False,
    its mask HF's causal one OR-ed with a rule that opens every key within the window)."""
    torch.manual_seed(0)
    cfg = transformers.Gemma3TextConfig(**TINY, head_dim=16, sliding_window=4,
                                        use_bidirectional_attention=True,
                                        layer_types=["sliding_attention", "full_attention"])
    cfg._attn_implementation = "eager"
    return transformers.Gemma3TextModel(cfg).eval()


_GEMMA3_IDS = torch.tensor([[5, 111, 110, 110, 110, 110, 112, 6, 7, 8]])
GEMMA3_IMAGE_CALL = dict(input_ids=_GEMMA3_IDS, token_type_ids=(_GEMMA3_IDS == 110).long(),
                         pixel_values=torch.randn(1, 3, 32, 32,
                                                  generator=torch.Generator().manual_seed(1)))


def _eager_with_reference_prior(module, query, key, value, attention_mask, scaling=None, **kwargs):
    """HF's eager attention (its mask as HF builds it for eager) plus the generalized Gaussian
    prior's bias, -(|d - mu| / alpha)^beta with d = i - j, read from the parameters of the
    prior that ``module.reference_prior`` holds (none: eager itself). Its calls are whole
    forwards without a cache, so d is the distance of the mask's rows and columns, padding
    or not."""
    groups = query.shape[1] // key.shape[1]
    key, value = key.repeat_interleave(groups, 1), value.repeat_interleave(groups, 1)
    scores = query @ key.transpose(2, 3) * scaling
    prior = module.__dict__.get("reference_prior")
    if prior is not None:
        values = {name: t[None, :, None, None] for name, t in prior.prior_params().items()}
        d = torch.arange(query.shape[2])[:, None] - torch.arange(key.shape[2])[None, :]
        scores = scores - ((d - values["mu"]).abs() / values["alpha"]) ** values["beta"]
    weights = torch.softmax(scores + attention_mask, dim=-1)
    return (weights @ value).transpose(1, 2).contiguous(), None


def _reference_of(model, reference):
    """``reference`` (a copy of ``model`` made before apply_prior) run by eager attention plus
    the bias of ``model``'s priors (the same parameters: their gradients reach both)."""
    from transformers import AttentionInterface
    from transformers.masking_utils import AttentionMaskInterface, eager_mask
    AttentionInterface.register("eager_reference_prior", _eager_with_reference_prior)
    AttentionMaskInterface.register("eager_reference_prior", eager_mask)
    reference.model.language_model.set_attn_implementation("eager_reference_prior")
    layers = zip(model.model.language_model.layers, reference.model.language_model.layers)
    for mine, theirs in layers:
        theirs.self_attn.__dict__["reference_prior"] = mine.self_attn.bamgen_prior
    return reference


# Two rows: one left-padded with an image block, one with two blocks (4 tokens each, the
# sliding layers' window 3: a block's first query sees keys 3 ahead, past the window's reach)
_GEMMA3_BLOCKS = torch.tensor([[0, 0, 5, 111, 110, 110, 110, 110, 112, 6, 7, 8, 9],
                               [5, 111, 110, 110, 110, 110, 112, 6, 111, 110, 110, 110, 110]])
GEMMA3_BLOCKS_CALL = dict(input_ids=_GEMMA3_BLOCKS, attention_mask=(_GEMMA3_BLOCKS != PAD).long(),
                          token_type_ids=(_GEMMA3_BLOCKS == 110).long(),
                          pixel_values=torch.randn(3, 3, 32, 32, generator=torch.Generator().manual_seed(1)))


def test_gemma3_image_blocks_attend_both_ways_as_eager_and_train_as_the_reference():
    """Gemma 3's multimodal model ORs a rule into the causal mask: an image's tokens see each
    other both ways (within the window, in its sliding layers). Such a call was refused; it
    now runs block by block: the zero prior equals eager on one and two image blocks per row,
    left padding, a sliding layer whose window is shorter than a block and a global one; a
    generalized Gaussian prior's logits and gradients (the prior's and the model's) equal
    eager attention with the prior's bias added."""
    own = _tiny_gemma3(window=3, layer_types=["sliding_attention", "full_attention"])
    reference = copy.deepcopy(own)
    model = copy.deepcopy(own)
    apply_prior(model.model.language_model, "uniform", rope="keep")
    real = GEMMA3_BLOCKS_CALL["attention_mask"].bool()
    text_alone = {k: v for k, v in GEMMA3_BLOCKS_CALL.items() if k != "token_type_ids"}
    with torch.no_grad():
        want = own(**GEMMA3_BLOCKS_CALL).logits
        torch.testing.assert_close(model(**GEMMA3_BLOCKS_CALL).logits[real], want[real], **CLOSE)
        assert (own(**text_alone).logits - want)[real].abs().max() > 1e-2   # (the rule bites)

    apply_prior(model.model.language_model, ggd, rope="keep", mu=0.3, beta=1.5)
    reference = _reference_of(model, reference)
    weights = torch.randn(want.shape, generator=torch.Generator().manual_seed(3)) * real[..., None]

    def run(which):
        model.zero_grad(set_to_none=True)
        reference.zero_grad(set_to_none=True)
        logits = which(**GEMMA3_BLOCKS_CALL).logits
        (logits * weights).sum().backward()
        grads = {name: p.grad for name, p in which.named_parameters() if p.grad is not None}
        priors = {name: p.grad for name, p in model.named_parameters() if "bamgen_prior" in name}
        return logits.detach()[real], grads, priors
    got, got_grads, got_priors = run(model)
    want, want_grads, want_priors = run(reference)
    torch.testing.assert_close(got, want, **CLOSE)
    assert len(got_priors) == 6 and all(g.abs().max() > 0 for g in got_priors.values())
    torch.testing.assert_close(got_priors, want_priors, **CLOSE)
    for name, grad in want_grads.items():   # (float32 sums over every token: to the tensor's scale)
        assert (got_grads[name] - grad).abs().max() <= 1e-5 * grad.abs().max(), name


def assert_generates_as(model, reference, prompt, **options):
    """``model`` generates 3 tokens greedily from ``prompt`` as ``reference`` does: the same
    tokens, and each step's logits to float32 rounding."""
    def generated(which):
        out = which.generate(**prompt, max_new_tokens=3, do_sample=False, pad_token_id=PAD,
                             return_dict_in_generate=True, output_logits=True, **options)
        return out.sequences[:, prompt["input_ids"].shape[1]:].tolist(), torch.stack(out.logits)
    (got_tokens, got), (want_tokens, want) = generated(model), generated(reference)
    assert got_tokens == want_tokens, options
    torch.testing.assert_close(got, want, **CLOSE)


def test_gemma3_generates_from_a_prompt_with_an_image_as_eager():
    """A left-padded batch of prompts holding an image block generates, with the zero prior,
    eager's tokens and step logits, with no cache (every step runs the blocks again), the
    dynamic cache and the static one (its slots past the prompt unwritten)."""
    own = _tiny_gemma3(window=3, layer_types=["sliding_attention", "full_attention"])
    model = copy.deepcopy(own)
    apply_prior(model.model.language_model, "uniform", rope="keep")
    ids = torch.tensor([[0, 0, 5, 111, 110, 110, 110, 110, 112, 6, 7],
                        [5, 111, 110, 110, 110, 110, 112, 6, 8, 9, 10]])
    prompt = dict(input_ids=ids, attention_mask=(ids != PAD).long(), token_type_ids=(ids == 110).long(),
                  pixel_values=GEMMA3_BLOCKS_CALL["pixel_values"][:2])
    caches = {"none": dict(use_cache=False), "dynamic": {}, "static": dict(cache_implementation="static")}

    for cache in caches.values():
        assert_generates_as(model, own, prompt, **cache)


def test_gemma3_text_alone_and_embedding_gemma_equal_eager():
    """Text alone with the token_type_ids Gemma 3's processor gives every prompt (all 0): the
    overlay is in the mask, but no token is in an image, so the mask is causal and it runs
    (it was refused); EmbeddingGemma's both-ways layers (is_causal False) equal eager."""
    model = _tiny_gemma3_with_images()
    text_ids = torch.tensor([[5, 6, 7, 8, 9]])
    text_types = torch.zeros_like(text_ids)
    with torch.no_grad():
        got = model(input_ids=text_ids, token_type_ids=text_types).logits
        want = _tiny_gemma3()(input_ids=text_ids, token_type_ids=text_types).logits
    torch.testing.assert_close(got, want, **CLOSE)
    out = model.generate(input_ids=text_ids, attention_mask=torch.ones_like(text_ids),
                         token_type_ids=text_types, max_new_tokens=2, do_sample=False)
    assert out.shape == (1, 7)

    ids = torch.randint(1, 100, (2, 11), generator=torch.Generator().manual_seed(1))
    mask = torch.ones_like(ids)
    mask[1, 8:] = 0
    want = _tiny_embedding_gemma()(ids, attention_mask=mask).last_hidden_state
    got = apply_prior(_tiny_embedding_gemma(), "uniform", rope="keep")(ids, attention_mask=mask).last_hidden_state
    torch.testing.assert_close(got[0], want[0], **CLOSE)
    torch.testing.assert_close(got[1, :8], want[1, :8], **CLOSE)


@pytest.mark.parametrize("layers", [2, 4])
def test_a_left_padded_step_reads_its_layout_once_whatever_its_layers(monkeypatch, layers):
    """Every layer's attention call gets the forward's one layout (per-row offsets of the left
    padding). On a GPU each host read of it waits for the queue: the model's forward keeps
    what the first layer read for the others (host_reads.kept, entered by apply_prior's hooks),
    so a decode step makes the same facts at 2 layers as at 4, and keeps none after it. The
    model still pickles whole (the hooks hold no open scope)."""
    import io

    from bamgen.runtime import host_reads
    monkeypatch.setattr(host_reads, "reads_wait", lambda tensor: True)
    torch.manual_seed(0)
    model = apply_prior(LlamaForCausalLM(LlamaConfig(**{**TINY, "num_hidden_layers": layers})).eval(), ggd)
    ids, mask = left_padded(PROMPTS)
    with torch.no_grad():
        out = model(ids, attention_mask=mask, use_cache=True)
        token = out.logits[:, -1].argmax(-1, keepdim=True)
        mask = torch.cat([mask, torch.ones_like(token)], 1)
        before = host_reads.HOST_READS.reads
        model(token, attention_mask=mask, past_key_values=out.past_key_values, use_cache=True)
    assert host_reads.HOST_READS.reads - before == 2   # (q_offset's and k_offset's ranges)
    assert not host_reads.HOST_READS.kept
    torch.save(model, io.BytesIO())


def test_a_compiled_gemma3_refuses_images_and_runs_text_alone():
    """Under torch.compile the mask function's rule is not evaluated over the tokens (a graph
    may not branch on them), and a compiled Gemma 3 given an image ran it causal, silently. A
    compiled call whose inputs carry the rule (images, or token_type_ids at all: their rule is
    in the mask whatever they mark) is now refused, on a model of sliding-window layers alone
    too (their mask ANDs the window over the rule); text alone compiles with no graph break and
    equals the eager call."""
    model = _tiny_gemma3_with_images()
    text = torch.tensor([[5, 6, 7, 8, 9]])
    compiled = torch.compile(lambda **kw: model(**kw).logits, backend="eager")
    refusal = r"its mask lets some queries see keys after them.*under torch.compile.*without token_type_ids"
    with torch.no_grad():
        with pytest.raises(ValueError, match=refusal):
            compiled(**GEMMA3_IMAGE_CALL)
        with pytest.raises(ValueError, match=refusal):
            compiled(input_ids=text, token_type_ids=torch.zeros_like(text))
        torch.testing.assert_close(compiled(input_ids=text), model(input_ids=text).logits, **CLOSE)
        explained = torch._dynamo.explain(lambda **kw: model(**kw).logits)(input_ids=text)
    assert explained.graph_break_count == 0, explained.break_reasons


def test_prior_parameters_are_made_float32_and_follow_a_cast(tmp_path):
    """The prior's parameters are created float32 in a model of any dtype (apply_prior on a
    bf16 model; from_pretrained(dtype=torch.bfloat16), as HF keeps its _keep_in_fp32_modules),
    and follow an explicit cast like every parameter (model.to(torch.bfloat16)): a model cast
    whole stays of one dtype, which FSDP's flattening requires. Keeping them float32 under the
    cast too was tried and broke FSDP1 and FSDP2 on a bf16 model (docs/huggingface.md,
    "Precision")."""
    def prior_dtypes(model):
        return {p.dtype for name, p in model.named_parameters() if "bamgen_prior" in name}
    torch.manual_seed(0)
    built = apply_prior(LlamaForCausalLM(LlamaConfig(**TINY)).to(torch.bfloat16), ggd)
    assert prior_dtypes(built) == {torch.float32}
    model = tiny_llama()
    want = prior_params(model)
    model.save_pretrained(tmp_path)
    back = from_pretrained(tmp_path, dtype=torch.bfloat16)
    assert back.model.embed_tokens.weight.dtype == torch.bfloat16
    assert prior_dtypes(back) == {torch.float32}
    assert all(torch.equal(got, want[name]) for name, got in prior_params(back).items())
    assert prior_dtypes(back.to(torch.bfloat16)) == {torch.bfloat16}
    assert {p.dtype for p in back.parameters()} == {torch.bfloat16}


@pytest.mark.parametrize("first,then", [(True, False), (False, True)], ids=["shared-then-own", "own-then-shared"])
def test_apply_prior_again_with_the_other_sharing_keeps_no_earlier_parameters(first, then):
    """apply_prior again replaces the prior: with the other `shared`, the earlier prior's
    modules stayed registered (the base model's shared one, or each layer's own), their
    parameters in parameters() and the state dict, never used and never given a gradient. The
    model now holds exactly what one apply_prior with the second setting gives, and computes
    the same logits."""
    torch.manual_seed(0)
    twice = LlamaForCausalLM(LlamaConfig(**TINY)).eval()
    once = copy.deepcopy(twice)
    apply_prior(twice, "laplace", shared=first)
    apply_prior(twice, "laplace", shared=then)
    apply_prior(once, "laplace", shared=then)
    assert list(twice.state_dict()) == list(once.state_dict())
    assert [name for name, _ in twice.named_parameters()] == [name for name, _ in once.named_parameters()]
    ids, mask = left_padded(PROMPTS)
    logits = twice(ids, attention_mask=mask).logits
    torch.testing.assert_close(logits, once(ids, attention_mask=mask).logits, rtol=0, atol=0)
    logits.square().mean().backward()
    unused = [name for name, p in twice.named_parameters() if "bamgen_prior" in name and p.grad is None]
    assert not unused, unused


def test_output_attentions_is_refused_by_name():
    """bamgen's kernels never hold the attention weights whole: output_attentions=True returned
    an empty tuple, silently. Refused by name (transformers itself refuses setting
    config.output_attentions under an implementation other than eager)."""
    model = tiny_llama()
    ids, mask = left_padded(PROMPTS)
    with pytest.raises(ValueError, match="output_attentions=True: bamgen's attention does not form"):
        model(ids, attention_mask=mask, output_attentions=True)
    assert model(ids, attention_mask=mask, output_attentions=False).logits.shape == (3, 7, 100)


def test_a_model_pickled_whole_runs_in_a_fresh_process(tmp_path):
    """torch.save(model) of a model with its priors, loaded by a fresh process that never
    called apply_prior: the "bamgen" attention implementation was not registered there
    (KeyError from transformers). Unpickling imports the integration, which registers it; the
    loaded model gives the same logits."""
    model = tiny_llama()
    ids, mask = left_padded(PROMPTS)
    with torch.no_grad():
        want = model(ids, attention_mask=mask).logits
    torch.save({"model": model, "ids": ids, "mask": mask, "want": want}, tmp_path / "model.pt")
    code = ("import torch\n"
            f"saved = torch.load({str(tmp_path / 'model.pt')!r}, weights_only=False)\n"
            "with torch.no_grad():\n"
            "    got = saved['model'](saved['ids'], attention_mask=saved['mask']).logits\n"
            "print((got - saved['want']).abs().max().item())\n")
    run = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, timeout=600)
    assert run.returncode == 0, run.stderr[-2000:]
    assert float(run.stdout.strip()) == 0.0


CAUSAL_ONLY = """name: log_decay
causal_only: true
log_prior: -r*log(1 + d)
params:
  r: {init: 1.0, domain: positive}
"""


def test_a_causal_only_prior_in_bidirectional_attention_names_is_causal(tmp_path):
    """A prior declared causal_only in a layer that attends both ways (a call's
    is_causal=False) was refused with the generated module's advice (causal=True), an argument
    an HF user never passes. The refusal now names what an HF model sets: is_causal."""
    path = tmp_path / "log_decay.yaml"
    path.write_text(CAUSAL_ONLY)
    model = tiny_llama(prior=str(path))
    ids, mask = left_padded(PROMPTS)
    assert torch.isfinite(model(ids, attention_mask=mask).logits).all()
    with pytest.raises(ValueError, match=r"bidirectional \(the layer's is_causal, or the call's "
                                         r"is_causal=False\), and the prior 'log_decay' is causal only"):
        model(ids, attention_mask=mask, is_causal=False)


def _tiny_paligemma(attn="eager"):
    """A PaliGemma of a tiny Gemma (its layers is_causal=False: PaliGemmaConfig defaults
    use_bidirectional_attention to True) and a one-layer SigLIP tower (image token 110: 4
    patches)."""
    torch.manual_seed(0)
    config = transformers.PaliGemmaConfig(
        text_config=dict(model_type="gemma", **{**TINY, "vocab_size": 120}, head_dim=16),
        vision_config=dict(hidden_size=32, num_hidden_layers=1, num_attention_heads=2,
                           intermediate_size=64, image_size=32, patch_size=16),
        image_token_index=110, projection_dim=64)
    config._attn_implementation = attn
    config.text_config._attn_implementation = attn
    return transformers.PaliGemmaForConditionalGeneration(config).eval()


_PALI_IDS = torch.tensor([[110] * 4 + [2, 5, 6, 7, 8]])
PALI_PIXELS = torch.randn(1, 3, 32, 32, generator=torch.Generator().manual_seed(1))


def test_paligemma_runs_its_prefix_both_ways_and_its_suffix_causal_as_eager():
    """PaliGemma's Gemma layers say is_causal=False and the causal rule lives in its mask alone
    (OR-ed with the prefix's rule), which HF's eager attention applies: bamgen took the layers'
    word and ran text alone both ways, silently (the zero prior off by 0.09 against eager). The
    call's direction is now read from the mask: text alone, left-padded rows included, equals
    eager, and so does a prompt that is all prefix (token_type_ids all 0, the image too), whose
    mask is the same both ways. A prefix followed by a suffix, refused before, runs the prefix
    both ways and the suffix causal, equal to eager in a left-padded batch and through
    generate(). A prefix that is not one run of
    tokens is refused by name, and under torch.compile any prefix with a suffix; compiled text
    alone equals eager with no graph break."""
    def both(**call):
        with torch.no_grad():
            return model(**call).logits, _tiny_paligemma()(**call).logits
    model = _tiny_paligemma()
    apply_prior(model.model.language_model, "uniform", rope="keep")
    ids, mask = left_padded([[5, 6, 7, 8, 9, 10], [11, 12, 13]])
    got, want = both(input_ids=ids, attention_mask=mask)
    torch.testing.assert_close(got[0], want[0], **CLOSE)
    torch.testing.assert_close(got[1, 3:], want[1, 3:], **CLOSE)
    prefix = torch.zeros_like(_PALI_IDS)
    torch.testing.assert_close(*both(input_ids=_PALI_IDS, pixel_values=PALI_PIXELS,
                                     token_type_ids=prefix), **CLOSE)

    ids, mask = left_padded([[110] * 4 + [2, 5, 6, 7, 8], [110] * 4 + [2, 5, 6]])
    types = torch.tensor([[0] * 6 + [1] * 3, [0] * 2 + [0] * 6 + [1]])   # (padding: 0, as the prefix)
    suffix = dict(input_ids=ids, attention_mask=mask, token_type_ids=types,
                  pixel_values=PALI_PIXELS.repeat(2, 1, 1, 1))
    got, want = both(**suffix)
    torch.testing.assert_close(got[mask.bool()], want[mask.bool()], **CLOSE)
    with torch.no_grad():
        causal = _tiny_paligemma()(**{**suffix, "token_type_ids": torch.ones_like(types)}).logits
    assert (causal - want)[mask.bool()].abs().max() > 1e-2   # (the rule bites)

    assert_generates_as(model, _tiny_paligemma(), suffix)

    refusal = r"model type 'gemma': its mask lets some queries see keys after them"
    with pytest.raises(ValueError, match=refusal + r".*each query's keys are one range"):
        model(input_ids=_PALI_IDS, pixel_values=PALI_PIXELS,
              token_type_ids=torch.tensor([[0] * 4 + [1] * 2 + [0] * 3]))
    compiled = torch.compile(lambda **kw: model(**kw).logits, backend="eager")
    text = torch.tensor([[5, 6, 7, 8, 9]])
    with torch.no_grad():
        with pytest.raises(ValueError, match=refusal + r".*under torch.compile"):
            compiled(**suffix)
        torch.testing.assert_close(compiled(input_ids=text), _tiny_paligemma()(input_ids=text).logits, **CLOSE)
        explained = torch._dynamo.explain(lambda **kw: model(**kw).logits)(input_ids=text)
    assert explained.graph_break_count == 0, explained.break_reasons


def test_paligemma_runs_without_a_cache():
    """PaliGemma hands its language model the one mask it built, which HF builds again there
    and, with no cache, sizes by the mask's shape: every forward with use_cache=False (a
    training step, generate() without a cache) failed ('PaddingLayout' object has no attribute
    'shape'). Now a training step's loss equals eager's and its gradients reach the prior, and
    generate() without a cache (each step a longer suffix after the prefix) gives eager's
    tokens and logits."""
    model = _tiny_paligemma()
    apply_prior(model.model.language_model, ggd, rope="keep")
    ids = torch.tensor([[110] * 4 + [2, 5, 6, 7, 8]])
    types = torch.tensor([[0] * 6 + [1] * 3])
    call = dict(input_ids=ids, token_type_ids=types, pixel_values=PALI_PIXELS, use_cache=False)
    loss = model(**call, labels=ids).loss
    loss.backward()
    assert all(p.grad is not None and torch.isfinite(p.grad).all()
               for name, p in model.named_parameters() if "bamgen_prior" in name)

    zero = _tiny_paligemma()
    apply_prior(zero.model.language_model, "uniform", rope="keep")
    with torch.no_grad():
        torch.testing.assert_close(zero(**call, labels=ids).loss,
                                   _tiny_paligemma()(**call, labels=ids).loss, **CLOSE)

    assert_generates_as(zero, _tiny_paligemma(), call)


def test_embedding_gemma_stays_bidirectional_compiled_too():
    """EmbeddingGemma's layers say is_causal=False and its own mask ORs a rule that opens every
    key (within its sliding layers' window) into HF's causal mask: the mask's direction is both
    ways, eager and compiled (whose mask's form does not tell: the model built it itself), and
    the zero prior equals eager."""
    ids = torch.randint(1, 100, (1, 11), generator=torch.Generator().manual_seed(1))
    model = apply_prior(_tiny_embedding_gemma(), "uniform", rope="keep")
    compiled = torch.compile(lambda **kw: model(**kw).last_hidden_state, backend="eager")
    with torch.no_grad():
        want = _tiny_embedding_gemma()(ids).last_hidden_state
        torch.testing.assert_close(model(ids).last_hidden_state, want, **CLOSE)
        torch.testing.assert_close(compiled(input_ids=ids), want, **CLOSE)


def _tiny_gemma4(text_only=True, **text):
    """A tiny Gemma 4 (eager attention): its text model (a sliding-window layer of window 4,
    then a global one), or that language model in a multimodal Gemma 4 with a one-layer vision
    tower whose sliding layers let an image's tokens (``mm_token_type_ids``) attend both ways."""
    config = transformers.Gemma4TextConfig(
        **TINY, head_dim=16, global_head_dim=32, sliding_window=4, initializer_range=0.2,
        layer_types=["sliding_attention", "full_attention"], vocab_size_per_layer_input=100,
        hidden_size_per_layer_input=8, **text)
    config._attn_implementation = "eager"
    torch.manual_seed(0)
    if text_only:
        return transformers.Gemma4ForCausalLM(config).eval()
    vision = transformers.Gemma4VisionConfig(
        hidden_size=32, intermediate_size=64, num_hidden_layers=1, num_attention_heads=2,
        num_key_value_heads=2, head_dim=16, patch_size=4, position_embedding_size=64)
    whole = transformers.Gemma4Config(
        text_config=config.to_dict(), vision_config=vision.to_dict(), audio_config=None,
        image_token_id=90, boi_token_id=91, eoi_token_id=92, boa_token_id=93, eoa_token_id=94,
        audio_token_id=95)
    whole._attn_implementation = "eager"
    return transformers.Gemma4ForConditionalGeneration(whole).eval()


def test_gemma4_made_bidirectional_sees_its_window_as_eager():
    """Gemma 4's use_bidirectional_attention="all" makes its text model bidirectional through
    its config (is_causal=False): HF's sliding layers' window shows |q - k| <= W, and bamgen's
    hid |d| >= W (the zero prior off by 2.7 to 5.3 against eager in an outside test, its
    global layers matching). Now equal, eager and compiled, padded rows included."""
    ids = torch.randint(1, 100, (2, 11), generator=torch.Generator().manual_seed(1))
    mask = torch.ones_like(ids)
    mask[1, :3] = 0
    want = _tiny_gemma4(use_bidirectional_attention="all")(ids, attention_mask=mask).logits
    model = apply_prior(_tiny_gemma4(use_bidirectional_attention="all"), "uniform", rope="keep")
    compiled = torch.compile(lambda **kw: model(**kw).logits, backend="aot_eager", fullgraph=True)
    with torch.no_grad():
        for got in (model(ids, attention_mask=mask).logits, compiled(input_ids=ids, attention_mask=mask)):
            torch.testing.assert_close(got[0], want[0], **CLOSE)
            torch.testing.assert_close(got[1, 3:], want[1, 3:], **CLOSE)


def test_gemma4_vision_blocks_equal_eager_and_a_compiled_call_refuses_them():
    """Gemma 4 ORs its image rule (``mm_token_type_ids``) into its sliding layers' mask alone,
    under the window; its global layers' mask is plain causal. Eager, such a call was refused;
    it now runs its sliding layers block by block and equals eager (two blocks in a row, one
    longer than the window of 4, left padding). Compiled, no mask showed the rule and the call
    ran causal, silently (off by 2.86 from eager): the sliding layers' mask, handed without a
    window of HF's own (the model ANDs the window over the rule itself), marks every mask of
    the call, which is refused; text alone compiles and equals the eager call."""
    model = _tiny_gemma4(text_only=False, use_bidirectional_attention="vision")
    own = copy.deepcopy(model)
    apply_prior(model.model.language_model, "uniform", rope="keep")
    ids = torch.randint(1, 90, (2, 13), generator=torch.Generator().manual_seed(1))
    mask = torch.ones_like(ids)
    mask[1, :3] = 0
    image = torch.zeros_like(ids)
    image[0, 2:5] = image[0, 7:12] = image[1, 5:8] = 1   # blocks of vision tokens
    refusal = (r"model type 'gemma4_text': its mask lets some queries see keys after them"
               r".*under torch.compile.*without token_type_ids, mm_token_type_ids")
    compiled = torch.compile(lambda **kw: model(**kw).logits, backend="aot_eager")
    with torch.no_grad():
        want = own(input_ids=ids, attention_mask=mask, mm_token_type_ids=image).logits
        got = model(input_ids=ids, attention_mask=mask, mm_token_type_ids=image).logits
        torch.testing.assert_close(got[0], want[0], **CLOSE)
        torch.testing.assert_close(got[1, 3:], want[1, 3:], **CLOSE)
        causal = own(input_ids=ids, attention_mask=mask).logits
        assert (causal - want)[mask.bool()].abs().max() > 1e-2   # (the rule bites)
        with pytest.raises(ValueError, match=refusal):
            compiled(input_ids=ids, attention_mask=mask, mm_token_type_ids=image)
        got = compiled(input_ids=ids, attention_mask=mask)
    torch.testing.assert_close(got[0], causal[0], **CLOSE)
    torch.testing.assert_close(got[1, 3:], causal[1, 3:], **CLOSE)
