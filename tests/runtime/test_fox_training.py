"""A tiny Forgetting Transformer trained through bamgen against FoX written the usual way.

The perplexity study's model (experiments/passkey/model.py, variant "fox": 2 layers, d_model 64,
4 heads, a forget gate per head from a projection of x) on bytes of the Python standard library,
with the study's optimiser and schedule, 200 steps. One run takes its attention from
generated/forget_gate.py with pos_q = pos_k = logsigmoid(gates).cumsum(-1), the others from a
materialised [B, H, N, N] bias c_i - c_j through SDPA (float32, and float64 as the reference).
Every step's loss must agree within float32 rounding, judged as the tolerance scheme judges a
kernel (tests/tolerance.py): bamgen's float32 losses stand no further from the float64 run than
twice the float32 materialised run does, plus the float32 floor; so must the trained gates."""
import copy
import sys
from pathlib import Path

import pytest
import torch
import torch.nn.functional as F

ROOT = Path(__file__).resolve().parents[2]
STUDY = [ROOT / "experiments" / "passkey", ROOT / "experiments" / "perplexity"]
FLOAT32_FLOOR = 1e-5   # tests/tolerance.py's atol for float32
CFG = dict(steps=200, batch=4, train_length=32, lr=3e-3, prior_lr_mult=10.0, warmup_frac=0.05,
           weight_decay=0.01, clip=1.0)


@pytest.fixture(scope="module")
def study():
    added = [str(p) for p in STUDY if str(p) not in sys.path]
    sys.path[:0] = added
    try:
        import corpus
        import model
        import train
        yield corpus, model, train
    finally:
        for p in added:
            sys.path.remove(p)


def _stream(corpus):
    """A few training files of the study's corpus, as its byte stream."""
    train_files, _ = corpus.split_files(corpus.list_files())
    data = b"".join(Path(corpus.stdlib_root(), name).read_bytes() + b"\x00"
                    for name in train_files[:8])
    return torch.frombuffer(bytearray(data), dtype=torch.uint8)


def _losses(net, study, stream, dtype, backend):
    corpus, model, train = study
    net = copy.deepcopy(net).to(dtype)
    net.set_backend(backend)
    opt = train.make_optimizer(net, CFG)
    losses = []
    for step in range(CFG["steps"]):
        gen = torch.Generator().manual_seed(step)
        inp, target = corpus.train_batch(stream, CFG["batch"], CFG["train_length"], gen)
        for group in opt.param_groups:
            group["lr"] = train.lr_at(step, CFG) * group["lr_mult"]
        logits = net(inp)
        loss = F.cross_entropy(logits.reshape(-1, corpus.VOCAB_SIZE), target.reshape(-1))
        opt.zero_grad(set_to_none=True)
        loss.backward()
        torch.nn.utils.clip_grad_norm_(net.parameters(), CFG["clip"])
        opt.step()
        losses.append(loss.item())
    return torch.tensor(losses, dtype=torch.float64), net


def _assert_within_float32_rounding(what, ours, pt, ref):
    ours, pt = ours.double(), pt.double()
    bound = 2 * (pt - ref).abs().max() + FLOAT32_FLOOR * max(1.0, ref.abs().max().item())
    error = (ours - ref).abs().max()
    assert error <= bound, f"{what}: bamgen is {error:.3g} from float64, the bound {bound:.3g}"


def test_fox_trains_as_a_materialised_bias(study):
    corpus, model, _ = study
    torch.manual_seed(0)
    net = model.TinyDecoder("fox", corpus.VOCAB_SIZE, CFG["train_length"], d_model=64,
                            n_layers=2, n_heads=4)
    stream = _stream(corpus)
    ref, ref_net = _losses(net, study, stream, torch.float64, "materialised")
    pt, pt_net = _losses(net, study, stream, torch.float32, "materialised")
    ours, ours_net = _losses(net, study, stream, torch.float32, "generated")
    assert ref[-20:].mean() < 0.8 * ref[:20].mean()   # (it learns: not a flat line)
    _assert_within_float32_rounding("the step losses", ours, pt, ref)
    for block, (want, got, same) in enumerate(zip(ref_net.blocks, ours_net.blocks, pt_net.blocks)):
        for name in ("weight", "bias"):   # the forget gates trained alike
            _assert_within_float32_rounding(
                f"layer {block} gate {name}", getattr(got.attn.fgate, name).detach(),
                getattr(same.attn.fgate, name).detach(), getattr(want.attn.fgate, name).detach())
