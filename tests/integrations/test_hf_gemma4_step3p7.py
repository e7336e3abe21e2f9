"""Gemma 4's and Step3p7's text models with a prior (bamgen/integrations/transformers.py):
what their configs add to the families of tests/integrations/test_hf.py (per-layer-type head
dims, KV-shared layers, a bidirectional switch, per-layer head counts), on tiny random-init
models built from a config, compared with the family's own eager attention."""
import torch
import transformers

import pytest
from bamgen.integrations.transformers import IdentityRotary, apply_prior

TINY = dict(hidden_size=64, num_hidden_layers=2, num_attention_heads=4, num_key_value_heads=2,
            intermediate_size=128, vocab_size=100, pad_token_id=0)
CLOSE = dict(rtol=1e-5, atol=1e-5)


def tiny_gemma4(seed=0, **config):
    """A Gemma 4 text model whose sliding layers have head dim 16 and global ones 32 (its
    global_head_dim: the real configs' 256 and 512), with per-layer inputs, eager attention."""
    torch.manual_seed(seed)
    cfg = transformers.Gemma4TextConfig(**{
        **TINY, "head_dim": 16, "global_head_dim": 32, "sliding_window": 4,
        "layer_types": ["sliding_attention", "full_attention"], "vocab_size_per_layer_input": 100,
        "hidden_size_per_layer_input": 8, **config})
    cfg._attn_implementation = "eager"
    return transformers.Gemma4ForCausalLM(cfg).eval()


def left_padded_batch(seed=1, length=11, pad=4):
    ids = torch.randint(1, 100, (2, length), generator=torch.Generator().manual_seed(seed))
    mask = torch.ones_like(ids)
    ids[1, :pad], mask[1, :pad] = 0, 0
    return ids, mask


def without_rotation(model):
    """``model`` with every rotary frequency 0 (cos 1, sin 0 for each layer type): HF's own
    attention with no positional rotation, to compare rope='remove' with."""
    for name, buffer in model.named_buffers():
        if name.endswith("inv_freq"):
            buffer.zero_()
    return model


def test_gemma4_rope_remove_serves_each_layer_type_its_own_head_dim():
    """Gemma 4's sliding and global layers have different head dims (head_dim, global_head_dim)
    and one rotary embedding serves both: rope='remove' gave every layer type the widest
    identity, and every forward failed (the size of tensor a (16) must match the size of
    tensor b (32)). Each layer type now gets its own width, and the zero prior equals HF's
    eager attention without rotation, padded rows included."""
    model = apply_prior(tiny_gemma4(), "uniform", rope="remove")
    assert isinstance(model.model.rotary_emb, IdentityRotary)
    ids, mask = left_padded_batch()
    with torch.no_grad():
        got = model(ids, attention_mask=mask).logits
        want = without_rotation(tiny_gemma4())(ids, attention_mask=mask).logits
    torch.testing.assert_close(got[0], want[0], **CLOSE)
    torch.testing.assert_close(got[1, 4:], want[1, 4:], **CLOSE)


KV_SHARED = dict(num_hidden_layers=4, layer_types=["sliding_attention", "full_attention"] * 2,
                 num_kv_shared_layers=2)


@pytest.mark.parametrize("rope", ["keep", "remove"])
def test_gemma4_kv_shared_layers_equal_eager_on_the_queries_they_keep(rope):
    """Gemma 4's KV-shared layers (num_kv_shared_layers, as its E2B/E4B checkpoints) read the
    keys of earlier layers, and HF runs them on the last logits_to_keep queries alone, slicing
    each layer type's mask as a 4-D tensor (mask[:, :, -k:, :]): every prefill and generate()
    failed ('PaddingLayout' object is not subscriptable). The layout now takes that slice
    (the queries kept start later, the keys are the same): the zero prior equals HF's eager
    attention for every logits_to_keep, and generate() gives its tokens with either cache."""
    def eager():
        model = tiny_gemma4(**KV_SHARED)
        return model if rope == "keep" else without_rotation(model)
    model = apply_prior(tiny_gemma4(**KV_SHARED), "uniform", rope=rope)
    ids, mask = left_padded_batch(length=9, pad=3)
    with torch.no_grad():
        for keep in (0, 1, 3):
            got = model(ids, attention_mask=mask, logits_to_keep=keep).logits
            want = eager()(ids, attention_mask=mask, logits_to_keep=keep).logits
            real = mask[:, -got.shape[1]:].bool()
            torch.testing.assert_close(got[real], want[real], **CLOSE, msg=f"logits_to_keep={keep}")
    for cache in ({}, dict(cache_implementation="static")):
        call = dict(attention_mask=mask, max_new_tokens=4, do_sample=False, pad_token_id=0,
                    output_scores=True, return_dict_in_generate=True, **cache)
        got, want = model.generate(ids, **call), eager().generate(ids, **call)
        assert torch.equal(got.sequences, want.sequences), cache
        torch.testing.assert_close(torch.stack(got.scores), torch.stack(want.scores), **CLOSE)


