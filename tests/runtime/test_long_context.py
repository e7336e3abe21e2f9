"""The long-context studies (experiments/perplexity, experiments/passkey_long) and the inference
path they share (experiments/passkey/inference.py): KV-cache decoding and block skipping give
the model's own answers, the reach is bamgen's, the corpus split is fixed, a resumed run is the
uninterrupted one, and each study's smoke run writes its report."""
import json
import math
import subprocess
import sys
from pathlib import Path

import pytest
import torch

ROOT = Path(__file__).resolve().parents[2]
PASSKEY = ROOT / "experiments" / "passkey"
PERPLEXITY = ROOT / "experiments" / "perplexity"
PASSKEY_LONG = ROOT / "experiments" / "passkey_long"


@pytest.fixture(scope="module")
def mods():
    added = [str(p) for p in (PASSKEY, PERPLEXITY, PASSKEY_LONG) if str(p) not in sys.path]
    sys.path[:0] = added
    try:
        import corpus
        import inference
        import lm
        import long_eval
        import model
        import task
        yield dict(corpus=corpus, inference=inference, lm=lm, long_eval=long_eval, model=model,
                   task=task)
    finally:
        for p in added:
            sys.path.remove(p)


def _net(mods, variant, seed=0, jitter=0.3):
    torch.manual_seed(seed)
    net = mods["model"].TinyDecoder(variant, len(mods["task"].VOCAB), 64, d_model=32).eval()
    with torch.no_grad():                      # move the priors off their start
        for name, p in net.named_parameters():
            if ".prior." in name:
                p.add_(jitter * torch.randn_like(p))
    return net


@pytest.mark.parametrize("variant", ["nope", "rope", "alibi", "ggd_nope", "bam_ssmax"])
def test_kv_cache_prefill_in_pieces_gives_the_full_forward(mods, variant):
    inf = mods["inference"]
    net = _net(mods, variant)
    seq, _, _ = mods["task"].make_batch(2, 300, torch.Generator().manual_seed(1), depth=0.4)
    with torch.no_grad():
        full = net(seq)
        cache = inf.KVCache(len(net.blocks))
        parts = [inf.forward_cached(net, seq[:, a:b], cache) for a, b in ((0, 170), (170, 171), (171, 300))]
        last = inf.forward_cached(net, seq[:, :300], inf.KVCache(len(net.blocks)), last_only=True)
    assert torch.allclose(torch.cat(parts, 1), full, atol=1e-5, rtol=1e-4)
    assert last.shape[1] == 1 and torch.allclose(last[:, 0], full[:, -1], atol=1e-5, rtol=1e-4)


@pytest.mark.parametrize("variant", ["rope", "alibi", "bam_ssmax"])
def test_greedy_decode_with_cache_matches_decoding_without(mods, variant):
    inf = mods["inference"]
    net = _net(mods, variant, seed=3)
    seq, _, _ = mods["task"].make_batch(3, 200, torch.Generator().manual_seed(2), depth=0.1)
    prompt = seq[:, :-4]
    with torch.no_grad():
        ref = prompt
        for _ in range(4):                   # no cache: the whole sequence every step
            ref = torch.cat([ref, net(ref)[:, -1].argmax(-1, keepdim=True)], 1)
        tokens, logits = inf.greedy_decode(net, prompt, 4, return_logits=True)
    assert torch.equal(tokens, ref[:, -4:])
    assert logits.shape == (3, 4, len(mods["task"].VOCAB))


def _block_skipped_reference(q, k, v, bias_fn, windows, block):
    """Causal attention with a materialised bias in float64 where a head with window w lets
    query row i (in the block of `block` rows, at least w, that starts at i0) see keys
    i0 - w .. i only: every key within w of the row, and no key farther than the block's."""
    n = q.shape[2]
    i = torch.arange(n)[:, None]
    j = torch.arange(n)[None, :]
    logits = q.double() @ k.double().transpose(-1, -2) / math.sqrt(q.shape[-1]) + bias_fn((i - j).double())
    for h, w in enumerate(windows):
        keep = j <= i
        if w is not None:
            i0 = i // max(block, w) * max(block, w)
            keep &= j >= i0 - w
            assert keep[(i - j >= 0) & (i - j <= w)].all()
        logits[:, h] = logits[:, h].masked_fill(~keep, -math.inf)
    return torch.softmax(logits, -1) @ v.double()


