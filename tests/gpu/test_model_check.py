"""benchmarks/model_check.py: a gpu.py --kernels run's kernel times beside the throughput
model's prediction for the same kernels, with leave-one-out errors; no GPU needed (the model
compiles ahead of time)."""
import json
import os
import statistics
import subprocess
import sys

import pytest

from tests.helpers import ROOT, load_script

SCRIPT = ROOT / "benchmarks" / "model_check.py"


def _run(N=4096, B=4, H=16, D=64, times=None):
    """A gpu.py JSON as --kernels writes it: NoPE and ALiBi, forward and backward kernels."""
    times = times or {"uniform": (800.0, 2600.0, 1100.0), "laplace": (900.0, 2700.0, 1800.0)}
    kernels = {f"bamgen-{p}": {"fwd:_attn_fwd": {"us": f, "calls": 1.0},
                               "bwd:_attn_fwd": {"us": f, "calls": 1.0},
                               "bwd:_attn_bwd_dkdv": {"us": kv, "calls": 1.0},
                               "bwd:_attn_bwd_dq": {"us": q, "calls": 1.0},
                               "bwd:some_elementwise": {"us": 5.0, "calls": 2.0}}
               for p, (f, kv, q) in times.items()}
    return {"env": {"device": "NVIDIA H200"}, "args": {"dtype": "bf16"},
            "results": [{"N": N, "B": B, "H": H, "D": D, "peers": {}, "kernels": kernels}]}


VARIANT = "bamgen-uniform@fwd=64x64x4x3"


def test_measured_cycles_follow_the_run_and_the_model_compiles(tmp_path):
    # a process of its own: the AOT compile needs Triton without the interpreter, which this
    # process (conftest.py) runs under
    run = tmp_path / "run.json"
    run.write_text(json.dumps(_run()))
    variants = _run(times={"uniform": (800.0, 2600.0, 1100.0), "uniform@fwd=64x64x4x3": (700.0, 2600.0, 1100.0)})
    variants["results"][0]["variants"] = {VARIANT: {"tiles": {"fwd": [64, 64, 4, 3]}, "gather": None}}
    variants_run = tmp_path / "variants.json"
    variants_run.write_text(json.dumps(variants))
    pairs = tmp_path / "pairs.json"
    report = tmp_path / "report.md"
    report.write_text("# a gpu-check report\n")
    res = subprocess.run([sys.executable, str(SCRIPT), str(run), str(variants_run), "--ghz", "2.0", "--sms", "100",
                          "--pairs", str(pairs), "--append", str(report)],
                         cwd=ROOT, capture_output=True, text=True, timeout=600)
    assert res.returncode == 0, res.stderr[-3000:]
    out = res.stdout
    text = report.read_text()
    assert text.startswith("# a gpu-check report\n") and "## The throughput model against" in text
    assert out.strip().splitlines()[0] in text
    points = json.loads(pairs.read_text())
    assert [(p["prior"], p["kernel"]) for p in points] == [
        (p, k) for p in ("uniform", "laplace", "uniform", "uniform@fwd=64x64x4x3")
        for k in ("fwd", "dkdv", "dq")]
    # the variant is compiled with its pinned forward (another tile: other modelled cycles) and
    # the shipped backward kernels
    base, variant = points[6:9], points[9:12]
    assert variant[0]["modelled"] != base[0]["modelled"]
    assert [p["modelled"] for p in variant[1:]] == [p["modelled"] for p in base[1:]]
    others = [p for p in points if p["kernel"] == "fwd" and not p["prior"].startswith("uniform")]
    scores = 4 * 16 * 4096 ** 2 / 2
    fwd = points[0]
    assert abs(fwd["measured"] - 800e-6 * 2.0e9 * 100 / (scores / 1000)) < 1e-9
    assert all(p["modelled"] > 0 for p in points)
    # each point's leave-one-out factor is the median of the other priors' (laplace: not uniform's
    # own variant, the same kernel but for its tile)
    uniform_fwd = points[0]
    factor = statistics.median(p["measured"] / p["modelled"] for p in others)
    want = factor * uniform_fwd["modelled"] / uniform_fwd["measured"] - 1
    row = next(line for line in out.splitlines() if line.startswith("| uniform | 64 | fwd |"))
    assert row.split(" | ")[8] == f"{want * 100:+.0f}%", (row, want)
    assert "within 15% (leave one out, one factor per kernel and head dim):" in out
    # the raw model is the largest unit; each point carries the latency term beside the units,
    # so that the next fit can test it on these points (docs/performance.md)
    assert all(max(c for u, c in p["units"] if u != "latency") == p["modelled"] for p in points)
    assert all(dict(p["units"])["latency"] > 0 for p in points)
    assert "LOO error, + latency" in out.splitlines()[0]


