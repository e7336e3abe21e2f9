"""The passkey experiment (experiments/passkey): its 1-step smoke run writes a parseable report,
and its model gives the same outputs and gradients through the generated modules as through
a hand-written materialised bias; packed training (run.py --packed) fills rows exactly with
valid samples, sees each document as if alone (outputs and gradients) and lowers the loss."""
import json
import math
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


def _tiny_model_off_start(model, task, variant):
    """A small model of the variant with its prior parameters moved off their start."""
    torch.manual_seed(0)
    net = model.TinyDecoder(variant, len(task.VOCAB), train_length=32, d_model=32, n_heads=4)
    with torch.no_grad():
        for name, p in net.named_parameters():
            if ".prior." in name:
                p.add_(0.2 * torch.randn_like(p))
    return net


def _assert_same_logits_and_grads(a, b):
    """(logits, {parameter: grad}) pairs agree to float32 rounding of two attention paths."""
    (logits_a, grads_a), (logits_b, grads_b) = a, b
    assert torch.allclose(logits_a, logits_b, atol=1e-5, rtol=1e-4)
    assert grads_a.keys() == grads_b.keys()
    for name in grads_a:
        assert torch.allclose(grads_a[name], grads_b[name], atol=1e-5, rtol=1e-3), name


@pytest.mark.parametrize("variant", ["rope", "alibi", "ggd_nope", "bam_ssmax"])
def test_generated_attention_matches_materialised_bias(passkey_modules, variant):
    model, task = passkey_modules
    net = _tiny_model_off_start(model, task, variant)
    seq, _, _ = task.make_batch(3, 40, torch.Generator().manual_seed(0))
    results = {}
    for backend in model.BACKENDS:
        net.zero_grad()
        net.set_backend(backend)
        logits = net(seq)
        logits.square().mean().backward()
        results[backend] = (logits.detach(), {n: p.grad.clone() for n, p in net.named_parameters()
                                              if p.grad is not None})
    _assert_same_logits_and_grads(results["generated"], results["materialised"])


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


# ----------------------------------------------------------------------------------------
# Packed training (run.py --packed): documents of random lengths packed into exact rows
# ----------------------------------------------------------------------------------------
@pytest.fixture(scope="module")
def passkey_train(passkey_modules):
    sys.path.insert(0, str(PASSKEY))
    try:
        import train
        yield train
    finally:
        sys.path.remove(str(PASSKEY))


def test_packed_batch_rows_are_exact_and_every_document_a_valid_sample(passkey_modules):
    model, task = passkey_modules
    batch = task.make_packed_batch(6, 48, 12, torch.Generator().manual_seed(3))
    cu = batch.cu_seqlens
    assert cu.dtype == torch.int32 and batch.seq.shape == (1, 6 * 48) and int(cu[-1]) == 6 * 48
    lengths = (cu[1:] - cu[:-1]).tolist()
    assert all(12 <= n <= 48 for n in lengths) and len(set(lengths)) > 1
    assert {48 * r for r in range(7)} <= set(cu.tolist())          # no document spans two rows
    assert torch.equal(model.document_positions(cu),
                       torch.cat([torch.arange(n) for n in lengths]))
    seq = batch.seq[0]
    for d, (start, end) in enumerate(zip(cu[:-1].tolist(), cu[1:].tolist())):
        doc, key = seq[start:end], int(batch.key_pos[d])
        assert doc[0] == task.START and doc[key] == task.KEY and doc[-5] == task.QUERY
        assert torch.equal(doc[key + 1:key + 5], doc[-4:])           # the answer is the passkey
        assert torch.equal(batch.answer_index[d], torch.arange(end - 5, end - 1))
        assert batch.loss_weights[start:end - 1].sum() == end - start - 1 - 4
        if end < len(seq):
            assert batch.loss_weights[end - 1] == 0                  # no target across documents


@pytest.mark.parametrize("variant", ["rope", "ggd_nope", "bam_ssmax", "fox"])
def test_packed_forward_and_gradients_match_each_document_alone(passkey_modules, variant):
    model, task = passkey_modules
    net = _tiny_model_off_start(model, task, variant)
    batch = task.make_packed_batch(3, 40, 12, torch.Generator().manual_seed(0))
    cu = batch.cu_seqlens.tolist()
    assert len(cu) > 4                         # several documents, of different lengths

    def run(packed):
        net.zero_grad()
        if packed:
            logits = net(batch.seq, cu_seqlens=batch.cu_seqlens)
        else:
            logits = torch.cat([net(batch.seq[:, s:e]) for s, e in zip(cu[:-1], cu[1:])], 1)
        logits.square().mean().backward()
        return logits.detach(), {n: p.grad.clone() for n, p in net.named_parameters()
                                 if p.grad is not None}

    _assert_same_logits_and_grads(run(packed=True), run(packed=False))


def test_packed_training_steps_lower_a_finite_loss(passkey_train):
    cfg = dict(steps=16, batch=4, lr=3e-3, prior_lr_mult=10.0, warmup_frac=0.05,
               weight_decay=0.01, clip=1.0, train_length=32, d_model=32, n_layers=2, n_heads=4,
               backend="generated", log_every=4, packed=True, packed_min_length=12)
    model = passkey_train.build_model("ggd_nope", cfg, seed=0)
    start = model.prior_params()
    curve, _seconds = passkey_train.train(model, cfg, seed=0, log=lambda msg: None)
    losses = [point["loss"] for point in curve]
    assert len(losses) == 4 and all(math.isfinite(x) for x in losses)
    assert losses[-1] < 0.9 * losses[0], losses       # 6.72 -> 5.78 at these seeds
    assert model.prior_params() != start       # the prior learned through the packed backward


def test_packed_option_refuses_what_cannot_take_packing(passkey_modules):
    for argv, needle in ((["--packed", "--backend", "materialised"], "--backend generated"),
                         (["--packed", "--timing-steps", "3"], "--timing-steps")):
        proc = subprocess.run([sys.executable, str(PASSKEY / "run.py"), *argv],
                              cwd=ROOT, capture_output=True, text=True, timeout=60)
        assert proc.returncode == 2 and needle in proc.stderr and "Traceback" not in proc.stderr
    model, task = passkey_modules
    net = model.TinyDecoder("ggd_nope", len(task.VOCAB), train_length=32, d_model=32)
    net.set_backend("materialised")
    batch = task.make_packed_batch(1, 32, 12, torch.Generator().manual_seed(0))
    with pytest.raises(ValueError, match="backend='generated'"):
        net(batch.seq, cu_seqlens=batch.cu_seqlens)
