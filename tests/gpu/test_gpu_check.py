"""`make gpu-check` (benchmarks/gpu_check.py): without a GPU one line and exit 0, nothing written;
with one, the six steps it runs select what they should, and one report comes out.

The GPU branch runs here with its steps replaced (no GPU on the development machine); the real
run is `make gpu-check` on a CUDA machine."""
import datetime
import os
import shutil
import subprocess
import sys
from pathlib import Path

import pytest

from tests.helpers import ROOT, load_script

SCRIPT = ROOT / "benchmarks" / "gpu_check.py"
# where nvidia-smi lists a GPU, hiding it from torch is a broken set-up (exit 1), not "no GPU"
HAS_GPU = shutil.which("nvidia-smi") is not None


def _load_script():
    return load_script(SCRIPT, "gpu_check")


def _results_listing():
    folder = ROOT / "docs" / "results" / "gpu"
    return sorted((p.name, p.stat().st_mtime_ns) for p in folder.iterdir())


def _assert_says_no_gpu(res):
    assert res.returncode == 0, res.stdout + res.stderr
    lines = res.stdout.splitlines()
    assert len(lines) == 1, res.stdout                      # one line, and it says why
    assert lines[0].startswith("gpu-check: no GPU here ("), lines[0]
    for command in ("tests/runtime/test_properties.py", "tests/gpu/test_aot.py", "benchmarks/gpu.py",
                    "docs/results/gpu/<device>-<date>.md"):
        assert command in lines[0], lines[0]
    return lines[0]


@pytest.mark.skipif(HAS_GPU, reason="a GPU machine: make gpu-check runs for real there")
def test_make_gpu_check_without_a_gpu_says_so_and_exits_0():
    before = _results_listing()
    env = dict(os.environ, CUDA_VISIBLE_DEVICES="")
    env.pop("TRITON_INTERPRET", None)
    res = subprocess.run(["make", "-s", "gpu-check", f"PYTHON={sys.executable}"], cwd=ROOT,
                         env=env, capture_output=True, text=True, timeout=120)
    line = _assert_says_no_gpu(res)
    assert "sees no CUDA device" in line and "CUDA_VISIBLE_DEVICES=''" in line, line
    assert _results_listing() == before                     # nothing written


@pytest.mark.skipif(HAS_GPU, reason="a GPU machine: make gpu-check runs for real there")
def test_without_torch_it_still_says_no_gpu():
    """A Python without torch (the Makefile's default python3 may be one) gets the same line."""
    code = ("import runpy, sys; sys.modules['torch'] = None; sys.argv = [sys.argv[0]]; "
            f"runpy.run_path({str(SCRIPT)!r}, run_name='__main__')")
    res = subprocess.run([sys.executable, "-c", code], cwd=ROOT, capture_output=True, text=True,
                         timeout=60)
    assert "torch is not importable" in _assert_says_no_gpu(res)


def test_family_and_report_name():
    gc = _load_script()
    assert [gc.family(c) for c in ((8, 0), (8, 6), (8, 9), (9, 0), (10, 0))] == \
        ["sm_80", "sm_80", "sm_80", "sm_90", "sm_90"]
    path = gc.report_path("NVIDIA H100 80GB HBM3", datetime.date(2026, 11, 22), ROOT / "r")
    assert path == ROOT / "r" / "nvidia-h100-80gb-hbm3-2026-11-22.md"


def _collected(*args):
    res = subprocess.run([sys.executable, "-m", "pytest", "--collect-only", "-q",
                          "-p", "no:cacheprovider", *args], cwd=ROOT, capture_output=True,
                         text=True, timeout=300)
    assert res.returncode == 0, res.stdout[-2000:] + res.stderr[-2000:]
    return [line for line in res.stdout.splitlines() if "::" in line]


@pytest.mark.parametrize("arch,other", [("sm_80", "sm_90"), ("sm_90", "sm_80")])
def test_the_aot_step_selects_the_every_run_compiles_for_its_arch_only(arch, other):
    """The compiles `make test` runs for the GPU's family: on sm_90 every shipped prior at head
    dim 128, on sm_80 one prior per tile kind at 64; none of the aot_full matrix (it would not
    fit the step's minute) and none of the other family's."""
    gc = _load_script()
    aot = {s.name: s for s in gc.plan(arch, sys.executable, ROOT / "r.md")}["aot"]
    ids = _collected(*aot.argv[aot.argv.index("tests/gpu/test_aot.py"):])
    from bamgen.resources import shipped_priors
    from tests.gpu.test_aot import REPRESENTATIVE
    matrix = {i.split("[")[1].split("-")[0] for i in ids if "test_kernels_compile_for_gpu" in i}
    want = {p.stem for p in shipped_priors()} if arch == "sm_90" else REPRESENTATIVE
    assert matrix == want, ids
    assert not any("test_decode_kernels_compile_for_every_prior" in i for i in ids), ids
    assert all(arch in i and other not in i for i in ids), ids
    assert len(ids) <= 20, ids   # (a minute on a GPU machine's 15 workers)