def test_a_run_without_kernel_times_says_what_to_do(tmp_path, capsys):
    check = load_script(SCRIPT, "model_check")   # (loaded here, it leaves TRITON_INTERPRET be)
    assert os.environ.get("TRITON_INTERPRET") == "1"
    run = _run()
    del run["results"][0]["kernels"]
    path = tmp_path / "run.json"
    path.write_text(json.dumps(run))
    assert check.main([str(path)]) == 1
    assert "run benchmarks/gpu.py with --kernels" in capsys.readouterr().out


def _law_points(check, arch="sm_90"):
    """Points timed at 1.5 x tensor + 0.8 x issue cycles, as a --pairs file holds them."""
    rows = [(120, 30, 40, 300, 90), (250, 60, 50, 410, 160), (90, 90, 120, 250, 60),
            (300, 20, 80, 700, 300), (180, 50, 60, 520, 100), (60, 10, 30, 200, 40),
            (400, 100, 90, 350, 250), (140, 40, 70, 610, 130)]
    pts = []
    for n, (tensor, mufu, fp32, issue, lsu) in enumerate(rows):
        units = dict(tensor=tensor, mufu=mufu, fp32=fp32, issue=issue, lsu=lsu)
        pts.append(check.Point(f"p{n}", 64, "fwd", max(units.values()), 1.5 * tensor + 0.8 * issue,
                               "H200", tuple(sorted(units.items())), arch))
    return pts


def test_the_fitted_sum_of_units_recovers_known_weights_and_reports_its_loo():
    """Kernels timed at 1.5 x tensor + 0.8 x issue cycles (and one 20% off): the fit finds those
    weights (no negative one for the units that do not matter), its LOO is exact but for the
    point off the law, and the table carries both columns."""
    from dataclasses import replace
    check = load_script(SCRIPT, "model_check")
    pts = _law_points(check)
    pts[3] = replace(pts[3], measured=pts[3].measured * 1.2)
    clean = [p for n, p in enumerate(pts) if n != 3]
    weights = check.fit_units(clean)
    assert abs(weights["tensor"] - 1.5) < 1e-9 and abs(weights["issue"] - 0.8) < 1e-9, weights
    assert all(abs(w) < 1e-9 for u, w in weights.items() if u not in ("tensor", "issue")), weights
    assert all(w >= 0 for w in check.fit_units(pts).values())
    errors = check.leave_one_out_fit(pts)
    assert abs(errors[3]) > 0.1 and sorted(abs(e) for e in errors)[3] < 0.1
    lines = check.table(pts)
    assert "LOO error, fitted" in lines[0] and any("fitted weights" in line for line in lines)


