"""Passkey retrieval at 128x to 512x the training length: the evaluation of one group of samples,
the cost of block skipping, and the confidence interval of an accuracy.

Samples come in fixed groups: group g of (length, depth index) is drawn from its own seed, so a
study can add groups later (more samples) or stop after any group, and every model sees the same
sequences. A sample is correct when greedy decoding with a KV cache (experiments/passkey/
inference.py) writes all passkey digits after QUERY.
"""
import math
import time

import torch

from inference import greedy_decode, model_windows
from task import PASSKEY_DIGITS, make_batch


def sample_group(length, depth_index, depth, group, size, eval_seed):
    """(sequences [size, length], passkey digits [size, 4]) of one group; the same for every
    model and independent of how many groups a study runs."""
    seed = ((eval_seed * 1_000_003 + length) * 101 + depth_index) * 10_007 + group
    seq, digits, _ = make_batch(size, length, torch.Generator().manual_seed(seed), depth=depth)
    return seq, digits


@torch.no_grad()
def decode_answers(model, seq, windows):
    """Greedy digits after QUERY (the prompt is the sequence up to and including QUERY) and the
    logits each step saw: (tokens [B, 4], logits [B, 4, V])."""
    return greedy_decode(model, seq[:, :-PASSKEY_DIGITS], PASSKEY_DIGITS, windows=windows,
                         return_logits=True)


def evaluate_group(model, seq, skip_nats, check=False):
    """Correct flags [B] of one group (all digits right), the seconds it took, and with check
    the comparison with the same decoding without block skipping: {"agree": tokens identical,
    "max_abs_logit_diff": over every step's logits, "seconds_full": its time}."""
    device = next(model.parameters()).device
    seq = seq.to(device)
    windows = model_windows(model, skip_nats, seq.shape[1]) if skip_nats else None
    start = time.perf_counter()
    tokens, logits = decode_answers(model, seq, windows)
    seconds = time.perf_counter() - start
    correct = (tokens == seq[:, -PASSKEY_DIGITS:]).all(-1).cpu()
    result = dict(correct=[bool(c) for c in correct], seconds=seconds)
    if check:
        start = time.perf_counter()
        full_tokens, full_logits = decode_answers(model, seq, None)
        result["check"] = dict(agree=bool(torch.equal(tokens, full_tokens)),
                               max_abs_logit_diff=float((logits - full_logits).abs().max()),
                               seconds_full=time.perf_counter() - start)
    return result


def attention_work(windows, length, block):
    """Fraction of the causal prompt's (query, key) pairs that layer 0 computes with these
    windows (blocked as inference.attend does) against computing all of them: the saving of
    block skipping, per layer-0 head averaged. windows: one layer's per-head list or None."""
    if not windows:
        return 1.0
    full = length * (length + 1) / 2
    done = 0.0
    for w in windows:
        if w is None:
            done += full
            continue
        step = max(block, w)
        for r0 in range(0, length, step):
            r1 = min(length, r0 + step)
            j0 = max(0, r0 - w)
            # row r of the block sees keys j0 .. r
            done += (r1 - r0) * (r0 - j0) + (r1 - r0) * (r1 - r0 + 1) / 2
    return done / (full * len(windows))


def wilson(successes, n, z=1.959963984540054):
    """The Wilson score interval (95% by default) of a proportion: (low, high)."""
    if n == 0:
        return (0.0, 1.0)
    p = successes / n
    centre = (p + z * z / (2 * n)) / (1 + z * z / n)
    half = z * math.sqrt(p * (1 - p) / n + z * z / (4 * n * n)) / (1 + z * z / n)
    return (max(0.0, centre - half), min(1.0, centre + half))