def test_the_property_step_runs_the_triton_tests_on_cuda():
    gc = _load_script()
    props = gc.plan("sm_90", sys.executable, ROOT / "r.md")[0]
    assert dict(props.env)["BAMGEN_TEST_DEVICE"] == "cuda"
    ids = _collected(*props.argv[props.argv.index("tests/runtime/test_properties.py"):])
    names = {i.split("::")[1].split("[")[0] for i in ids}
    assert names == {"test_triton_backend_matches_reference", "test_hard_case",
                     "test_hard_case_float_params", "test_module_initialisation_forward_backward",
                     "test_triton_gradients_are_bit_identical_run_to_run",
                     "test_shipped_prior_matches_reference"}, names
    assert not any("test_torch_backend_matches_reference" in i for i in ids)
    library = {i for i in ids if "test_shipped_prior_matches_reference" in i}
    assert all(i.endswith("-triton]") for i in library), library
    assert any("[bam_ssmax-triton]" in i for i in library), library   # (the properties draw no SSMax)


def test_the_compile_step_selects_the_triton_compile_tests():
    gc = _load_script()
    step = {s.name: s for s in gc.plan("sm_90", sys.executable, ROOT / "r.md")}["compile"]
    ids = _collected(*step.argv[step.argv.index("tests/runtime/test_compile.py"):])
    names = {i.split("::")[1].split("[")[0] for i in ids}
    assert names == {"test_triton_path_compiles_through_triton_ops",
                     "test_triton_decode_steps_compile_once",
                     "test_triton_errors_under_compile_are_eager_errors",
                     "test_triton_ops_only_where_contraction_is_off",
                     "test_triton_ops_trace_to_kernel_launches"}, names


def _fake_gpu_run(gc, monkeypatch, tmp_path, failing=(), argv=()):
    """main() as on an H100, with each step's command replaced by a stand-in that takes its
    whole time limit."""
    monkeypatch.setattr(gc, "RESULTS", tmp_path)
    monkeypatch.setattr(gc, "find_gpu", lambda: (gc.Gpu("NVIDIA H100 80GB HBM3", (9, 0)), ""))
    ran, now = [], [0.0]

    def run(step):
        ran.append(step)
        now[0] += step.limit_s
        if step.name in ("benchmark", "variants") and step.name not in failing:
            with open(step.argv[step.argv.index("--json") + 1], "w") as f:
                f.write("{}")
        if step.name == "benchmark" and step.name not in failing:
            md = step.argv[step.argv.index("--markdown") + 1]
            with open(md, "w") as f:
                f.write("| D | N | B | peer |\n|---|---|---|---|\n| 128 | 4096 | 4 | sdpa |\n")
        code = 1 if step.name in failing else 0
        return gc.Outcome(step, code, 1.0, f"{step.name} summary")
    rc = gc.main(list(argv), run=run, today=lambda: datetime.date(2026, 11, 22), clock=lambda: now[0])
    return rc, ran, tmp_path / "nvidia-h100-80gb-hbm3-2026-11-22.md"


