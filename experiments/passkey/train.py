"""Training, evaluation and timing of one passkey model (one variant, one seed).

Everything here runs in a single process on a single thread (the study runs two such
processes side by side); results are plain dicts that run.py saves as JSON.
"""
import math
import time

import torch
import torch.nn.functional as F

from model import VARIANTS, TinyDecoder
from task import (PASSKEY_DIGITS, VOCAB, answer_positions, loss_weights, make_batch,
                  make_packed_batch)

EVAL_TOKENS_PER_CHUNK = 32768     # samples per evaluation forward: this many tokens at most


def single_thread():
    """One intra-op and one inter-op thread: two study processes then use one core each. The
    generated CPU path starts as many workers as torch.get_num_threads(), i.e. one."""
    torch.set_num_threads(1)
    try:
        torch.set_num_interop_threads(1)
    except RuntimeError:          # already set in this process
        pass


def build_model(variant, cfg, seed, device="cpu"):
    """The model of a run, initialised from the run's seed (on the CPU, so that a seed gives
    the same start on any device), then moved to the device: on CUDA the generated modules run
    their Triton kernels."""
    torch.manual_seed(seed)
    model = TinyDecoder(variant, len(VOCAB), cfg["train_length"], d_model=cfg["d_model"],
                        n_layers=cfg["n_layers"], n_heads=cfg["n_heads"])
    model.set_backend(cfg.get("backend", "generated"))
    return model.to(device)


def _device(model):
    return next(model.parameters()).device


def _sync(model):
    """Wait for queued GPU work, so that wall-clock timings are complete."""
    if _device(model).type == "cuda":
        torch.cuda.synchronize()


def make_optimizer(model, cfg):
    """AdamW in three groups: weight matrices (decayed); norms, biases and embeddings (not
    decayed); the prior parameters (not decayed, learning rate x cfg["prior_lr_mult"]: a short
    run moves them too little otherwise, and decay would pull the log-scale ta towards 0, i.e.
    towards a different prior rather than towards 'no prior')."""
    groups = {"decay": [], "no_decay": [], "prior": []}
    for name, p in model.named_parameters():
        if not p.requires_grad:
            continue
        if ".prior." in name:
            groups["prior"].append(p)
        elif p.dim() == 2 and "embed" not in name:
            groups["decay"].append(p)
        else:
            groups["no_decay"].append(p)
    settings = {"decay": (cfg["weight_decay"], 1.0), "no_decay": (0.0, 1.0),
                "prior": (0.0, cfg["prior_lr_mult"])}
    return torch.optim.AdamW([{"params": ps, "weight_decay": settings[k][0], "lr_mult": settings[k][1]}
                              for k, ps in groups.items() if ps],
                             lr=cfg["lr"], betas=(0.9, 0.98))


def lr_at(step, cfg):
    """Linear warm-up, then cosine decay to 10% of the peak."""
    steps, warm = cfg["steps"], max(1, int(cfg["warmup_frac"] * cfg["steps"]))
    if step < warm:
        return cfg["lr"] * (step + 1) / warm
    t = (step - warm) / max(1, steps - warm)
    return cfg["lr"] * (0.1 + 0.9 * 0.5 * (1 + math.cos(math.pi * t)))


def batch_loss(model, seq, key_pos):
    """Loss = cross-entropy on the answer digits + next-token cross-entropy everywhere else
    that is predictable. Returns (loss, fraction of sequences with all answer digits right)."""
    length = seq.shape[1]
    weights = loss_weights(seq, key_pos).to(_device(model))
    seq = seq.to(_device(model))
    logits = model(seq)[:, :-1]
    targets = seq[:, 1:]
    token_loss = F.cross_entropy(logits.reshape(-1, logits.shape[-1]), targets.reshape(-1),
                                 reduction="none").view_as(targets)
    lm_loss = (token_loss * weights).sum() / weights.sum()
    ans = answer_positions(length)
    answer_loss = token_loss[:, ans].mean()
    correct = (logits[:, ans].argmax(-1) == targets[:, ans]).all(-1).float().mean()
    return answer_loss + lm_loss, float(correct)


