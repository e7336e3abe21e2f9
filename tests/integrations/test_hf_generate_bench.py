"""benchmarks/hf_generate.py works without a GPU: its --quick run (a tiny Llama on the CPU)
times every peer and holds NoPE with RoPE kept to the model's own SDPA."""
from tests.helpers import ROOT, load_script

SCRIPT = ROOT / "benchmarks" / "hf_generate.py"


def test_quick_hf_generate_benchmark_runs(capsys):
    bench = load_script(SCRIPT, "bench_hf_generate")
    assert bench.main(["--quick", "--steps", "1", "--rounds", "1"]) == 0
    out = capsys.readouterr().out
    for peer in bench.PEERS:
        assert f"| {peer} |" in out, out
    assert "agreement: bamgen-nope's logits are sdpa's" in out, out


def test_the_agreement_check_fails_where_nope_departs_from_sdpa(capsys):
    bench = load_script(SCRIPT, "bench_hf_generate")
    import torch
    results = {"sdpa": dict(step_s=1.0, host_s=1.0, logits_diff=None),
               "bamgen-nope": dict(step_s=1.0, host_s=1.0, logits_diff=0.5)}
    assert bench.agreement(results, torch.float32) == 1
    assert "agreement FAILED" in capsys.readouterr().out
