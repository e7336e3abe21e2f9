"""benchmarks/tutorial_model.py: Triton's fused-attention tutorial captured, compiled ahead of
time and modelled beside bamgen's NoPE, without a GPU. The tutorial is not shipped, so these
tests read a stand-in of its shape (tests/gpu/tutorial_stand_in.py): an import that asks for
the GPU, an autotuned forward filtered by the capability, a fused backward with fixed settings.
The compiles run in processes of their own (this one runs Triton's interpreter)."""
import json
import os
import subprocess
import sys
import textwrap

from tests.helpers import ROOT, load_script

SCRIPT = ROOT / "benchmarks" / "tutorial_model.py"
UNITS = ("tensor", "mufu", "fp32", "issue", "lsu")   # (benchmarks/model_check.py's)
STAND_IN = ROOT / "tests" / "gpu" / "tutorial_stand_in.py"
# the tensor cores' floor, cycles per 1000 scores at head dim 64 on sm_90 (4096 flops a clock
# an SM): 2 x 64 flops a score per matmul, 2 matmuls in a forward, 4 + 3 in the backward
TENSOR_FLOOR = {"fwd": 1000 * 2 * 64 * 2 / 4096, "bwd": 1000 * 2 * 64 * 7 / 4096}


def _compiler_env() -> dict:
    env = dict(os.environ)
    env.pop("TRITON_INTERPRET", None)
    return env


def _tool(*args, timeout=120) -> subprocess.CompletedProcess:
    """benchmarks/tutorial_model.py in a process of its own, compiling for the GPU."""
    return subprocess.run([sys.executable, str(SCRIPT), *map(str, args)], cwd=ROOT,
                          env=_compiler_env(), capture_output=True, text=True, timeout=timeout)


def test_the_launches_are_captured_as_triton_would_specialise_them():
    code = textwrap.dedent(f"""
        import json, sys, torch
        sys.path.insert(0, {str(ROOT / 'benchmarks')!r})
        import tutorial_model as tm
        from triton.runtime import driver
        from triton.runtime.autotuner import Autotuner
        from triton.runtime.jit import JITFunction
        before = (torch.cuda.get_device_capability, driver._active)
        out = {{}}
        for arch in ("sm_90", "sm_80"):
            module = tm.load_tutorial({str(STAND_IN)!r}, arch)
            got = tm.capture(module, 64, arch)
            out["kernels back"] = (isinstance(module._fwd, Autotuner)
                                   and isinstance(module._bwd, JITFunction))
            out[arch] = [dict(kernel=l.kernel, phase=l.phase, config=l.config, warps=l.warps,
                              stages=l.stages, signature=l.signature,
                              constexprs={{k: v for k, v in l.constexprs.items()}},
                              hinted=sorted(l.fn.arg_names[i] for (i,) in l.attrs))
                         for l in got.launches]
        after = (torch.cuda.get_device_capability, driver._active)
        out["restored"] = all(a is b for a, b in zip(before, after))
        print(json.dumps(out))
    """)
    res = subprocess.run([sys.executable, "-c", code], cwd=ROOT, env=_compiler_env(),
                         capture_output=True, text=True, timeout=300)
    assert res.returncode == 0, res.stderr[-3000:]
    got = json.loads(res.stdout.strip().splitlines()[-1])
    assert got["restored"]   # torch and Triton answer for this machine again
    assert got["kernels back"]   # and the module launches its own kernels, not the recorders
    # the stand-in drops 8 warps on small tiles on Hopper only, as the tutorial does
    assert [l["config"] for l in got["sm_90"] if l["phase"] == "fwd"] == [
        "64x32 w4 s3", "64x64 w4 s3", "128x128 w8 s3"]
    assert [l["config"] for l in got["sm_80"] if l["phase"] == "fwd"] == [
        "64x32 w4 s3", "64x64 w4 s3", "128x128 w8 s3", "64x64 w8 s3"]
    fwd, bwd = got["sm_90"][1], got["sm_90"][-1]
    assert (fwd["warps"], fwd["stages"], fwd["constexprs"]["BLOCK_M"], fwd["constexprs"]["BLOCK_N"]) == (4, 3, 64, 64)
    assert (bwd["kernel"], bwd["phase"], bwd["config"], bwd["warps"], bwd["stages"]) == ("_bwd", "bwd", "", 4, 2)
    assert {k: bwd["constexprs"][k] for k in ("BLOCK_M1", "BLOCK_N1", "BLOCK_M2", "BLOCK_N2", "HEAD_DIM")} == {
        "BLOCK_M1": 32, "BLOCK_N1": 128, "BLOCK_M2": 128, "BLOCK_N2": 32, "HEAD_DIM": 64}
    # Triton's launcher: an integer 1 (the last dim's stride) becomes a constexpr; multiples of
    # 16 and aligned pointers get the divisibility hint; a float is fp32
    sig = fwd["signature"]
    assert sig["stride_d"] == "constexpr" and fwd["constexprs"]["stride_d"] == 1
    assert (sig["Q"], sig["sm_scale"], sig["stride_tok"], sig["N_CTX"]) == ("*fp16", "fp32", "i32", "i32")
    assert fwd["hinted"] == ["K", "N_CTX", "Out", "Q", "V", "stride_tok"]