def packed_batch_loss(model, batch):
    """batch_loss of a task.PackedBatch: the same two terms, over every document of the packed
    sequence, in one packed forward. Returns (loss, fraction of documents with all answer
    digits right)."""
    device = _device(model)
    seq = batch.seq.to(device)
    logits = model(seq, cu_seqlens=batch.cu_seqlens.to(device))[0, :-1]
    targets = seq[0, 1:]
    token_loss = F.cross_entropy(logits, targets, reduction="none")
    weights = batch.loss_weights.to(device)
    lm_loss = (token_loss * weights).sum() / weights.sum()
    ans = batch.answer_index.to(device)                               # [docs, 4]
    answer_loss = token_loss[ans].mean()
    correct = (logits[ans].argmax(-1) == targets[ans]).all(-1).float().mean()
    return answer_loss + lm_loss, float(correct)


def training_step_loss(model, cfg, gen):
    """The loss of one fresh training batch: cfg["batch"] sequences of the training length, or
    with cfg["packed"] as many rows of that length packed with documents of random lengths."""
    if cfg.get("packed"):
        batch = make_packed_batch(cfg["batch"], cfg["train_length"], cfg["packed_min_length"], gen)
        return packed_batch_loss(model, batch)
    seq, _digits, key_pos = make_batch(cfg["batch"], cfg["train_length"], gen)
    return batch_loss(model, seq, key_pos)


def train(model, cfg, seed, log=print, tag=""):
    """Train for cfg["steps"] steps on fresh random batches. Returns the logged curve and the
    time spent."""
    gen = torch.Generator().manual_seed(10_000 + seed)
    opt = make_optimizer(model, cfg)
    params = [p for p in model.parameters() if p.requires_grad]
    curve, start = [], time.perf_counter()
    loss_sum = acc_sum = 0.0
    n_avg = 0
    for step in range(cfg["steps"]):
        for group in opt.param_groups:
            group["lr"] = lr_at(step, cfg) * group["lr_mult"]
        loss, acc = training_step_loss(model, cfg, gen)
        opt.zero_grad(set_to_none=True)
        loss.backward()
        torch.nn.utils.clip_grad_norm_(params, cfg["clip"])
        opt.step()
        loss_sum, acc_sum, n_avg = loss_sum + loss.item(), acc_sum + acc, n_avg + 1
        if (step + 1) % cfg["log_every"] == 0 or step + 1 == cfg["steps"]:
            elapsed = time.perf_counter() - start
            point = dict(step=step + 1, loss=loss_sum / n_avg, answer_acc=acc_sum / n_avg,
                         seconds=round(elapsed, 1))
            curve.append(point)
            log(f"{tag} step {step + 1:>5}/{cfg['steps']}  loss {point['loss']:.3f}  "
                f"answer acc {point['answer_acc']:.2f}  {elapsed:6.0f} s")
            loss_sum = acc_sum = 0.0
            n_avg = 0
    return curve, time.perf_counter() - start