def test_block_skipping_attends_exactly_within_each_window(mods):
    """With a small nats bound the skipped keys carry real weight: the blocked calls
    (q_offset, k_offset) must give attention over exactly the keys they keep, block edges
    included."""
    inf = mods["inference"]
    net = _net(mods, "alibi")
    attn = net.blocks[0].attn
    n = 2500                                   # several query blocks of QUERY_BLOCK rows
    params = {k: v.detach() for k, v in attn.prior.prior_params().items()}
    windows = inf.head_windows("laplace", params, 3.0, n)
    assert windows == [math.floor(3.0 * float(b)) for b in params["b"]]
    g = torch.Generator().manual_seed(0)
    q, k, v = (torch.randn(1, 4, n, 8, generator=g) for _ in range(3))
    got = inf.attend(attn, q, k, v, 0, windows)
    ref = _block_skipped_reference(q, k, v, lambda d: -d.abs() / params["b"].double()[:, None, None],
                                   windows, inf.QUERY_BLOCK)
    assert torch.allclose(got.double(), ref, atol=2e-5)
    full = _block_skipped_reference(q, k, v, lambda d: -d.abs() / params["b"].double()[:, None, None],
                                    [None] * 4, inf.QUERY_BLOCK)
    assert (got.double() - full).abs().max() > 1e-3          # the bound was tight enough to matter
    # with the study's 30-nat bound, skipping changes nothing measurable
    wide = inf.head_windows("laplace", params, 30.0, n)
    assert any(w is not None for w in wide)
    assert torch.allclose(inf.attend(attn, q, k, v, 0, wide), inf.attend(attn, q, k, v, 0, None), atol=1e-6)


def test_no_window_for_anti_local_flat_or_n_dependent_priors(mods):
    inf = mods["inference"]
    anti = {"ta": torch.tensor([2.0, 0.0]), "tb": torch.tensor([-0.7, 1.0]), "tm": torch.zeros(2)}
    assert inf.head_windows("bam", anti, 20.0, 10_000) == [None, 20]
    assert inf.head_windows("bam_ssmax", dict(anti, ssmax=torch.ones(2)), 20.0, 10_000) == [None, None]
    assert inf.head_windows("uniform", {}, 20.0, 100) == [None]
    assert inf.reach("bam", anti, 20.0) == [None, 21]
    penalty = inf.anti_local_penalty("bam", anti, distances=(1, 8))
    assert penalty[1] is None
    assert penalty[0][1] == pytest.approx(math.exp(2.0) * (1 - 2.0 ** (-20 * 0.7)), rel=1e-4)
    assert penalty[0][8] == pytest.approx(math.exp(2.0) * (8 ** -0.7 - 2.0 ** (-20 * 0.7)), rel=1e-4)


@pytest.mark.parametrize("prior, module", [("bam", "bam"), ("laplace", "laplace")])
def test_reach_is_bamgen_shows_reach(mods, prior, module):
    from bamgen.compiler.analysis import analyse_prior
    from bamgen.compiler.spec import load_spec
    from bamgen.compiler.symbolic import analyse
    heads = 8
    shown = analyse_prior(analyse(load_spec(ROOT / "priors" / f"{prior}.yaml")), num_heads=heads)
    gen = mods["model"].load_module(module)
    params = {k: v.tolist() for k, v in gen.default_params(heads).items()}
    assert mods["inference"].reach(module, params, 20.0) == [int(h.reach) for h in shown.heads]


def test_attention_work_counts_the_pairs_left(mods):
    work = mods["long_eval"].attention_work
    assert work(None, 5000, 1024) == 1.0 and work([None, None], 5000, 1024) == 1.0
    n, w = 32768, 120
    assert work([w], n, 1024) == pytest.approx((1024 / 2 + w) / (n / 2), rel=0.05)