def test_the_latency_term_is_fitted_where_every_point_carries_it():
    """Kernels timed at 1.5 x tensor + 0.5 x latency: the fit with the term finds it (its LOO
    exact), the units alone miss; a table with one point lacking the term (an older pairs file)
    leaves the columns out rather than fitting part of the points."""
    from dataclasses import replace
    check = load_script(SCRIPT, "model_check")
    pts = []
    for n, p in enumerate(_law_points(check)):
        units = dict(p.units)
        units["latency"] = 100.0 + 37.0 * ((n * 7) % 5)
        pts.append(replace(p, units=tuple(sorted(units.items())),
                           measured=1.5 * units["tensor"] + 0.5 * units["latency"]))
    lines = check.table(pts)
    assert "LOO error, + latency" in lines[0]
    summary = {line.split(":")[0]: line for line in lines if line.startswith("\nwithin")}
    assert summary["\nwithin 15% (leave one out, the fitted sum of units and latency)"].endswith(
        f"{len(pts)} of {len(pts)}")
    assert all(abs(e) < 1e-9 for e in check.leave_one_out_fit(pts, check.UNITS + ("latency",)))
    assert max(abs(e) for e in check.leave_one_out_fit(pts)) > 0.15
    older = pts[:-1] + [replace(pts[-1], units=tuple(u for u in pts[-1].units if u[0] != "latency"))]
    assert "latency" not in check.table(older)[0]


def test_a_kv_pin_takes_the_tile_its_read_launches_with():
    """kv=tma on NoPE's forward at head dim 64 on sm_90 (shipped through pointers over 8 warps:
    tiles.KV_TMA_SHIPPED) models the TMA forward a launch pinned so takes: FWD_TMA_AT's 4-warp
    tile, descriptor arguments; a pinned tile wins; without the read's tile to hand it is
    refused by name."""
    check = load_script(SCRIPT, "model_check")
    from bamgen.driver.loader import load_prior
    from bamgen.resources import shipped_prior
    module = load_prior(shipped_prior("uniform"))
    spec = next(s for s in module.triton_kernel_specs("bf16", 64, True, arch="sm_90")
                if s[0] == "attn_fwd")
    assert not spec[3]["KV_TMA"] and spec[2]["K"] == "*bf16" and spec[4] == 8
    tile_for = lambda tma: check.forward_tile(module, 64, "sm_90", "plain", tma)  # noqa: E731
    _, _, sig, constexprs, warps, stages = check.pinned_spec(spec, "fwd", {"kv": "tma"}, tile_for)
    assert constexprs["KV_TMA"] and sig["K"].startswith("tensordesc") and sig["V"] == sig["K"]
    assert (constexprs["BLOCK_M"], constexprs["BLOCK_N"], warps, stages) == (128, 64, 4, 3)
    pinned = check.pinned_spec(spec, "fwd", {"kv": "tma", "tiles": {"fwd": [64, 32, 4, 2]}})
    assert (pinned[3]["BLOCK_N"], pinned[4]) == (32, 4) and pinned[2]["K"] == "tensordesc<bf16[1, 32, 64]>"
    assert check.pinned_spec(spec, "fwd", {"kv": "pointers"}) == spec
    with pytest.raises(ValueError, match="kv=tma changes the forward's tile"):
        check.pinned_spec(spec, "fwd", {"kv": "tma"})
    # a spec that reads through descriptors, pinned back to pointers: pointer arguments again
    tma_spec = check.pinned_spec(spec, "fwd", {"kv": "tma"}, tile_for)
    back = check.pinned_spec(tma_spec, "fwd", {"kv": "pointers"}, tile_for)
    assert not back[3]["KV_TMA"] and (back[2]["K"], back[2]["V"]) == ("*bf16", "*bf16")
    assert (back[3]["BLOCK_M"], back[3]["BLOCK_N"], back[4], back[5]) == (128, 64, 8, 3)


