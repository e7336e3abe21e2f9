"""Training and chunked evaluation of one byte-level language model (one variant, one seed).

The model, optimiser and schedule are the passkey study's (experiments/passkey: model.py,
train.py), with a 257-token vocabulary (bytes and BOS). Runs in one process on one thread.
"""
import math
import time

import torch
import torch.nn.functional as F

from corpus import VOCAB_SIZE, eval_chunks, train_batch, with_bos
from model import VARIANTS, TinyDecoder
from train import lr_at, make_optimizer

LN2 = math.log(2.0)
EVAL_TOKENS_PER_FORWARD = 16384     # chunks per evaluation forward: this many tokens at most


def build_model(variant, cfg, seed, device="cpu"):
    """The run's model, initialised from its seed on the CPU (the same start on any device)."""
    torch.manual_seed(seed)
    model = TinyDecoder(variant, VOCAB_SIZE, cfg["train_length"], d_model=cfg["d_model"],
                        n_layers=cfg["n_layers"], n_heads=cfg["n_heads"])
    return model.to(device)


def _device(model):
    return next(model.parameters()).device


def train(model, cfg, seed, stream, log=print, tag="", start_step=0, opt=None, on_checkpoint=None,
          seconds_before=0.0):
    """Train on random windows of the training stream (next-byte cross-entropy at every
    position). Resumes at start_step with the given optimiser; calls on_checkpoint(step, opt,
    curve) every cfg["checkpoint_every"] steps. Returns the curve points logged in this call (their
    seconds count from the run's start, seconds_before of them spent before this call)."""
    dev = _device(model)
    opt = opt or make_optimizer(model, cfg)
    params = [p for p in model.parameters() if p.requires_grad]
    curve, start = [], time.perf_counter()
    loss_sum, n_avg = 0.0, 0
    for step in range(start_step, cfg["steps"]):
        # one generator per step: a resumed run draws the same windows as an uninterrupted one
        gen = torch.Generator().manual_seed(seed * 1_000_003 + step)
        inp, target = train_batch(stream, cfg["batch"], cfg["train_length"], gen)
        for group in opt.param_groups:
            group["lr"] = lr_at(step, cfg) * group["lr_mult"]
        logits = model(inp.to(dev))
        loss = F.cross_entropy(logits.reshape(-1, VOCAB_SIZE), target.to(dev).reshape(-1))
        opt.zero_grad(set_to_none=True)
        loss.backward()
        torch.nn.utils.clip_grad_norm_(params, cfg["clip"])
        opt.step()
        loss_sum, n_avg = loss_sum + loss.item(), n_avg + 1
        if (step + 1) % cfg["log_every"] == 0 or step + 1 == cfg["steps"]:
            point = dict(step=step + 1, bits_per_byte=loss_sum / n_avg / LN2,
                         seconds=round(seconds_before + time.perf_counter() - start, 1))
            curve.append(point)
            log(f"{tag} step {step + 1:>5}/{cfg['steps']}  train bits/byte "
                f"{point['bits_per_byte']:.3f}  {point['seconds']:6.0f} s")
            loss_sum, n_avg = 0.0, 0
        if on_checkpoint and (step + 1) % cfg["checkpoint_every"] == 0 and step + 1 < cfg["steps"]:
            on_checkpoint(step + 1, opt, curve)
    return curve


@torch.no_grad()
def evaluate_length(model, pieces, cfg, multiple):
    """Held-out bits per byte with non-overlapping chunks of multiple x the training length cut
    from the evaluation pieces (corpus.eval_pieces): the same bytes at every length, every byte
    scored once, each chunk starting from BOS with no context carried over. Returns a dict:
    bits_per_byte over all bytes; by_position, bucketed by position within the chunk (how much
    context a byte had); by_piece_position, bucketed by position within the piece (which bytes:
    the same buckets hold the same bytes at every length, so two lengths compare byte for
    byte); seconds."""
    model.eval()
    dev = _device(model)
    length = cfg["train_length"] * multiple
    chunks = eval_chunks(pieces, length)
    per_forward = max(1, EVAL_TOKENS_PER_FORWARD // length)
    nll = torch.zeros(chunks.shape, dtype=torch.float64)
    start = time.perf_counter()
    for i in range(0, chunks.shape[0], per_forward):
        target = chunks[i:i + per_forward]
        logits = model(with_bos(target).to(dev)).float()
        nll[i:i + per_forward] = F.cross_entropy(logits.reshape(-1, VOCAB_SIZE), target.to(dev).reshape(-1),
                                                 reduction="none").view_as(target).double().cpu()
    seconds = time.perf_counter() - start
    model.train()
    bits = nll / LN2
    return dict(bits_per_byte=float(bits.mean()),
                by_position=position_buckets(bits.mean(0), cfg["train_length"]),
                by_piece_position=position_buckets(bits.view(pieces.shape).mean(0), cfg["train_length"]),
                seconds=round(seconds, 2))


def position_buckets(bits, train_length):
    """Mean bits per byte over positions [0, T), [T, 2T), [2T, 4T), ... of a chunk (T = the
    training length): {"<start>-<end>": value}, how the loss changes as context grows."""
    out, lo, hi = {}, 0, train_length
    while lo < bits.numel():
        hi = min(hi, bits.numel())
        out[f"{lo}-{hi}"] = float(bits[lo:hi].mean())
        lo, hi = hi, hi * 2
    return out