def tiny_step3p7(seed=0, **config):
    """A Step3p7 text model (a sliding layer of window 4, a global one, dense MLPs), eager."""
    from transformers.models.step3p7.configuration_step3p7 import Step3p7TextConfig
    from transformers.models.step3p7.modeling_step3p7 import Step3p7TextModel
    torch.manual_seed(seed)
    cfg = Step3p7TextConfig(**{
        **TINY, "head_dim": 16, "sliding_window": 4,
        "layer_types": ["sliding_attention", "full_attention"], "mlp_layer_types": ["dense"] * 2,
        "num_local_experts": 2, "n_routed_experts": 2, "num_experts_per_tok": 1,
        "moe_intermediate_size": 32, "share_expert_dim": 32, **config})
    cfg._attn_implementation = "eager"
    return Step3p7TextModel(cfg).eval()


def in_two_chunks(model, ids, mask, cache):
    """The hidden states of ``ids`` run as a prompt of 8 tokens, then 3 more through ``cache``."""
    first = model(ids[:, :8], attention_mask=mask[:, :8], past_key_values=cache, use_cache=True)
    rest = model(ids[:, 8:], attention_mask=mask, past_key_values=cache, use_cache=True)
    return first.last_hidden_state, rest.last_hidden_state


@pytest.mark.parametrize("padded", [False, True])
def test_step3p7_use_bidirectional_attention_runs_both_ways_as_its_mask(padded):
    """Step3p7's use_bidirectional_attention=True keeps its layers is_causal=True and ORs a rule
    into the causal mask that opens every key (its window's, on sliding layers): the mask is
    the same both ways. Text alone was refused as Gemma 3's image tokens ('use inputs without
    that rule (text alone ...)'). It now runs both ways, as HF's eager attention applies the
    mask: the zero prior equals eager, in one call and in two through a dynamic or a static
    cache (whose slots past the written ones the token mask hides, as HF's mask does)."""
    from transformers import DynamicCache, StaticCache
    ids, mask = left_padded_batch(pad=3 if padded else 0)
    model = apply_prior(tiny_step3p7(use_bidirectional_attention=True), "uniform", rope="keep")
    eager = tiny_step3p7(use_bidirectional_attention=True)
    real = mask.bool()
    with torch.no_grad():
        got, want = model(ids, attention_mask=mask), eager(ids, attention_mask=mask)
        torch.testing.assert_close(got.last_hidden_state[real], want.last_hidden_state[real], **CLOSE)
        for cache in (lambda: DynamicCache(config=eager.config),
                      lambda: StaticCache(config=eager.config, max_cache_len=20)):
            got = torch.cat(in_two_chunks(model, ids, mask, cache()), dim=1)
            want = torch.cat(in_two_chunks(eager, ids, mask, cache()), dim=1)
            torch.testing.assert_close(got[real], want[real], **CLOSE)


def test_step3p7_use_bidirectional_attention_compiled_is_refused_by_its_config_field():
    """Under torch.compile the rule OR-ed into the mask cannot be evaluated, and the layers say
    causal: the call is refused, naming the config field that sets the rule (it named Gemma
    3's image tokens and asked for text alone, which the call already was)."""
    model = apply_prior(tiny_step3p7(use_bidirectional_attention=True), "uniform", rope="keep")
    compiled = torch.compile(model, backend="eager")
    with pytest.raises(ValueError, match=r"model type 'step3p5': its config's "
                                         r"use_bidirectional_attention=True .* call the model "
                                         r"uncompiled, or build it with "
                                         r"use_bidirectional_attention=False"):
        compiled(torch.tensor([[5, 6, 7, 8, 9]]))


def test_step3p7_per_layer_head_counts_are_refused_by_name():
    """num_sliding_attention_heads gives sliding layers their own head count (a per-layer
    num_attention_heads): apply_prior let transformers' AmbiguousGlobalPerLayerAttributeError
    out. It raises a ValueError naming the family, the field and the fix, the model untouched;
    with the same head count for every layer it runs."""
    model = tiny_step3p7(num_sliding_attention_heads=2)
    with pytest.raises(ValueError, match=r"model type 'step3p5': its config sets "
                                         r"num_attention_heads per layer .* from "
                                         r"num_sliding_attention_heads=2.* build the model with "
                                         r"num_sliding_attention_heads=4 \(or unset\)"):
        apply_prior(model, "uniform", rope="keep")
    assert model.config._attn_implementation == "eager"
    assert not any(name.endswith("bamgen_prior") for name, _ in model.named_modules())
    same = apply_prior(tiny_step3p7(num_sliding_attention_heads=4), "uniform", rope="keep")
    ids = torch.tensor([[5, 6, 7, 8, 9]])
    torch.testing.assert_close(same(ids).last_hidden_state,
                               tiny_step3p7(num_sliding_attention_heads=4)(ids).last_hidden_state, **CLOSE)