def test_with_a_gpu_it_runs_six_steps_and_writes_one_report(monkeypatch, tmp_path, capsys):
    gc = _load_script()
    rc, ran, report = _fake_gpu_run(gc, monkeypatch, tmp_path)
    assert rc == 0
    assert [s.name for s in ran] == ["properties", "aot", "compile", "variants", "benchmark", "model"]
    variants, bench, model = ran[3], ran[4], ran[5]
    bench_json = bench.argv[bench.argv.index("--json") + 1]
    variants_json = variants.argv[variants.argv.index("--json") + 1]
    assert variants_json == str(report.with_name(report.stem + "-variants.json"))
    assert "--kernels" in bench.argv and "--kernels" in variants.argv
    # the variants are timed beside the shipped kernels they vary
    peers = variants.argv[variants.argv.index("--peers") + 1:variants.argv.index("--decode-peers")]
    assert variants.argv[variants.argv.index("--markdown") + 1] == variants_json.replace(".json", ".md")
    assert {p.partition("@")[0] for p in peers if "@" in p} <= set(peers)
    assert {"gather=direct", "gather=async", "fwd=128x64x8x2"} <= {
        pin for p in peers for pin in p.partition("@")[2].split(",")}
    assert "--forward-only" in variants.argv
    assert model.argv[1:4] == ("benchmarks/model_check.py", bench_json, variants_json)
    assert model.argv[model.argv.index("--append") + 1] == str(report)
    assert ran[1].argv[-4:] == ("-k", "sm_90", "-m", "not aot_full")
    assert ran[2].argv[-3:] == ("tests/runtime/test_compile.py", "-k", "triton")
    assert dict(ran[2].env)["BAMGEN_TEST_DEVICE"] == "cuda"
    assert dict(ran[2].env)["TRITON_DEFAULT_FP_FUSION"] == "0"   # (the triton ops need it)
    assert sum(s.limit_s for s in ran) == gc.TOTAL_S < 600         # within 10 minutes
    text = report.read_text()
    assert sum(line.startswith("|---") for line in text.splitlines()) == 1   # one table
    assert "* properties: passed" in text and "* benchmark: passed" in text
    assert f"benchmark table written to {report}" in capsys.readouterr().out


def test_a_failed_step_fails_the_check_and_still_reports(monkeypatch, tmp_path, capsys):
    gc = _load_script()
    rc, ran, report = _fake_gpu_run(gc, monkeypatch, tmp_path, failing=("aot",))
    assert rc == 1 and len(ran) == 6
    assert "* aot: failed (exit 1)" in report.read_text()
    rc, _, _ = _fake_gpu_run(gc, monkeypatch, tmp_path, failing=("benchmark",))
    assert rc == 1 and not report.exists()
    assert "the benchmark wrote no report" in capsys.readouterr().out
    # the variants wrote no JSON: the model reads the benchmark's alone
    for p in tmp_path.iterdir():
        p.unlink()
    rc, ran, report = _fake_gpu_run(gc, monkeypatch, tmp_path, failing=("variants",))
    assert rc == 1 and "* variants: failed (exit 1)" in report.read_text()
    assert ran[5].argv[2:4] == (str(report.with_suffix(".json")), "--arch")


def test_a_second_run_the_same_day_reads_none_of_the_first_s_results(monkeypatch, tmp_path):
    """After a whole run, one that skips the variants step models its own benchmark alone: the
    first run's variants JSON (the same name) is gone before any step runs."""
    gc = _load_script()
    _fake_gpu_run(gc, monkeypatch, tmp_path)
    rc, ran, report = _fake_gpu_run(gc, monkeypatch, tmp_path, argv=["--skip", "variants"])
    assert rc == 0 and [s.name for s in ran][-1] == "model"
    assert ran[-1].argv[2:4] == (str(report.with_suffix(".json")), "--arch")
    assert not report.with_name(report.stem + "-variants.json").exists()


def test_a_short_lease_skips_steps_and_sets_their_limits(monkeypatch, tmp_path):
    gc = _load_script()
    rc, ran, _ = _fake_gpu_run(gc, monkeypatch, tmp_path, argv=[
        "--skip", "aot", "variants", "--limit", "properties=110", "--limit", "compile=50",
        "--limit", "total=260"])
    assert rc == 0
    assert [(s.name, s.limit_s) for s in ran] == [("properties", 110), ("compile", 50),
                                                  ("benchmark", 40), ("model", 60)]


@pytest.mark.parametrize("bad", ["aot", "benchmark=60", "aot=0", "aot=ten"])
def test_a_bad_limit_names_the_steps(bad, capsys):
    gc = _load_script()
    with pytest.raises(SystemExit) as exit_:
        gc.main(["--limit", bad])
    assert exit_.value.code == 2
    assert "STEP=SECONDS with STEP one of properties, aot, compile, variants, model, total" in capsys.readouterr().err


