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
