"""The dQ kernel's steady run (SPLIT_STEADY, tiles.dq_splits_steady): the key tiles that every
row of a whole query tile sees whole go through a loop with no causal or bounds mask. Under the
interpreter, from the user's side: every layout a user brings (causal and bidirectional,
a continuation after cached keys, a key mask, packed documents, position tensors, a window)
gives the same bits with the split as without it, for the output and every gradient; and each
launch takes the flag its GPU family's table gives."""
from __future__ import annotations

import importlib

import pytest
import torch

from bamgen.runtime.triton import launch
from bamgen.runtime.triton.tiles import DQ_STEADY_AT, dq_splits_steady
from tests.helpers import gqa_call_grads

MODULES = {name: importlib.import_module(f"generated.{name}")
           for name in ("uniform", "laplace", "generalized_gaussian", "bam_ssmax", "forget_gate")}
# 70 rows: with the interpreter's dQ tile (32 rows, 16 keys) the middle query tile is whole and
# past two whole key tiles (the steady run runs), the last one ragged (it does not)
N = 70


def _call(module, layout, seed=11):
    """One call in a layout: its output and every gradient (q, k, v, the learnable parameters)."""
    g = torch.Generator().manual_seed(seed)
    nq, nk, batch, kw = N, N, 2, dict(causal=True)
    if layout == "bidirectional":
        kw = dict(causal=False)
    elif layout == "continuation":   # 40 new queries after 30 cached keys
        nq, kw = 40, dict(causal=True, q_offset=30)
    elif layout == "key_mask":   # a left-padded row beside a full one
        mask = torch.ones(2, nk, dtype=torch.bool)
        mask[0, :5] = False
        kw = dict(causal=True, key_mask=mask)
    elif layout == "packed":
        cu = torch.tensor([0, 3, 67, 70], dtype=torch.int32)   # (the second: 64 rows)
        batch, kw = 1, dict(causal=True, cu_seqlens_q=cu, cu_seqlens_k=cu)
    elif layout == "positions":   # a gated model's positions: the cumulative log of its gates
        gates = torch.nn.functional.logsigmoid(torch.randn(1, 2, nk, generator=g) + 3)
        pos = gates.cumsum(-1)
        batch, kw = 1, dict(causal=True, pos_q=pos, pos_k=pos)
    return gqa_call_grads(module, g, batch, nq, nk, **kw)


class _Spy:
    """The prior's dQ kernel, recording the SPLIT_STEADY of each launch."""

    def __init__(self, kernel, seen):
        self.kernel, self.seen = kernel, seen

    def __getitem__(self, grid):
        def run(*args, **kwargs):
            self.seen.append(kwargs["SPLIT_STEADY"])
            return self.kernel[grid](*args, **kwargs)
        return run


def _spy_dq(module, monkeypatch):
    seen = []
    kernels = module._prior.kernels().kernels
    monkeypatch.setitem(kernels, "bwd_dq", _Spy(kernels["bwd_dq"], seen))
    return seen


@pytest.mark.parametrize("layout", ["causal", "bidirectional", "continuation", "key_mask", "packed"])
@pytest.mark.parametrize("name", ["uniform", "laplace", "generalized_gaussian", "bam_ssmax"])
def test_the_steady_run_gives_the_bits_of_one_masked_loop(name, layout, monkeypatch):
    """With the split and without it, the same output and gradients, bit for bit: the steady
    run leaves out only where()s that select every score it sees (NoPE; a ramp, ALiBi; a table
    prior with three learnable parameters, GGD; a score other than s + log_prior, SSMax)."""
    module = MODULES[name]
    seen = _spy_dq(module, monkeypatch)
    split = _call(module, layout)
    assert seen and all(seen)   # (the interpreter splits: both loops run)
    monkeypatch.setattr(launch, "dq_split_steady", lambda prior, device, head_dim: False)
    whole = _call(module, layout)
    assert not any(seen[len(seen) // 2:])
    for got, want in zip(split, whole, strict=True):
        assert torch.equal(got, want), layout


def test_positions_from_the_model_give_the_same_bits_split_or_not(monkeypatch):
    """FoX's positions as tensors (its gates' cumulative log): the interpreter splits its dQ
    loop too (on a GPU the kernels of positions as tensors do not: tiles.DQ_STEADY_AT), and
    the steady run computes what one masked loop does, the positions' gradients included."""
    module = MODULES["forget_gate"]
    split = _call(module, "positions")
    monkeypatch.setattr(launch, "dq_split_steady", lambda prior, device, head_dim: False)
    whole = _call(module, "positions")
    for got, want in zip(split, whole, strict=True):
        assert torch.equal(got, want)


@pytest.mark.parametrize("family", ["sm_80", "sm_90"])
@pytest.mark.parametrize("name", ["uniform", "generalized_gaussian", "bam_ssmax"])
def test_each_launch_takes_its_family_s_flag(name, family, monkeypatch):
    """Under a GPU family's tiles (BAMGEN_INTERPRET_TILES) the dQ launch takes the split where
    DQ_STEADY_AT names its tile kind, family and head dim (the light kind on both families,
    the table and general kinds at head dim 64 on sm_90 alone), and computes the bits of one
    masked loop either way."""
    module = MODULES[name]
    monkeypatch.setenv("BAMGEN_INTERPRET_TILES", family)
    seen = _spy_dq(module, monkeypatch)
    got = _call(module, "causal")
    want_flag = dq_splits_steady(module._prior.traits.tile_kind, family, 16)
    assert want_flag == ((module._prior.traits.tile_kind, family, 64) in DQ_STEADY_AT)
    assert seen and all(flag == want_flag for flag in seen), (seen, want_flag)
    monkeypatch.setattr(launch, "dq_split_steady", lambda prior, device, head_dim: not want_flag)
    other = _call(module, "causal")
    for g, w in zip(got, other, strict=True):
        assert torch.equal(g, w)


def test_the_kernels_of_positions_as_tensors_do_not_split_on_a_gpu():
    """The positional kinds are not in DQ_STEADY_AT: their loops are bound by the positions'
    work, and their registers are where they were (tests/gpu/test_aot.py's positional matrix)."""
    kinds = {kind for kind, _, _ in DQ_STEADY_AT}
    assert kinds == {"light", "table", "general"}
    positional = MODULES["forget_gate"]._prior.positional.traits.tile_kind
    assert positional.startswith("positions")
    assert not any(dq_splits_steady(positional, arch, d) for arch in ("sm_80", "sm_90")
                   for d in (64, 128))