def test_a_variant_is_compiled_as_its_pins_say():
    """pinned_spec: a pinned kernel's tile, warps and stages, and the forward's table gather;
    a kernel not pinned keeps the spec's."""
    check = load_script(SCRIPT, "model_check")
    spec = ("attn_fwd", None, {}, {"BLOCK_M": 128, "BLOCK_N": 64, "TABLE_GATHER": "async"}, 8, 2)
    pins = {"tiles": {"fwd": [64, 32, 4, 3]}, "gather": "direct"}
    _, _, _, constexprs, warps, stages = check.pinned_spec(spec, "fwd", pins)
    assert (constexprs["BLOCK_M"], constexprs["BLOCK_N"], warps, stages) == (64, 32, 4, 3)
    assert constexprs["TABLE_GATHER"] == "direct" and spec[3]["TABLE_GATHER"] == "async"
    dq = ("attn_bwd_dq", None, {}, {"BLOCK_M": 64, "BLOCK_N": 32}, 4, 2)
    assert check.pinned_spec(dq, "bwd_dq", pins) == dq
    # a pinned dq_group: the first launch sums that many scalars (per-distance sums: none)
    fire_dq = ("attn_bwd_dq", None, {}, {"GRAD_COUNT": 8, "NUM_GRADS": 99}, 4, 2)
    assert check.pinned_spec(fire_dq, "bwd_dq", {"dq_group": 6})[3]["GRAD_COUNT"] == 6
    assert check.pinned_spec(fire_dq, "bwd_dq", {"dq_group": 200})[3]["GRAD_COUNT"] == 99
    t5_dq = ("attn_bwd_dq", None, {}, {"GRAD_COUNT": 0, "NUM_GRADS": 32}, 4, 2)
    assert check.pinned_spec(t5_dq, "bwd_dq", {"dq_group": 6}) == t5_dq
    run = _run(times={"ggd@gather=direct": (1.0, 2.0, 3.0)})
    run["results"][0]["variants"] = {"bamgen-ggd@gather=direct": {"tiles": {}, "gather": "direct"}}
    found = check.measured_points(run, 2.0, 100)
    assert {(p[0], p[2]) for p in found} == {("ggd@gather=direct", k) for k in ("fwd", "dkdv", "dq")}
    assert all(p[4] == {"tiles": {}, "gather": "direct"} for p in found)
    # a generation step's kernels (gpu.py profiles them too) are no prefill's points
    step = dict(run["results"][0], mode="decode")
    assert check.measured_points({"results": [step]}, 2.0, 100) == []


def test_leave_one_out_leaves_a_prior_s_variants_out_with_it():
    """A pinned variant is its prior's kernel but for a tile or a read: a point is never
    predicted from its own variants (nor a variant from its base), under either LOO."""
    check = load_script(SCRIPT, "model_check")

    def point(prior, measured, tensor):
        units = dict(tensor=tensor, mufu=1.0, fp32=1.0, issue=1.0, lsu=1.0)
        return check.Point(prior, 64, "fwd", tensor, measured, "H200", tuple(sorted(units.items())))
    pts = [point("uniform", 200.0, 100.0), point("laplace", 330.0, 110.0),
           point("ggd", 600.0, 100.0), point("ggd@gather=coalesced", 300.0, 100.0)]
    loo = check.leave_one_out(pts)
    # ggd from uniform's and laplace's factors (2.0, 3.0): median 2.5 x 100 = 250 against 600
    assert abs(loo[2] - (250.0 / 600.0 - 1)) < 1e-12 and abs(loo[3] - (250.0 / 300.0 - 1)) < 1e-12
    assert all(check._kin(pts[2], q) == (q in pts[2:]) for q in pts)