def test_the_report_models_each_config_beside_nope_and_the_measured_run(tmp_path):
    us = {"bamgen-uniform": {"fwd:_attn_fwd": 800.0, "bwd:_attn_bwd_dkdv": 2600.0, "bwd:_attn_bwd_dq": 1100.0},
          "tutorial": {"fwd:_fwd": 640.0, "bwd:_fwd": 650.0, "bwd:_bwd": 1850.0}}
    run = {"env": {"device": "NVIDIA H200"}, "args": {"dtype": "fp16"},
           "results": [{"N": 8192, "B": 2, "H": 16, "D": 64, "peers": {},
                        "configs": {"tutorial": {"_fwd": "64x64 w4 s3"}},
                        "kernels": {peer: {k: {"us": t, "calls": 1.0} for k, t in times.items()}
                                    for peer, times in us.items()}}]}
    (tmp_path / "run.json").write_text(json.dumps(run))
    # a fit's points (model_check.py --pairs) that weigh tensor 2, issue 1 and LSU 3 exactly
    units = [dict(zip(UNITS, row)) for row in ((10, 1, 1, 5, 1), (20, 2, 0, 1, 3), (5, 0, 2, 8, 2),
                                               (7, 3, 1, 2, 0), (1, 1, 1, 1, 9), (12, 0, 0, 4, 4))]
    pairs = [{"prior": f"p{i}", "head_dim": 64, "kernel": "fwd", "modelled": max(u.values()),
              "measured": 2 * u["tensor"] + u["issue"] + 3 * u["lsu"], "device": "NVIDIA H200",
              "units": sorted(u.items())} for i, u in enumerate(units)]
    # in two files, as two GPU runs leave them: the fit takes their points together (neither
    # half alone has more points than weights)
    (tmp_path / "pairs.json").write_text(json.dumps(pairs[:3]))
    (tmp_path / "pairs-2.json").write_text(json.dumps(pairs[3:]))
    res = _tool(STAND_IN, "--arch", "sm_90", "--head-dim", "64", "--run", tmp_path / "run.json",
                "--pairs", tmp_path / "pairs.json", tmp_path / "pairs-2.json",
                "--json", tmp_path / "rows.json", timeout=600)
    assert res.returncode == 0, res.stderr[-3000:]
    rows = json.loads((tmp_path / "rows.json").read_text())
    assert [(r["phase"], r["config"]) for r in rows] == [
        ("fwd", "64x32 w4 s3"), ("fwd", "64x64 w4 s3"), ("fwd", "128x128 w8 s3"), ("bwd", "w4 s2")]
    # the loops modelled: past the forward's masked diagonal loop (64x32: loops masked, steady;
    # at 64x64 the diagonal is one tile and no loop), and past dK/dV's masked half tiles to its
    # steady loop, then dQ's (loops: dK/dV masked, dK/dV, dQ)
    assert [r["loops"] for r in rows] == [[1], [0], [], [1, 2]]
    refused = rows[2]
    assert refused["cycles"] is None and not refused["usable"]
    assert refused["note"] == "does not compile: tl.static_assert(BLOCK_N <= HEAD_DIM)"
    for r in rows[:2] + rows[3:]:
        assert r["registers"] > 0 and r["shared_bytes"] > 0
        # at least the tensor cores' work: a loop of the wrong tile (the dQ loop counted as
        # dK/dV's, or one loop of the two) would fall under it
        assert r["cycles"] >= TENSOR_FLOOR[r["phase"]] - 0.05, r
    summary = {line.split(" | ")[2]: line.strip("| ").split(" | ") for line in res.stdout.splitlines()
               if line.startswith(("| sm_90 | 64 | fwd |", "| sm_90 | 64 | bwd |")) and line.count("|") == 10}
    pick = min((r for r in rows[:3] if r["usable"]), key=lambda r: r["cycles"])
    fwd = summary["fwd"]
    assert fwd[3] == pick["config"] and float(fwd[4]) == round(pick["cycles"])
    nope = float(fwd[5])
    assert abs(float(fwd[6].rstrip("x")) - nope / pick["cycles"]) < 0.01
    assert fwd[7] == f"{800 / 640:.2f}x" and fwd[8] == "64x64 w4 s3"
    bwd = summary["bwd"]
    assert bwd[7] == f"{(2600 + 1100) / 1850:.2f}x" and bwd[8] == "-"
    # the fitted model on the tutorial's kernels, beside their measured cycles (1.98 GHz, 132 SMs)
    assert "The fitted model (sm_90): tensor 2.00, mufu 0.00, fp32 0.00, issue 1.00, lsu 3.00" in res.stdout
    fit = next(line.strip("| ").split(" | ") for line in res.stdout.splitlines()
               if line.startswith("| sm_90 | 64 | fwd |") and line.count("|") == 9)
    want = 2 * dict(pick["units"])["tensor"] + dict(pick["units"])["issue"] + 3 * dict(pick["units"])["lsu"]
    measured = 640e-6 * 1.98e9 * 132 / (2 * 16 * 8192 ** 2 / 2 / 1000)
    assert (fit[3], fit[4], fit[5]) == (f"{want:.0f}", f"{measured:.0f}", f"{want / measured - 1:+.0%}")


