"""benchmarks/gpu.py works without a GPU: its --quick smoke run (Triton interpreter, tiny sizes)
prints the tables and passes its own checks, and a failed check or a missing GPU is an error."""
import importlib.util
import os
import subprocess
import sys

import pytest
import torch

from tests.helpers import ROOT

SCRIPT = ROOT / "benchmarks" / "gpu.py"


def _load_script():
    spec = importlib.util.spec_from_file_location("bench_gpu", SCRIPT)
    module = importlib.util.module_from_spec(spec)
    sys.modules[spec.name] = module  # dataclasses look their module up there
    spec.loader.exec_module(module)
    return module


def test_quick_gpu_benchmark_runs():
    env = dict(os.environ, TRITON_INTERPRET="1")
    res = subprocess.run([sys.executable, str(SCRIPT), "--quick"], cwd=ROOT, env=env,
                         capture_output=True, text=True, timeout=300)
    assert res.returncode == 0, res.stdout[-3000:] + res.stderr[-3000:]
    out = res.stdout
    assert "interpreter smoke run: timings are not GPU figures" in out, out
    for peer in ("bamgen-ggd", "bamgen-laplace", "bamgen-uniform", "bamgen-ggd-torch", "sdpa",
                 "flex-ggd"):
        assert f"| 48 | 1 | 16 | {peer} |" in out, out
    assert "| 48 | 16 | bamgen-ggd |" in out and "fwd / flex" in out, out
    assert "fa2-alibi: no GPU" in out, out
    # the checks ran: the interpreted kernels against the torch backend, the peers' functions
    for check in ("bamgen-ggd vs bamgen-ggd-torch fwd+grads", "bamgen-laplace vs flex-laplace fwd",
                  "bamgen-uniform vs sdpa fwd"):
        assert check in out, out


def test_a_failed_check_is_reported():
    bench = _load_script()
    results = [{"N": 32, "D": 16, "agreement": {"a vs b fwd": 1e-7, "c vs d fwd+grads": 3e-3,
                                                 "e vs f fwd": float("nan")}}]
    failed = bench.failed_checks(results)
    assert len(failed) == 2 and "c vs d" in failed[0] and "e vs f" in failed[1]


@pytest.mark.skipif(torch.cuda.is_available(), reason="checks the message on a machine without a GPU")
def test_without_a_gpu_the_full_run_says_so(capsys):
    assert _load_script().main([]) == 1
    assert "no GPU" in capsys.readouterr().out