def test_the_variant_peers_are_peers_the_benchmark_takes():
    """Every peer of the variants step parses as benchmarks/gpu.py's --peers, and each pinned
    variant's pins are what its name says."""
    gc = _load_script()
    gpu = load_script(ROOT / "benchmarks" / "gpu.py", "gpu_bench")
    args = gpu.parse_args(__import__("shlex").split(gc.VARIANT_ARGS))
    assert args.peers == list(gc.VARIANT_PEERS) and args.kernels and args.forward_only
    assert args.decode_peers == list(gc.VARIANT_DECODE_PEERS) and args.decode_n == [4096]
    pinned = {name: gpu.split_variant(name)[1] for name in args.peers if "@" in name}
    assert pinned["bamgen-ggd@gather=direct"] == gpu.Variant((), "direct")
    assert pinned["bamgen-ssmax@gather=async"] == gpu.Variant((), "async")
    assert pinned["bamgen-ggd@fwd=128x64x8x2"] == gpu.Variant((("fwd", (128, 64, 8, 2)),), None)
    assert "bamgen-ssmax-inline" in args.peers   # (a build with the other strategy, not a pin)
    assert gpu.split_variant(args.decode_peers[1])[1] == gpu.Variant((), "coalesced")
    # the dK/dV kernel as shipped at 64 on sm_90 and as it was, both pinned (both backwards on
    # the calling thread), their backwards timed (the other peers: forwards alone)
    now = gpu.Variant((("bwd_dkdv", (32, 64, 4, 1)),), None, None, True)
    before = gpu.Variant((("bwd_dkdv", (32, 64, 4, 2)),), None, None, False)
    for prior in ("uniform", "ggd"):
        assert pinned[f"bamgen-{prior}@dkdv_split=on,bwd_dkdv=32x64x4x1"] == now
        assert pinned[f"bamgen-{prior}@dkdv_split=off,bwd_dkdv=32x64x4x2"] == before
    from bamgen.runtime.triton.tiles import DKDV_STEADY_AT, TILES   # ("now": what ships)
    for kind in ("light", "table"):   # (NoPE's and GGD's)
        assert TILES[kind]["sm_90"][64]["bwd_dkdv"][0] == (32, 64, 4, 1)
        assert (kind, "sm_90", 64) in DKDV_STEADY_AT
    assert args.backward_peers == list(gc.VARIANT_BACKWARD_PEERS)
    assert set(args.backward_peers) == {name for name in args.peers if "dkdv_split" in name}


def test_the_model_step_fits_with_every_earlier_run_s_pairs(monkeypatch, tmp_path):
    """Each GPU run adds to the fit: the model step passes the pairs earlier runs left beside
    the report (--with-pairs, sorted), and not the pairs this run is about to write."""
    gc = _load_script()
    for name in ("h200_2026-11-26_pairs.json", "nvidia-h200-2026-11-26-pairs.json",
                 "nvidia-h100-80gb-hbm3-2026-11-22-pairs.json", "notes.json"):
        (tmp_path / name).write_text("[]")
    rc, ran, report = _fake_gpu_run(gc, monkeypatch, tmp_path)
    model = next(step for step in ran if step.name == "model")
    earlier = [model.argv[i + 1] for i, arg in enumerate(model.argv) if arg == "--with-pairs"]
    assert earlier == [str(tmp_path / "h200_2026-11-26_pairs.json"),
                       str(tmp_path / "nvidia-h200-2026-11-26-pairs.json")]
    assert model.argv[model.argv.index("--pairs") + 1] == str(report.with_name(report.stem + "-pairs.json"))


def test_a_killed_test_step_still_names_the_tests_that_failed(tmp_path):
    """The property step of an H100 was killed at its limit after two failures, and pytest's
    summary, the only place that named them, never printed: the test steps now name each
    failure as it happens, and the outcome keeps the names."""
    gc = _load_script()
    (tmp_path / "test_two.py").write_text(
        "import time\n"
        "def test_fails():\n    assert 1 + 1 == 3, 'arithmetic'\n"
        "def test_hangs():\n    time.sleep(120)\n")
    (tmp_path / "conftest.py").write_text((ROOT / "tests" / "conftest.py").read_text())
    props = {s.name: s for s in gc.plan("sm_90", sys.executable, ROOT / "r.md")}["properties"]
    assert ("BAMGEN_FAILURES_AT_ONCE", "1") in props.env
    step = gc.Step("properties", (sys.executable, "-m", "pytest", "-q", "-p", "no:cacheprovider",
                                  str(tmp_path / "test_two.py"), "--rootdir", str(tmp_path)),
                   props.env, 12)
    outcome = gc.run_step(step)
    assert outcome.returncode is None   # killed at its limit, before pytest's summary
    assert len(outcome.failures) == 1, outcome.failures
    assert outcome.failures[0].endswith("test_two.py::test_fails"), outcome.failures
    assert "failed: " in outcome.line() and "test_fails" in outcome.line()
    (test, tail), = outcome.causes   # and why it failed
    assert test == outcome.failures[0] and "AssertionError: arithmetic" in tail, tail