def test_earlier_runs_pairs_join_the_fit_and_the_table(tmp_path, capsys):
    """--with-pairs: two earlier runs' points (each file half of them), no new run: the table
    holds all eight, the fit recovers the law they follow; another family's points are left out
    with a note (an A100's gpu-check finds an H200's pairs beside its report); a file that is
    not a pairs file, and no input at all, are refused with exit 2, naming the flag."""
    from dataclasses import asdict
    check = load_script(SCRIPT, "model_check")
    pts = _law_points(check)
    first, second = tmp_path / "a-pairs.json", tmp_path / "b-pairs.json"
    first.write_text(json.dumps([asdict(p) for p in pts[:4]]))
    second.write_text(json.dumps([asdict(p) for p in pts[4:]]))
    assert check.main(["--with-pairs", str(first), "--with-pairs", str(second)]) == 0
    out = capsys.readouterr().out
    assert sum(line.startswith(("| p0 ", "| p1 ", "| p2 ", "| p3 ", "| p4 ", "| p5 ", "| p6 ", "| p7 ")) for line in out.splitlines()) == 8
    line = next(l for l in out.splitlines() if l.startswith("fitted weights (cycles per modelled cycle): "))
    weights = {u: float(w) for u, w in (pair.split() for pair in line.split(": ")[1].split(", "))}
    expected = {"tensor": 1.5, "mufu": 0.0, "fp32": 0.0, "issue": 0.8, "lsu": 0.0}
    assert all(abs(weights[u] - w) < 0.006 for u, w in expected.items()), weights
    ampere = tmp_path / "sm80-pairs.json"
    ampere.write_text(json.dumps([asdict(p) for p in _law_points(check, "sm_80")]))
    assert check.main(["--with-pairs", str(first), "--with-pairs", str(ampere)]) == 0
    out, err = capsys.readouterr()
    assert sum(line.startswith(("| p0 ", "| p1 ", "| p2 ", "| p3 ")) for line in out.splitlines()) == 4
    assert "left out 8 points compiled for sm_80 (this fit is for sm_90)" in err
    assert check.main(["--with-pairs", str(ampere)]) == 1
    assert "no points compiled for sm_90" in capsys.readouterr().out
    broken = tmp_path / "broken-pairs.json"
    broken.write_text('{"not": "a list of points"}')
    for argv, message in ((["--with-pairs", str(broken)], "is not a benchmarks/model_check.py --pairs file"),
                          ([], "give runs")):
        try:
            check.main(argv)
        except SystemExit as exit_:
            assert exit_.code == 2
        else:
            raise AssertionError(f"{argv} was not refused")
        assert message in capsys.readouterr().err


def test_vs_nope_divides_by_the_same_run_s_nope(tmp_path, capsys):
    """Two runs of one GPU, NoPE timed 200 and 300 in them: each run's GGD row divides by its
    own run's NoPE (an earlier run's rows divided by the last run's NoPE before); a point of
    pairs written before runs were kept takes its file's name as its run; a run without NoPE
    falls back to the device's."""
    from dataclasses import asdict
    check = load_script(SCRIPT, "model_check")
    units = (("fp32", 10.0), ("issue", 80.0), ("lsu", 10.0), ("mufu", 10.0), ("tensor", 100.0))
    def point(prior, measured):
        return check.Point(prior, 128, "fwd", 100.0, measured, "H100", units, "sm_90")
    old = [point("uniform", 200.0), point("ggd", 300.0)]
    new = [point("uniform", 300.0), point("ggd", 330.0)]
    no_nope = [point("laplace", 600.0)]
    files = []
    for name, pts in (("a-pairs.json", old), ("b-pairs.json", new), ("c-pairs.json", no_nope)):
        rows = [asdict(p) for p in pts]
        for row in rows:
            del row["run"]   # written before points kept their run
        (tmp_path / name).write_text(json.dumps(rows))
        files += ["--with-pairs", str(tmp_path / name)]
    assert check.main(files) == 0
    rows = [line.split(" | ") for line in capsys.readouterr().out.splitlines() if line.startswith("| ggd ")
            or line.startswith("| laplace ")]
    assert [r[7] for r in rows] == ["1.50x", "1.10x", "2.00x"], rows
    assert check.load_pairs(tmp_path / "a-pairs.json")[0].run == "a-pairs.json"


def test_vs_nope_divides_by_nope_at_the_same_length():
    """One run at N = 4096 and 16384 (make gpu-check's default sizes): each GGD row divides by
    NoPE at its own length."""
    check = load_script(SCRIPT, "model_check")
    units = (("fp32", 10.0), ("issue", 80.0), ("lsu", 10.0), ("mufu", 10.0), ("tensor", 100.0))
    pts = [check.Point(prior, 128, "fwd", 100.0, measured, "H100", units, "sm_90", "r.json", n)
           for prior, measured, n in (("uniform", 200.0, 4096), ("ggd", 300.0, 4096),
                                      ("uniform", 250.0, 16384), ("ggd", 300.0, 16384))]
    rows = [line.split(" | ") for line in check.table(pts) if line.startswith("| ggd ")]
    assert [r[7] for r in rows] == ["1.50x", "1.20x"], rows
