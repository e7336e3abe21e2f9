"""The runtime as a library, tested directly: the traits the compiler prints read back as the
compiler made them; a prior's instance of the Triton kernels holds its own flags and hooks and
leaves the library's and other priors' alone; a module built for another runtime refuses to
import; the module binds to one Prior whose state (ops, decode tables) is per prior."""
import dataclasses
import importlib

import pytest
import torch

import bamgen
from bamgen.compiler import lower
from bamgen.compiler.codegen import _traits_source, traits
from bamgen.compiler.spec import load_spec
from bamgen.compiler.symbolic import analyse
from bamgen.resources import shipped_priors
from bamgen.runtime import GRAD_LOGIT_FACTOR, GRAD_TABLE, ParamTraits, Prior, PriorTraits
from bamgen.runtime.traits import RUNTIME_ABI
from tests.helpers import write_prior


@pytest.mark.parametrize("path", shipped_priors(), ids=lambda p: p.stem)
def test_printed_traits_read_back_as_the_compiler_made_them(path):
    spec = load_spec(path)
    made = traits(spec, lower.plan(analyse(spec)))
    read = eval(_traits_source(made), {"PriorTraits": PriorTraits, "ParamTraits": ParamTraits})  # noqa: S307
    assert read == made
    module = importlib.import_module(f"generated.{spec.name}")
    assert module.TRAITS == made and module._prior.traits is module.TRAITS


def test_traits_of_the_shipped_kinds():
    ggd = importlib.import_module("generated.generalized_gaussian").TRAITS
    assert ggd.table and ggd.table_path and ggd.table_width == 4 and ggd.grad_modes == (GRAD_TABLE,) * 3
    ssmax = importlib.import_module("generated.bam_ssmax").TRAITS
    assert ssmax.uses_n and ssmax.row_factors and ssmax.row_cache and ssmax.logit_fma
    assert ssmax.grad_modes == (GRAD_TABLE, GRAD_TABLE, GRAD_LOGIT_FACTOR) and not ssmax.table_path
    laplace = importlib.import_module("generated.laplace").TRAITS
    assert laplace.ramp and laplace.ramp_symmetric and not laplace.table and laplace.table_grads == ("b",)
    uniform = importlib.import_module("generated.uniform").TRAITS
    assert uniform.params == () and uniform.table_path and not uniform.distance_table


def test_each_prior_gets_its_own_kernels_and_the_library_keeps_its_defaults():
    from bamgen.runtime.triton import hooks, variant
    ggd = importlib.import_module("generated.generalized_gaussian")
    ssmax = importlib.import_module("generated.bam_ssmax")
    k_ggd, k_ssmax = ggd._prior.kernels(), ssmax._prior.kernels()
    assert k_ggd["bwd_dq"] is not k_ssmax["bwd_dq"]
    assert k_ggd.namespace["prior_grads"].fn is ggd.prior_grads          # the module's hook
    assert k_ssmax.namespace["prior_row_factors"].fn is ssmax.prior_row_factors
    assert k_ggd.namespace["TABLE"].value and not k_ggd.namespace["ROW_FACTORS"].value
    assert k_ssmax.namespace["ROW_FACTORS"].value
    # the copies share the library's code, and their globals are the prior's namespace
    assert k_ggd["fwd"].fn.__code__ is variant.forward._attn_fwd.fn.__code__
    assert k_ggd["fwd"].fn.__globals__ is k_ggd.namespace
    assert not hooks.TABLE.value and not variant.helpers.TABLE.value      # the defaults stay NoPE's
    assert ggd._prior.kernels() is k_ggd                                  # made once
    # (the interpreter keeps the decorator's options as given; a GPU's JITFunction: see
    # tests/runtime/test_gpu_findings.py)
    assert k_ggd["fwd"].kwargs["do_not_specialize"] == ["d_top_b"]


def test_a_module_of_another_runtime_abi_says_to_rebuild():
    ggd = importlib.import_module("generated.generalized_gaussian")
    with pytest.raises(ImportError, match="runtime ABI 0.*rebuild"):
        Prior(ggd.TRAITS, ggd.PRIOR, ggd.default_params, ggd._prior.torch, abi=RUNTIME_ABI - 1)


def test_runtime_state_is_per_prior(tmp_path):
    """Two priors in one process: their own ops, decode tables and domain checks."""
    ggd = importlib.import_module("generated.generalized_gaussian")
    laplace = importlib.import_module("generated.laplace")
    assert ggd._prior.ops is not laplace._prior.ops
    assert ggd._prior.decode_tables is not laplace._prior.decode_tables
    assert ggd.OP_NAME != laplace.OP_NAME and hasattr(torch.ops.bamgen, laplace.OP_NAME + "_fwd")
    with pytest.raises(ValueError, match="alpha must be positive"):
        ggd.attention(*(torch.randn(1, 1, 3, 8) for _ in range(3)), alpha=-1.0, beta=1.0, mu=0.0)


def test_a_runtime_change_keeps_the_cache_key(tmp_path, monkeypatch):
    """The build hash is the module's own text: what the runtime does is not in it."""
    prior = write_prior(tmp_path, "name: keyed\nlog_prior: -Abs(d)/b\nparams:\n  b: {init: 4.0, domain: positive}\n")
    first = bamgen.load(prior, cache_dir=tmp_path / "cache")
    from bamgen.runtime.cpu import common
    monkeypatch.setattr(common, "TORCH_BLOCK_M", 64)     # a runtime change
    again = bamgen.load(prior, cache_dir=tmp_path / "cache")
    assert again.PRIOR["build_hash"] == first.PRIOR["build_hash"]
    assert again.__name__ == first.__name__


def test_frozen_traits_can_be_replaced_for_a_test():
    """(tests force a path by replacing a prior's traits: they stay frozen dataclasses)"""
    ggd = importlib.import_module("generated.generalized_gaussian")
    generic = dataclasses.replace(ggd.TRAITS, distance_only=False)
    assert not generic.table_path and ggd.TRAITS.table_path
    with pytest.raises(dataclasses.FrozenInstanceError):
        ggd.TRAITS.strategy = "inline"
