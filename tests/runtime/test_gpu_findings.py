"""Guards for what the first run on a real GPU found and the Triton interpreter cannot show
(docs/performance.md, "Measured on a GPU"):

* a table row starts at ``d_top - i`` and runs backwards as i rises; a launcher that specialises
  ``d_top`` on its divisibility lets some Triton releases emit vector loads over it (a
  misaligned-address fault on an H100): ``d_top`` must stay unspecialised in every attention
  kernel;
* the backward rebuilds P from the forward's row statistics, exact only if every logit is
  recomputed bit for bit: the attention kernels launch with implicit FMA contraction off, and the
  backward reuses the forward's prior table instead of building another;
* a prior's copies of the library kernels (bamgen/runtime/triton/variant.py) must keep the
  library's ``tl.constexpr`` annotations: a copy without them launched BLOCK_M, CAUSAL and
  DOT_PREC as runtime arguments, and an H200 refused every launch ("failed to specialize argument
  of type: str"), which the interpreter, which never specialises, did not show;
* the host work before a launch is a GPU call's fixed cost: an H200 measured 1.6-3.0 ms of it per
  forward for GGD, BAM-SSMax and T5, tens to hundreds of small launches building the distance
  table. The table is now built on the device in two launches (the table kernels), and the host's
  torch build, which the CPU path keeps, in a few operations (T5's 32 buckets: one gather, one
  block of derivatives), counted here;
* torch.compile's inductor types a Python float argument of a user kernel ``fp64`` on a device
  that has fp64 (its default); kernels that multiplied their logits by an fp64 ``sm_scale``
  carried fp64 into the accumulator, and ``tl.dot`` refused it: every triton-path call under
  torch.compile failed on an H200 (`make gpu-check`'s compile step). Every attention kernel is
  compiled here with its float scalars typed fp64: it compiles, and runs no fp64 arithmetic;
* torch 2.11's inductor cannot lower a dtype view of a bool tensor on CUDA ("torch.bool is not
  supported by torch.iinfo"): a key_mask that reached the kernels as ``.view(torch.uint8)`` failed
  every traced triton-path call that had one (an H100's `make gpu-check`). The mask is copied
  to uint8 instead, and the traced graph holds no dtype view.

The interpreter runs numpy, which neither specialises nor contracts, so these are checked on the
kernels' settings; `make gpu-check` runs the behaviour on a GPU.
"""
import json
import os
import subprocess
import sys

import importlib

import pytest
import torch

from bamgen.runtime.triton import launch
from tests.helpers import ROOT, load_script

ATTENTION_KERNELS = ("fwd", "bwd_dkdv", "bwd_dq", "decode")
ALL_SHIPPED = ["uniform", "laplace", "generalized_gaussian", "bam", "bam_ssmax", "cauchy", "gaussian",
               "kerple_log", "kerple_power"]
TABLE_PRIORS = [name for name in ALL_SHIPPED if name not in ("uniform", "laplace")]  # test_strategies

SETTINGS_SCRIPT = r"""
import importlib, inspect, json, sys
sys.path.insert(0, sys.argv[1])
from bamgen.runtime.triton import launch
out = {}
launches = (inspect.getsource(launch.forward_kernels) + inspect.getsource(launch.backward_kernels)
            + inspect.getsource(launch.decode))
for name in sys.argv[2:]:
    mod = importlib.import_module("generated." + name)
    kernels = mod._prior.kernels()
    out[name] = {
        "unspecialised": {k: [kernels[k].arg_names[i] if isinstance(i, int) else i
                              for i in kernels[k].do_not_specialize] for k in %r},
        "fp_fusion": launch.FP_FUSION,
        "launches_without_fusion": launches.count("enable_fp_fusion=FP_FUSION"),
    }
print(json.dumps(out))
""" % (ATTENTION_KERNELS,)


def test_attention_kernels_keep_d_top_unspecialised_and_fusion_off():
    # Triton decides interpreter or compiler when a kernel is decorated: a fresh process without
    # TRITON_INTERPRET sees the JIT functions a GPU launch would use.
    env = {k: v for k, v in os.environ.items() if k != "TRITON_INTERPRET"}
    res = subprocess.run([sys.executable, "-c", SETTINGS_SCRIPT, str(ROOT), *ALL_SHIPPED],
                         capture_output=True, text=True, env=env, timeout=300)
    assert res.returncode == 0, res.stderr[-3000:]
    settings = json.loads(res.stdout)
    for name, got in settings.items():
        for kernel, names in got["unspecialised"].items():
            assert "d_top_b" in names, (name, kernel, names)
        assert got["fp_fusion"] is False, name
        assert got["launches_without_fusion"] == len(ATTENTION_KERNELS), (name, got)