def test_a_file_that_is_not_the_tutorial_is_refused_by_name(tmp_path):
    other = tmp_path / "other.py"
    other.write_text("X = 1\n")
    res = _tool(other, "--arch", "sm_90")
    assert res.returncode == 2 and "no _attention autograd Function" in res.stderr
    assert "Traceback" not in res.stderr
    broken = tmp_path / "broken.py"
    broken.write_text("import a_module_nobody_installed\n")
    res = _tool(broken, "--arch", "sm_90")
    assert res.returncode == 2 and "imports a_module_nobody_installed" in res.stderr
    assert "Traceback" not in res.stderr
    res = _tool(tmp_path / "missing.py")
    assert res.returncode == 2 and "tutorial: no file" in res.stderr and "Traceback" not in res.stderr
    for bad in ("{", "[]", '{"results": [{"N": 8192}]}'):
        (tmp_path / "bad.json").write_text(bad)
        res = _tool(STAND_IN, "--run", tmp_path / "bad.json")
        assert res.returncode == 2 and "--run:" in res.stderr and "Traceback" not in res.stderr, bad
    res = _tool(STAND_IN, "--json", tmp_path / "no" / "rows.json")
    assert res.returncode == 2 and "--json: no folder" in res.stderr
    point = {"prior": "p", "head_dim": 64, "kernel": "fwd", "modelled": 1.0, "measured": 2.0,
             "device": "GPU", "units": [[u, 1.0] for u in UNITS]}
    mixed = json.dumps([{**point, "arch": arch} for arch in ("sm_80", "sm_90") * 3])
    for bad, says in (("{", "is not a benchmarks/model_check.py --pairs file"), ("[]", "0 points fit no 5 weights"),
                      ('[{"prior": "x"}]', "is not a benchmarks/model_check.py --pairs file"),
                      (mixed, "points of sm_80 and sm_90; a fit holds for one family")):
        (tmp_path / "pairs.json").write_text(bad)
        res = _tool(STAND_IN, "--pairs", tmp_path / "pairs.json")
        assert res.returncode == 2 and says in res.stderr and "Traceback" not in res.stderr, (bad, res.stderr)


def test_gpu_bench_records_the_configs_the_tutorials_autotuners_kept(tmp_path):
    gpu = load_script(ROOT / "benchmarks" / "gpu.py", "gpu_bench_configs")
    import importlib.util
    spec = importlib.util.spec_from_file_location("kernels_configs", tmp_path / "kernels.py")
    (tmp_path / "kernels.py").write_text(textwrap.dedent("""
        import triton
        import triton.language as tl

        @triton.autotune([triton.Config({"BLOCK": 16}, num_warps=4, num_stages=2),
                          triton.Config({"BLOCK": 32}, num_warps=8, num_stages=3)], key=["n"])
        @triton.jit
        def tuned(x, n, BLOCK: tl.constexpr):
            pass

        @triton.jit
        def plain(x):
            pass
    """))
    module = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(module)
    assert gpu.autotuned_configs(module) == {}   # nothing tuned yet
    module.tuned.best_config = module.tuned.configs[1]
    assert gpu.autotuned_configs(module) == {"tuned": "32 w8 s3"}


def test_measured_ratios_go_beside_the_family_of_the_gpu_that_ran_them(monkeypatch):
    monkeypatch.syspath_prepend(str(ROOT / "benchmarks"))   # (its autotune_names)
    model = load_script(SCRIPT, "tutorial_model_run")
    kernels = {"bamgen-uniform": {"fwd:_attn_fwd": {"us": 900.0}},
               "tutorial": {"fwd:_fwd": {"us": 600.0}}}
    run = {"env": {"device": "NVIDIA A100", "capability": [8, 0]},
           "results": [{"N": n, "B": 1, "H": 8, "D": 64, "kernels": kernels} for n in (4096, 8192)]}
    assert model.run_arch(run) == "sm_80"
    assert model.run_arch({"env": {"device": "NVIDIA H200"}}) == "sm_90"   # before capabilities
    ratios = model.measured_ratios(run, {"fwd": {"_fwd"}, "bwd": {"_bwd"}})
    assert [(r["N"], r["fwd"]) for r in ratios[64]] == [(4096, 1.5), (8192, 1.5)]
    # the tutorial's time in the model's unit: cycles per 1000 causal scores, 1.98 GHz x 132 SMs
    assert [round(r["tutorial_cycles"]["fwd"], 6) for r in ratios[64]] == [
        round(600e-6 * 1.98e9 * 132 / (8 * n * n / 2 / 1000), 6) for n in (4096, 8192)]
    assert model._measured(ratios[64], "fwd") == "1.50x at N=4096, 1.50x at N=8192"
    assert model._measured(ratios[64], "bwd") == "-"