def test_the_report_quotes_each_failure_s_error(tmp_path):
    """A GPU's compile step named three failures and kept no cause, so finding one took another
    command on the GPU: the report now quotes the end of each failure's error, as the test step
    printed it (tests/conftest.py's blocks, interleaved with pytest's other output)."""
    gc = _load_script()
    tails = gc.FailureTails()
    for line in ["..F.", "FAILED tests/a.py::test_x[bf16] (call)", "    wrap(kernel)",
                 "E   RuntimeError: wrap_triton only works on functions annotated with triton.jit",
                 "END FAILED tests/a.py::test_x[bf16]", "..", "FAILED tests/a.py::test_y (setup)",
                 "E   fixture 'z' not found", "END FAILED tests/a.py::test_y",
                 "FAILED tests/a.py::test_x[bf16] - RuntimeError: wrap_triton"]:   # (the summary)
        tails.feed(line + "\n")
    assert tails.causes == [
        ("tests/a.py::test_x[bf16]", "    wrap(kernel)\nE   RuntimeError: wrap_triton only works "
                                     "on functions annotated with triton.jit"),
        ("tests/a.py::test_y", "E   fixture 'z' not found")]
    report = tmp_path / "report.md"
    report.write_text("| peer |\n|---|\n")
    failed = gc.Outcome(gc.Step("compile", ("pytest",), (), 60), 1, 2.0, "2 failed",
                        ("tests/a.py::test_x[bf16]", "tests/a.py::test_y"), tuple(tails.causes))
    passed = gc.Outcome(gc.Step("aot", ("pytest",), (), 60), 0, 1.0, "3 passed")
    gc.finish_report(report, [passed, failed])
    text = report.read_text()
    assert "* compile: failed (exit 1)" in text and "  tests/a.py::test_x[bf16]:" in text
    assert "  E   RuntimeError: wrap_triton only works" in text and "  E   fixture 'z'" in text
    assert text.count("  ```") == 4   # one quoted block per cause


def test_failed_test_reads_pytest_s_failure_lines():
    gc = _load_script()
    assert gc.failed_test("FAILED tests/a.py::test_x[1-2] - AssertionError: no\n") == "tests/a.py::test_x[1-2]"
    assert gc.failed_test("FAILED tests/a.py::test_y (call)\n") == "tests/a.py::test_y"
    assert gc.failed_test("tests/a.py::test_x PASSED\n") is None
    assert gc.failed_test("FAILED tests/a.py::test_z[a b] (setup)\n") == "tests/a.py::test_z[a b]"
    assert gc.failed_test("ERROR tests/a.py::test_w - fixture 'x' not found\n") == "tests/a.py::test_w"


def test_archive_holds_the_run_s_files(monkeypatch, tmp_path, capsys):
    """--archive puts the report and the JSONs the run wrote into one .tar.gz (a rented H100
    sent back eight files at most, and the JSONs of its run were lost)."""
    import tarfile
    gc = _load_script()
    archive = tmp_path / "gpu-check.tgz"
    rc, ran, report = _fake_gpu_run(gc, monkeypatch, tmp_path, argv=("--archive", str(archive)))
    assert rc == 0 and len(ran) == 6
    with tarfile.open(archive) as tar:
        names = [Path(n).name for n in tar.getnames()]
        assert tar.extractfile(tar.getmembers()[0]).read() == report.read_bytes()
    assert names == [report.name, report.stem + ".json", report.stem + "-variants.json"]
    assert f"3 file(s) of this run archived in {archive}" in capsys.readouterr().out
    assert not list(tmp_path.glob("*.partial"))


@pytest.mark.parametrize("bad, says", [("out.zip", "name it .tar.gz"),
                                       ("missing/out.tgz", "does not exist"),
                                       ("afile/out.tgz", "is not a folder")])
def test_a_bad_archive_path_stops_before_any_step(monkeypatch, tmp_path, capsys, bad, says):
    gc = _load_script()
    monkeypatch.chdir(tmp_path)
    (tmp_path / "afile").write_text("")
    with pytest.raises(SystemExit) as stop:
        _fake_gpu_run(gc, monkeypatch, tmp_path, argv=("--archive", bad))
    assert stop.value.code == 2
    err = capsys.readouterr().err
    assert "--archive" in err and says in err
    assert not list(tmp_path.glob("*.md")) and not (tmp_path / bad).exists()
