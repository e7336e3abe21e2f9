"""A Hugging Face model's decode step with bamgen's attention against the model's own (SDPA), on
a left-padded batch: the whole step as generation sees it, host and kernels
(docs/performance.md, "Where a call's host time goes").

    python benchmarks/hf_generate.py             # CUDA: a Llama-shaped model of 8 layers, bf16
    python benchmarks/hf_generate.py --quick     # anywhere: a tiny model in fp32, seconds

Every peer is one model with the same weights, built from a config (nothing is downloaded):
- ``sdpa``: the model as transformers builds it (``attn_implementation="sdpa"``), RoPE;
- ``bamgen-nope``: ``apply_prior(model, "uniform", rope="keep")``: NoPE's prior added to RoPE is
  the model's own attention, so its logits must be sdpa's (the agreement column);
- ``bamgen-nope@reads-every-call``: the same, reading its layout tensors (the left padding's
  per-row offsets) on the host at every layer's call, as bamgen did before
  ``runtime/host_reads.py`` kept them: on a GPU each read waits for the queue;
- ``bamgen-ggd``: ``apply_prior(model, "generalized_gaussian", rope="remove")``.

Each round, every peer in turn prefills the batch (untimed), then takes ``--steps`` greedy
decode steps; a step's time is the loop's wall time over the steps (synchronised at the end:
host and device), and its host time the loop's time before that synchronisation (less than
the wall time when the host runs ahead of the GPU). Medians over the rounds.
"""
from __future__ import annotations

import argparse
import contextlib
import copy
import statistics
import sys
import time
from dataclasses import dataclass
from pathlib import Path

import torch

ROOT = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(ROOT))

PEERS = ("sdpa", "bamgen-nope", "bamgen-nope@reads-every-call", "bamgen-ggd")


@dataclass(frozen=True)
class Shape:
    """The model and the batch."""
    hidden: int
    layers: int
    heads: int
    kv_heads: int
    intermediate: int
    vocab: int
    batch: int
    prompt_min: int
    prompt_max: int


GPU_SHAPE = Shape(hidden=2048, layers=8, heads=16, kv_heads=8, intermediate=5632, vocab=32000,
                  batch=8, prompt_min=256, prompt_max=1024)
QUICK_SHAPE = Shape(hidden=64, layers=2, heads=4, kv_heads=2, intermediate=128, vocab=100,
                    batch=2, prompt_min=5, prompt_max=9)


def llama_config(shape: Shape):
    from transformers import LlamaConfig
    return LlamaConfig(hidden_size=shape.hidden, num_hidden_layers=shape.layers,
                       num_attention_heads=shape.heads, num_key_value_heads=shape.kv_heads,
                       intermediate_size=shape.intermediate, vocab_size=shape.vocab,
                       max_position_embeddings=4 * shape.prompt_max, attn_implementation="sdpa")


def left_padded_batch(shape: Shape, device):
    """(input_ids, attention_mask): prompts of lengths spread over [prompt_min, prompt_max],
    padded on the left to the longest, as a tokenizer pads for generation."""
    gen = torch.Generator().manual_seed(0)
    lengths = torch.linspace(shape.prompt_min, shape.prompt_max, shape.batch).round().long()
    longest = int(lengths.max())
    ids = torch.randint(0, shape.vocab, (shape.batch, longest), generator=gen)
    mask = (torch.arange(longest)[None] >= (longest - lengths)[:, None]).long()
    return ids.to(device), mask.to(device)


def make_models(shape: Shape, names, device, dtype) -> dict:
    """{peer: model}, every one with the weights of the first."""
    from transformers import LlamaForCausalLM

    from bamgen.integrations.transformers import apply_prior
    torch.manual_seed(0)
    base = LlamaForCausalLM(llama_config(shape)).to(device=device, dtype=dtype).eval()
    models = {}
    for name in names:
        model = copy.deepcopy(base)
        if name.startswith("bamgen-nope"):
            apply_prior(model, "uniform", rope="keep")
        elif name == "bamgen-ggd":
            apply_prior(model, "generalized_gaussian", rope="remove")
        models[name] = model.to(device=device, dtype=dtype)
    return models


@contextlib.contextmanager
def reads_every_call(on: bool):
    """bamgen as it was before host_reads kept what it read: every call reads its layout."""
    from bamgen.runtime import host_reads
    if not on:
        yield
        return
    kept = host_reads.reads_wait
    host_reads.reads_wait = lambda tensor: False
    try:
        yield
    finally:
        host_reads.reads_wait = kept


def sync(device) -> None:
    if device.type == "cuda":
        torch.cuda.synchronize()