def test_wilson_interval(mods):
    wilson = mods["long_eval"].wilson
    assert wilson(0, 10) == pytest.approx((0.0, 0.27753), abs=1e-5)
    assert wilson(5, 10) == pytest.approx((0.23659, 0.76341), abs=1e-5)
    assert wilson(600, 600)[1] == 1.0 and wilson(600, 600)[0] == pytest.approx(0.99364, abs=1e-5)


def test_passkey_samples_are_fixed_per_group(mods):
    sample = mods["long_eval"].sample_group
    a, da = sample(512, 1, 0.25, 3, 4, 4321)
    b, db = sample(512, 1, 0.25, 3, 4, 4321)
    c, _ = sample(512, 1, 0.25, 4, 4, 4321)
    assert torch.equal(a, b) and torch.equal(da, db) and not torch.equal(a, c)
    assert (a[:, -4:] - mods["task"].DIGIT0).eq(da).all()


# ----------------------------------------------------------------------------------------
# The perplexity corpus and training
# ----------------------------------------------------------------------------------------
def test_corpus_split_is_fixed_by_file_name(mods, tmp_path):
    corpus = mods["corpus"]
    names = [f"pkg{i // 10}/mod{i}.py" for i in range(60)] + ["top.py"]
    for name in names:
        (tmp_path / name).parent.mkdir(parents=True, exist_ok=True)
        (tmp_path / name).write_text(f"x = {len(name)}\n")
    (tmp_path / "site-packages").mkdir()
    (tmp_path / "site-packages" / "third.py").write_text("no = 1\n")
    (tmp_path / "notes.txt").write_text("not python\n")
    files = corpus.list_files(str(tmp_path))
    assert sorted(names) == files                                    # *.py only, no site-packages
    train, held = corpus.split_files(files)
    assert set(train) | set(held) == set(files) and not set(train) & set(held)
    assert held and all(corpus.is_held_out(f) for f in held)
    assert held == corpus.split_files(list(reversed(files)))[1]      # order of discovery is irrelevant
    data = corpus.load_corpus(str(tmp_path))
    assert data["held_out"].numel() == sum(len(f"x = {len(n)}\n") + 1 for n in held)
    assert int((data["train"] == 0).sum()) == len(train)             # one NUL after each file


def test_training_windows_and_evaluation_pieces(mods):
    corpus = mods["corpus"]
    stream = torch.arange(10_000) % 251
    stream = stream.to(torch.uint8)
    inp, target = corpus.train_batch(stream, 3, 16, torch.Generator().manual_seed(0))
    assert (inp[:, 0] == corpus.BOS).all() and torch.equal(inp[:, 1:], target[:, :-1])
    offsets = corpus.piece_offsets(stream.numel(), 8 * 64, 64)      # evenly spread over the stream
    assert offsets[0] == 0 and 10_000 - 64 - 8 <= offsets[-1] <= 10_000 - 64
    assert len({b - a for a, b in zip(offsets, offsets[1:])}) == 1
    pieces = corpus.eval_pieces(stream, 8 * 64, 64)
    assert pieces.shape == (8, 64) and all(pieces[i, 0] == stream[o] for i, o in enumerate(offsets))
    for length in (16, 32, 64):                                        # the same bytes at every length
        assert torch.equal(corpus.eval_chunks(pieces, length).flatten(), pieces.flatten())