@pytest.mark.parametrize("prior", TABLE_PRIORS)
def test_backward_reuses_the_forward_table(prior, monkeypatch):
    """One table build per training step on the Triton path: the backward reads the table the
    forward built (with its derivative slots), so both see the same log-prior bits."""
    mod = importlib.import_module(f"generated.{prior}")
    calls = []
    build = launch.distance_table

    def counting(bound, theta, bottom, top, causal, with_grads, shifted=True):
        calls.append(with_grads)
        return build(bound, theta, bottom, top, causal, with_grads, shifted)

    monkeypatch.setattr(launch, "distance_table", counting)
    g = torch.Generator().manual_seed(0)
    q, k, v = (torch.randn(1, 2, 20, 16, generator=g, requires_grad=True) for _ in range(3))
    m = getattr(mod, mod.PRIOR["class_name"])(num_heads=2)
    m(q, k, v, causal=True, backend="triton").sum().backward()
    assert calls == [True], calls
    with torch.no_grad():  # inference builds the value slot only
        m(q, k, v, causal=True, backend="triton")
    assert calls == [True, False], calls


CONSTEXPR_SCRIPT = r"""
import importlib, json, sys
sys.path.insert(0, sys.argv[1])
from bamgen.runtime.triton import variant

def constexprs(kernel):
    return [p.name for p in kernel.params if p.is_constexpr]

library = {}
for module in variant.LIBRARY:
    for key, name in variant.KERNELS.items():
        if hasattr(module, name):
            library[key] = constexprs(getattr(module, name))
out = {"library": library}
for name in sys.argv[2:]:
    kernels = importlib.import_module("generated." + name)._prior.kernels()
    out[name] = {key: constexprs(kernels[key]) for key in variant.KERNELS}
print(json.dumps(out))
"""


def test_prior_kernels_keep_the_library_kernels_constexpr_arguments():
    # without TRITON_INTERPRET: the JITFunctions a GPU launch specialises
    env = {k: v for k, v in os.environ.items() if k != "TRITON_INTERPRET"}
    priors = ["uniform", "generalized_gaussian", "bam_ssmax", "t5", "forget_gate"]
    res = subprocess.run([sys.executable, "-c", CONSTEXPR_SCRIPT, str(ROOT), *priors],
                         capture_output=True, text=True, env=env, timeout=300)
    assert res.returncode == 0, res.stderr[-3000:]
    found = json.loads(res.stdout)
    library = found.pop("library")
    assert {"BLOCK_M", "CAUSAL", "DOT_PREC", "HEAD_DIM"} <= set(library["fwd"]), library["fwd"]
    for name, kernels in found.items():
        assert kernels == library, name


def _computing_ops(fn):
    """The torch operations ``fn`` runs that compute (on a GPU each is a launch), not views."""
    from torch.utils._python_dispatch import TorchDispatchMode
    views = {"select", "view", "expand", "slice", "unsqueeze", "squeeze", "alias", "lift_fresh",
             "detach", "unbind", "_local_scalar_dense"}

    class Count(TorchDispatchMode):
        ops = 0

        def __torch_dispatch__(self, func, types, args=(), kwargs=None):
            if func.overloadpacket.__name__ not in views:
                Count.ops += 1
            return func(*args, **(kwargs or {}))
    with Count():
        fn()
    return Count.ops


@pytest.mark.parametrize("name", ["t5", "generalized_gaussian", "bam_ssmax", "sandwich"])
def test_a_distance_table_is_built_in_two_launches(name):
    """The Triton path builds a table prior's distance table on the device in two launches (the
    table kernels, launch.distance_table) and runs no torch operation for it: an H200 measured
    1.6-3.0 ms of host work per forward call while torch built the tables (38 operations for
    GGD's forward, 232 for T5's training step). Sandwich's cosines have no float64 Triton form
    here (printers.TritonFloat64Printer): torch builds its table, no kernel."""
    from bamgen.runtime.params import theta as make_theta
    script = load_script(ROOT / "benchmarks" / "launches.py", "launches")
    prior = importlib.import_module(f"bamgen.generated.{name}")._prior
    q = torch.randn(2, 16, 256, 64, dtype=torch.bfloat16)
    theta = make_theta(prior.traits, q, prior.default_params(16), grad=True)
    kernel = "prior_distance" in prior.triton_hooks
    assert kernel == (name != "sandwich")
    for with_grads in (False, True):
        counter, ops = script.CountedLaunches(), script.DeviceOps()   # (allocations: none)
        with script.stubbed_launches(counter), ops:
            launch.distance_table(prior, theta, -255, 255, True, with_grads, True)
        assert dict(counter.kernels) == ({"_table_shift_parts": 1, "_distance_table": 1}
                                         if kernel else {}), name
        assert (not ops.ops) if kernel else (sum(ops.ops.values()) > 30), (name, with_grads, ops.ops)