@torch.no_grad()
def decode_round(model, ids, mask, steps: int, device, every_call: bool):
    """(seconds per step, host seconds per step, the prefill's last logits)."""
    with reads_every_call(every_call):
        out = model(ids, attention_mask=mask, use_cache=True)
        cache, logits = out.past_key_values, out.logits[:, -1].float()
        token = logits.argmax(-1, keepdim=True)
        sync(device)
        start = time.perf_counter()
        for _ in range(steps):
            mask = torch.cat([mask, mask.new_ones(mask.shape[0], 1)], 1)
            out = model(token, attention_mask=mask, past_key_values=cache, use_cache=True)
            cache, token = out.past_key_values, out.logits[:, -1].argmax(-1, keepdim=True)
        host = time.perf_counter() - start
        sync(device)
        wall = time.perf_counter() - start
    return wall / steps, host / steps, logits


def run(shape: Shape, names, steps: int, rounds: int, device, dtype) -> dict:
    models = make_models(shape, names, device, dtype)
    ids, mask = left_padded_batch(shape, device)
    samples = {name: ([], []) for name in names}
    logits = {}
    for name in names:   # warm-up: compiles the kernels, fills the caches
        logits[name] = decode_round(models[name], ids, mask, 2, device, "@reads" in name)[2]
    for _ in range(rounds):
        for name in names:
            wall, host, _ = decode_round(models[name], ids, mask, steps, device, "@reads" in name)
            samples[name][0].append(wall)
            samples[name][1].append(host)
    results = {}
    for name in names:
        diff = None
        if name.startswith("bamgen-nope") and "sdpa" in logits:   # (relative to sdpa's largest)
            diff = float((logits[name] - logits["sdpa"]).abs().max() / logits["sdpa"].abs().max())
        results[name] = dict(step_s=statistics.median(samples[name][0]),
                             host_s=statistics.median(samples[name][1]), logits_diff=diff)
    return results


def print_table(results: dict, shape: Shape, args, device, dtype) -> None:
    print(f"# decode steps, left-padded batch of {shape.batch} (prompts {shape.prompt_min}.."
          f"{shape.prompt_max}), Llama-shaped: {shape.layers} layers, hidden {shape.hidden}, "
          f"{shape.heads}/{shape.kv_heads} heads; {dtype}, {device}"
          f"{' (' + torch.cuda.get_device_name() + ')' if device.type == 'cuda' else ''}; "
          f"{args.steps} steps a round, medians of {args.rounds} alternating rounds")
    base = results.get("sdpa")
    print("| peer | ms / step | host ms / step | / sdpa | logits vs sdpa (max rel.) |")
    print("|---|---:|---:|---:|---:|")
    for name, r in results.items():
        ratio = f"{r['step_s'] / base['step_s']:.2f}x" if base else "-"
        diff = "-" if r["logits_diff"] is None else f"{r['logits_diff']:.1e}"
        print(f"| {name} | {r['step_s'] * 1e3:.3f} | {r['host_s'] * 1e3:.3f} | {ratio} | {diff} |")


def main(argv=None) -> int:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--quick", action="store_true", help="a tiny model in fp32 (a smoke run)")
    ap.add_argument("--steps", type=int, default=None, help="decode steps a round (32; quick 3)")
    ap.add_argument("--rounds", type=int, default=None, help="alternating rounds (5; quick 2)")
    ap.add_argument("--peers", nargs="+", default=list(PEERS), choices=PEERS, metavar="PEER",
                    help=f"of: {' '.join(PEERS)}")
    args = ap.parse_args(argv)
    cuda = torch.cuda.is_available() and not args.quick
    device = torch.device("cuda" if cuda else "cpu")
    dtype = torch.bfloat16 if cuda else torch.float32
    shape = GPU_SHAPE if cuda else QUICK_SHAPE
    args.steps = args.steps or (32 if cuda else 3)
    args.rounds = args.rounds or (5 if cuda else 2)
    if not cuda and not args.quick:
        print("no CUDA GPU: running the quick shape on the CPU (timings are not GPU figures)")
    results = run(shape, args.peers, args.steps, args.rounds, device, dtype)
    print_table(results, shape, args, device, dtype)
    return agreement(results, dtype)


# NoPE with RoPE kept is the model's own attention: its prefill logits against sdpa's, relative
# to their largest (bf16: both round q, k, v and P to 8 bits; fp32: the kernels' order alone)
AGREE = {torch.bfloat16: 3e-2, torch.float32: 1e-4}


def agreement(results: dict, dtype) -> int:
    """0 when every bamgen-nope peer's logits agree with sdpa's, else 1, saying which."""
    bad = [f"{name}: {r['logits_diff']:.1e}" for name, r in results.items()
           if r["logits_diff"] is not None and not r["logits_diff"] <= AGREE[dtype]]
    if bad:
        print(f"agreement FAILED (bound {AGREE[dtype]:.0e}): " + ", ".join(bad))
        return 1
    print("agreement: bamgen-nope's logits are sdpa's" if any(
        r["logits_diff"] is not None for r in results.values()) else "agreement: not checked")
    return 0


if __name__ == "__main__":
    sys.exit(main())