def eval_batches(length, depth_index, depth, n_samples, eval_seed):
    """The evaluation samples of one (length, depth) cell, in chunks; the same for every
    model, so variants and seeds are compared on identical sequences."""
    gen = torch.Generator().manual_seed(eval_seed * 1_000_003 + length * 101 + depth_index)
    seq, digits, _ = make_batch(n_samples, length, gen, depth=depth)
    chunk = max(1, EVAL_TOKENS_PER_CHUNK // length)
    for i in range(0, n_samples, chunk):
        yield seq[i:i + chunk], digits[i:i + chunk]


@torch.no_grad()
def passkey_correct(model, seq):
    """Whether greedy decoding after QUERY writes every passkey digit right, per sequence.

    One teacher-forced pass is exact here: greedy decoding gets all digits right iff the argmax
    at each answer position, given the true digits before it, is the true digit (until the
    first wrong digit both agree, and either way the sample counts as wrong)."""
    length = seq.shape[1]
    ans = answer_positions(length)
    seq = seq.to(_device(model))
    pred = model(seq, positions=ans).argmax(-1)
    return (pred == seq[:, ans + 1]).all(-1)


def evaluate(model, cfg, log=print, tag=""):
    """Accuracy per length multiple and depth: {multiple: {depth: fraction}} with string keys,
    and the seconds spent per multiple."""
    model.eval()
    acc, seconds = {}, {}
    for mult in cfg["multiples"]:
        length = cfg["train_length"] * mult
        start = time.perf_counter()
        acc[str(mult)] = {}
        for di, depth in enumerate(cfg["depths"]):
            right = sum(int(passkey_correct(model, seq).sum())
                        for seq, _ in eval_batches(length, di, depth, cfg["eval_samples"],
                                                   cfg["eval_seed"]))
            acc[str(mult)][str(depth)] = right / cfg["eval_samples"]
        seconds[str(mult)] = round(time.perf_counter() - start, 2)
        mean = sum(acc[str(mult)].values()) / len(cfg["depths"])
        log(f"{tag} eval {mult:>3}x ({length:>5} tokens)  accuracy {mean:.2f}  "
            f"{seconds[str(mult)]:6.1f} s")
    model.train()
    return acc, seconds


def run_one(variant, seed, cfg, log=print, device="cpu"):
    """Train and evaluate one model; the record that run.py stores as runs/<variant>-s<seed>.json."""
    single_thread()
    tag = f"[{variant} s{seed}]"
    model = build_model(variant, cfg, seed, device)
    initial = model.prior_params()
    curve, train_s = train(model, cfg, seed, log=log, tag=tag)
    accuracy, eval_s = evaluate(model, cfg, log=log, tag=tag)
    return dict(variant=variant, label=VARIANTS[variant]["label"], seed=seed, config=cfg,
                curve=curve, train_seconds=round(train_s, 1), eval_seconds=eval_s,
                accuracy=accuracy, initial_prior=initial, learned_prior=model.prior_params(),
                passkey_digits=PASSKEY_DIGITS, device=str(device))


# ----------------------------------------------------------------------------------------
# Wall time of the generated CPU path against the same model with a materialised bias.
# ----------------------------------------------------------------------------------------
def _time_train_steps(model, cfg, steps, gen):
    opt = make_optimizer(model, cfg)
    _sync(model)
    start = time.perf_counter()
    for _ in range(steps):
        seq, _d, key_pos = make_batch(cfg["batch"], cfg["train_length"], gen)
        loss, _ = batch_loss(model, seq, key_pos)
        opt.zero_grad(set_to_none=True)
        loss.backward()
        opt.step()
    _sync(model)
    return (time.perf_counter() - start) / steps


def _time_eval_chunk(model, length, eval_samples):
    """Seconds per sample of one evaluation forward of the study's chunk size at this length
    (the materialised baseline builds its bias once per forward, so the chunk size matters)."""
    samples = max(1, min(eval_samples, EVAL_TOKENS_PER_CHUNK // length))
    seq, _d, _k = make_batch(samples, length, torch.Generator().manual_seed(0), depth=0.5)
    _sync(model)
    start = time.perf_counter()
    passkey_correct(model, seq)
    _sync(model)
    return (time.perf_counter() - start) / samples


def time_backends(cfg, variants, steps, repeats, log=print, device="cpu"):
    """Seconds per training step and per evaluation sample at each length multiple, for the
    generated path and the materialised-bias baseline, on the same model and data.

    Training steps: the two backends take turns for `repeats` rounds of `steps` steps, so that
    load from other processes hits both alike; the median round counts. Evaluation: one forward
    of the study's chunk size per length and backend (seconds long at the long lengths, and
    the two differ by far more than the noise)."""
    single_thread()
    out = {}
    backends = ("generated", "materialised")
    for variant in variants:
        model = build_model(variant, dict(cfg, backend="generated"), 0, device)
        step_times = {b: [] for b in backends}
        for _ in range(repeats):
            for backend in backends:
                model.set_backend(backend)
                step_times[backend].append(
                    _time_train_steps(model, cfg, steps, torch.Generator().manual_seed(1)))
        model.eval()
        out[variant] = {}
        for backend in backends:
            model.set_backend(backend)
            out[variant][backend] = {
                "train_step": _median(step_times[backend]),
                "eval_sample": {str(m): _time_eval_chunk(model, cfg["train_length"] * m, cfg["eval_samples"])
                                for m in cfg["multiples"]}}
        g, mat = out[variant]["generated"], out[variant]["materialised"]
        last = str(cfg["multiples"][-1])
        log(f"[timing] {variant}: train step {g['train_step'] * 1e3:.0f} ms generated vs "
            f"{mat['train_step'] * 1e3:.0f} ms materialised; eval at {last}x "
            f"{g['eval_sample'][last]:.2f} vs {mat['eval_sample'][last]:.2f} s/sample")
    return out


def _median(xs):
    xs = sorted(xs)
    n = len(xs)
    return xs[n // 2] if n % 2 else 0.5 * (xs[n // 2 - 1] + xs[n // 2])