def test_resumed_training_is_the_uninterrupted_run(mods):
    lm, corpus = mods["lm"], mods["corpus"]
    from train import make_optimizer
    stream = (torch.arange(50_000) * 7919 % 256).to(torch.uint8)
    cfg = dict(steps=4, batch=2, lr=3e-3, prior_lr_mult=10.0, warmup_frac=0.05, weight_decay=0.01,
               clip=1.0, train_length=16, d_model=16, n_layers=1, n_heads=2, log_every=1,
               checkpoint_every=2)
    whole = lm.build_model("ggd_nope", cfg, 0)
    lm.train(whole, cfg, 0, stream, log=lambda *_: None)

    class Stop(Exception):
        pass
    saved = {}

    def stop_at_checkpoint(step, opt, curve):
        saved.update(step=step, model=whole_copy(part), opt=opt.state_dict())
        raise Stop

    def whole_copy(m):
        return {k: v.clone() for k, v in m.state_dict().items()}
    part = lm.build_model("ggd_nope", cfg, 0)
    with pytest.raises(Stop):
        lm.train(part, cfg, 0, stream, log=lambda *_: None, on_checkpoint=stop_at_checkpoint)
    resumed = lm.build_model("ggd_nope", cfg, 0)
    resumed.load_state_dict(saved["model"])
    opt = make_optimizer(resumed, cfg)
    opt.load_state_dict(saved["opt"])
    lm.train(resumed, cfg, 0, stream, log=lambda *_: None, start_step=saved["step"], opt=opt)
    assert saved["step"] == 2
    for (name, a), b in zip(whole.state_dict().items(), resumed.state_dict().values()):
        assert torch.equal(a, b), name
    assert corpus.VOCAB_SIZE == 257


# ----------------------------------------------------------------------------------------
# The studies' commands
# ----------------------------------------------------------------------------------------
def _run(script, *args, timeout=300):
    proc = subprocess.run([sys.executable, str(script), *args], cwd=ROOT, capture_output=True,
                          text=True, timeout=timeout)
    assert proc.returncode == 0, proc.stdout + proc.stderr
    return proc.stdout


def test_perplexity_smoke_run_writes_report_and_resumes(tmp_path):
    out = tmp_path / "ppl"
    stdout = _run(PERPLEXITY / "run.py", "--smoke", "--out", str(out))
    assert "step     2/2" in stdout and "held-out bits/byte" in stdout
    runs = sorted((out / "runs").glob("*.json"))
    assert [p.stem for p in runs] == ["alibi-s0", "bam_ssmax-s0", "ggd_nope-s0", "nope-s0", "rope-s0"]
    rec = json.loads(runs[0].read_text())
    assert set(rec["eval"]) == {"1", "2"} and rec["corpus"]["python"] == sys.version.split()[0]
    assert all(0 < e["bits_per_byte"] < 9 for e in rec["eval"].values())
    md = (out / "results.md").read_text()
    for needle in ("## Headline", "chunked", "| variant | seeds | 1x (32 B) | 2x (64 B) |",
                   "### Reach per head", "GGD, NoPE-like start"):
        assert needle in md
    for png in ("bpb.png", "bpb_by_position.png", "priors.png"):
        assert (out / png).read_bytes()[:4] == b"\x89PNG"
    # a run whose record is lost resumes from its checkpoint and gives the same numbers
    runs[0].unlink()
    stdout = _run(PERPLEXITY / "run.py", "--smoke", "--out", str(out), "--variants", "alibi")
    assert "resuming at step 2, 2 length(s) evaluated" in stdout
    assert json.loads(runs[0].read_text())["eval"] == rec["eval"]


def test_passkey_long_smoke_run_writes_report(tmp_path):
    out = tmp_path / "long"
    stdout = _run(PASSKEY_LONG / "run.py", "--smoke", "--out", str(out))
    assert "round 1/1" in stdout
    recs = {p.stem: json.loads(p.read_text()) for p in (out / "runs").glob("*.json")}
    assert set(recs) == {"ggd_nope-s0", "alibi-s0"}
    for rec in recs.values():
        assert set(rec["cells"]) == {"2", "4"}
        assert sum(len(f) for c in rec["cells"]["4"].values() for f in c["groups"].values()) == 4
        assert rec["checks"]["2"]["0"]["agree"] is True       # skipping changed no digit
    md = (out / "results.md").read_text()
    for needle in ("Wilson", "## Reach of the learned priors", "skip check", "accuracy_long.png"):
        assert needle in md
    assert (out / "accuracy_long.png").read_bytes()[:4] == b"\x89PNG"
    # a rerun finds everything done: nothing evaluated, the report rebuilt
    stdout = _run(PASSKEY_LONG / "run.py", "--smoke", "--out", str(out))
    assert "round" not in stdout and "wrote" in stdout
