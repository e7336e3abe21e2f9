"""The passkey experiment (experiments/passkey): its 1-step smoke run writes a parseable report,
and its model gives the same outputs and gradients through the generated modules as through
a hand-written materialised bias."""
import json
import os
import subprocess
import sys
from pathlib import Path

import pytest
import torch

ROOT = Path(__file__).resolve().parent.parent

PASSKEY = ROOT / "experiments" / "passkey"


@pytest.fixture(scope="module")
def passkey_modules():
    sys.path.insert(0, str(PASSKEY))
    try:
        import model
        import task
        yield model, task
    finally:
        sys.path.remove(str(PASSKEY))


def test_smoke_run_writes_report_runs_and_plots(tmp_path):
    out = tmp_path / "results"
    proc = subprocess.run([sys.executable, str(PASSKEY / "run.py"), "--smoke", "--out", str(out)],
                          cwd=ROOT, capture_output=True, text=True, timeout=120)
    assert proc.returncode == 0, proc.stdout + proc.stderr
    assert "step     1/1" in proc.stdout and "eval" in proc.stdout     # console progress
    runs = sorted((out / "runs").glob("*.json"))
    assert len(runs) == 6                                                # every variant, 1 seed
    for path in runs:
        rec = json.loads(path.read_text())
        assert set(rec["accuracy"]) == {"1", "2"}
        assert all(0.0 <= a <= 1.0 for cell in rec["accuracy"].values() for a in cell.values())
        assert rec["curve"][-1]["step"] == 1
    timing = json.loads((out / "timing.json").read_text())
    assert set(timing["per_variant"]) == {p.stem[:-3] for p in runs}
    md = (out / "results.md").read_text()
    for needle in ("## Headline", "| variant | seeds | 1x | 2x |", "GGD, ALiBi-like start",
                   "materialised / generated", "accuracy.png", "priors.png"):
        assert needle in md
    for png in ("accuracy.png", "priors.png"):
        assert (out / png).read_bytes()[:4] == b"\x89PNG"
    # the report rebuilds from the saved files alone (what --report-only does, minus the plots)
    sys.path.insert(0, str(PASSKEY))
    try:
        import report
        runs = report.load_runs(str(out))
        cfg = next(iter(runs["ggd_alibi"].values()))["config"]
        rebuilt = report.render_markdown(runs, cfg, json.loads((out / "study.json").read_text()),
                                         timing, has_priors=True,
                                         readme=os.path.relpath(PASSKEY / "README.md", out))
    finally:
        sys.path.remove(str(PASSKEY))
    assert rebuilt == md


@pytest.mark.parametrize("variant", ["rope", "alibi", "ggd_nope", "bam_ssmax"])
def test_generated_attention_matches_materialised_bias(passkey_modules, variant):
    model, task = passkey_modules
    torch.manual_seed(0)
    net = model.TinyDecoder(variant, len(task.VOCAB), train_length=32, d_model=32, n_heads=4)
    with torch.no_grad():                      # move the priors off their start
        for name, p in net.named_parameters():
            if ".prior." in name:
                p.add_(0.2 * torch.randn_like(p))
    seq, _, _ = task.make_batch(3, 40, torch.Generator().manual_seed(0))
    results = {}
    for backend in model.BACKENDS:
        net.zero_grad()
        net.set_backend(backend)
        logits = net(seq)
        logits.square().mean().backward()
        results[backend] = (logits.detach(), {n: p.grad.clone() for n, p in net.named_parameters()
                                              if p.grad is not None})
    (gen, gen_grads), (mat, mat_grads) = results["generated"], results["materialised"]
    assert torch.allclose(gen, mat, atol=1e-5, rtol=1e-4)
    assert gen_grads.keys() == mat_grads.keys()
    for name in gen_grads:
        assert torch.allclose(gen_grads[name], mat_grads[name], atol=1e-5, rtol=1e-3), name


def test_task_layout(passkey_modules):
    _, task = passkey_modules
    seq, digits, key_pos = task.make_batch(4, 64, torch.Generator().manual_seed(1), depth=0.0)
    assert len(task.VOCAB) == 29 and seq.shape == (4, 64)
    assert (seq[:, 0] == task.START).all() and (seq[:, -5] == task.QUERY).all()
    assert (key_pos == 1).all() and (seq[:, 1] == task.KEY).all()
    assert torch.equal(seq[:, 2:6] - task.DIGIT0, digits)
    assert torch.equal(seq[:, -4:] - task.DIGIT0, digits)
    _, _, deep = task.make_batch(4, 64, torch.Generator().manual_seed(1), depth=1.0)
    assert (deep == 64 - 2 * task.BLOCK).all()      # the key block ends right before QUERY