@pytest.mark.parametrize("name, forward, backward", [("t5", 40, 210), ("generalized_gaussian", 25, 45)])
def test_the_hosts_table_is_built_in_few_operations(name, forward, backward):
    """The torch build of a distance table (tables.prior_tables: the CPU path's, and the Triton
    path's for a prior without the table kernel). T5's forward table took 124 computing
    operations and its backward's 381 (a chain of 31 selects per gather, one cast per parameter
    column, one shift per derivative slot); now 36 and 201 (GGD's 23 and 46, now 19 and 37),
    unshifted (the block API's build), with the base-2 value slot. (An element's gradient at a
    fractional index, taken as two compares and two selects a bucket, put T5's at 290: its
    index is floored once instead, docs/performance.md.)"""
    from bamgen.runtime.params import theta as make_theta
    from bamgen.runtime.tables import prior_tables
    prior = importlib.import_module(f"bamgen.generated.{name}")._prior
    q = torch.randn(2, 16, 256, 64, dtype=torch.bfloat16)
    theta = make_theta(prior.traits, q, prior.default_params(16), grad=True)
    for with_grads, most in ((False, forward), (True, backward)):
        ops = _computing_ops(lambda: launch.base2_log_prior(
            prior_tables(prior, theta, -255, 255, True, with_grads, False)[0]))
        assert ops <= most, (name, with_grads, ops)


FP64_SCALARS_SCRIPT = r"""
import json, sys
from bamgen.aot import compile_spec, disassemble
from bamgen.driver.loader import load_prior
from bamgen.resources import shipped_prior
out = []
for spec in load_prior(shipped_prior(sys.argv[1])).triton_kernel_specs("bf16", 64, True, arch="sm_80"):
    name, fn, signature, constexprs, warps, stages = spec
    if not name.startswith("attn_"):
        continue
    floats = [arg for arg in ("sm_scale", "row_abs") if signature.get(arg) == "fp32"]
    signature = {**signature, **{arg: "fp64" for arg in floats}}   # as inductor types them
    try:
        kernel = compile_spec((name, fn, signature, constexprs, warps, stages), "sm_80")
    except Exception as err:
        out.append([name, floats, f"{type(err).__name__}: {str(err)[:300]}", []])
        continue
    fp64 = sorted({op for _, op, _ in disassemble(kernel.cubin)
                   if op.split(".")[0] in ("DFMA", "DMUL", "DADD", "DSETP", "DMNMX")})
    out.append([name, floats, None, fp64])
print(json.dumps(out))
"""


@pytest.mark.slow
def test_attention_kernels_compile_with_float_scalars_typed_fp64():
    """ALiBi (the ramp: both sm_scale and row_abs reach its logits) on sm_80: the forward, both
    backward kernels and the decode kernel compile with sm_scale and row_abs typed fp64, as
    inductor passes a Python float, and none of them computes in fp64."""
    from tests.helpers import run_script_aot
    res = run_script_aot(FP64_SCALARS_SCRIPT, "laplace")
    assert res.returncode == 0, res.stderr[-3000:]
    rows = json.loads(res.stdout)
    assert {row[0] for row in rows} == {"attn_fwd", "attn_bwd_dkdv", "attn_bwd_dq", "attn_decode"}
    for name, floats, error, fp64 in rows:
        assert floats == ["sm_scale", "row_abs"], (name, floats)
        assert error is None, (name, error)
        assert fp64 == [], (name, fp64)


def test_key_mask_reaches_the_kernels_without_a_dtype_view():
    """The launch arguments of a call with a key_mask, traced as torch.compile traces them:
    uint8 with the mask's values, and no aten.view.dtype node (which torch 2.11's inductor
    cannot lower for a bool tensor on CUDA)."""
    from torch.fx.experimental.proxy_tensor import make_fx

    def mask_argument(q, key_mask):
        return launch.KernelLayout(q, 0, 0, key_mask, None, None).key_mask

    q = torch.randn(2, 3, 5, 8)
    key_mask = torch.tensor([[True, False, True, True, False], [False, True, True, True, True]])
    graph = make_fx(mask_argument)(q, key_mask).graph
    views = [n for n in graph.nodes if n.target is torch.ops.aten.view.dtype]
    assert views == []
    got = mask_argument(q, key_mask)
    assert got.dtype == torch.uint8 and got.is_contiguous()
    assert torch.equal(got, key_mask.to(torch.uint8))
