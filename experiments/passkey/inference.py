"""Cheap inference at long lengths for the tiny decoders of model.py: a KV cache, greedy decoding
with it, and block skipping where a head's learned prior allows it.

Three things make a 32768-token evaluation affordable on one CPU core, all through the generated
modules' public `attention(...)`:

* **Memory linear in N.** The generated CPU path never builds an [N, N] tensor.
* **KV cache.** The prompt runs once (`prefill`); every later token is one query row against the
  cached keys (`q_offset` = its position, `k_offset` = 0). The last layer's attention runs only
  for the rows whose logits are asked for, because no later layer reads its other rows.
* **Block skipping.** For a distance-only prior (ALiBi, the BAM GGD; not BAM-SSMax, whose logit
  also depends on the number of visible keys n), a head whose log-prior drops more than
  `skip_nats` below its peak beyond distance R (its *window*, see `head_windows`) attends query
  block [i0, i1) to keys [i0 - R, i1) only: one `attention(..., q_offset=i0, k_offset=i0 - R)`
  call per block. The keys left out carry at most N * exp(-skip_nats + content-score spread) of
  the weight; the studies check the effect against the full computation on real samples.

Nothing here trains: everything runs under torch.no_grad() with the prior parameters detached.
"""
import torch

from model import load_module, rotary

QUERY_BLOCK = 1024        # query rows per attention call in the blocked path


# ----------------------------------------------------------------------------------------
# The learned prior as a function of distance, and the reach of each head.
# ----------------------------------------------------------------------------------------
def log_prior_curve(module_name, params, distances):
    """log-prior [H, len(distances)] in float64 at distances d >= 0 for a distance-only prior:
    laplace -d/b; bam -exp(ta)(|d + 2 sinh(tm)| + 1e-5)^tb (the prior files' formulas); zeros for
    uniform. params: {name: [H] values} (tensors or lists)."""
    d = torch.as_tensor(distances, dtype=torch.float64)[None, :]
    p = {k: torch.as_tensor(v, dtype=torch.float64).reshape(-1, 1) for k, v in params.items()}
    if module_name == "uniform":
        return torch.zeros(1, d.shape[1], dtype=torch.float64)
    if module_name == "laplace":
        return -d / p["b"]
    if module_name in ("bam", "bam_ssmax"):
        shift = 2 * torch.sinh(p["tm"])
        return -torch.exp(p["ta"]) * ((d + shift).abs() + 1e-5) ** p["tb"]
    raise ValueError(f"no log-prior formula for module {module_name!r}")


def head_windows(module_name, params, nats, max_distance):
    """Per head, the largest distance R in [0, max_distance] whose log-prior is within `nats` of
    the head's peak over that range; keys farther back than R are below peak - nats and may be
    skipped. None for a head that keeps every key (R = max_distance), and for every head of a
    prior that is not a function of the distance alone (BAM-SSMax) or has no prior (uniform)."""
    if module_name in ("uniform", "bam_ssmax"):
        heads = 1 if module_name == "uniform" else len(next(iter(params.values())))
        return [None] * heads
    curve = log_prior_curve(module_name, params, torch.arange(max_distance + 1))
    top = curve.max(dim=1, keepdim=True).values
    within = curve >= top - nats
    windows = []
    for h in range(curve.shape[0]):
        last = int(torch.nonzero(within[h]).max())
        windows.append(None if last >= max_distance else last)
    return windows


def reach(module_name, params, nats=20.0, limit=2 ** 30):
    """Per head, the smallest distance d >= 1 past the head's peak where its log-prior is `nats`
    below the peak, or None if it never is within `limit` (a flat or anti-local head). The same
    definition as `bamgen show`'s reach column, evaluated at the learned parameters."""
    heads = len(next(iter(params.values()))) if params else 1
    out = []
    for h in range(heads):
        one = {k: [float(v[h])] for k, v in params.items()}

        def f(d):
            return float(log_prior_curve(module_name, one, [d])[0, 0])
        probe = [0] + [2 ** k for k in range(31) if 2 ** k <= limit]
        values = [f(d) for d in probe]
        peak_at = max(range(len(probe)), key=lambda i: (values[i], -i))
        top, lo, hi = values[peak_at], probe[peak_at], None
        for d, v in zip(probe[peak_at + 1:], values[peak_at + 1:]):
            if v < top - nats:
                hi = d
                break
            lo = d
        if hi is None:
            out.append(None)
            continue
        while hi - lo > 1:
            mid = (lo + hi) // 2
            lo, hi = (lo, mid) if f(mid) < top - nats else (mid, hi)
        out.append(hi)
    return out


def anti_local_penalty(module_name, params, distances=(1, 8, 64), far=2 ** 20):
    """Per head: None unless the head is anti-local (its log-prior rises with distance, so far
    keys are favoured); for an anti-local head, how many nats below a key `far` back a key at
    each of `distances` sits, {d: nats}."""
    probe = [1, far] + list(distances)
    curve = log_prior_curve(module_name, params, probe)
    out = []
    for h in range(curve.shape[0]):
        near, top = float(curve[h, 0]), float(curve[h, 1])
        out.append({d: top - float(curve[h, 2 + i]) for i, d in enumerate(distances)}
                   if top > near else None)
    return out


# ----------------------------------------------------------------------------------------
# Attention of one layer over a cache, with optional per-head windows.
# ----------------------------------------------------------------------------------------
def _slice_params(params, heads):
    return {k: (v[heads] if v.numel() > 1 else v) for k, v in params.items()}


def attend(attn, q, k, v, q_offset, windows=None, block=QUERY_BLOCK):
    """Causal attention of queries at absolute positions q_offset.. to keys at 0.. through the
    layer's generated module. windows: None, or per head None (every key) or R. Query rows go in
    blocks of `block` rows (at least R), each against the keys it can see; with a window R, the
    block [i0, i1) sees keys from i0 - R on: every key within R of each row, and none of the keys
    more than R before the block (block skipping)."""
    mod = load_module(attn.module_name)
    params = {name: t.detach() for name, t in attn.prior.prior_params().items()}
    H, nq = q.shape[1], q.shape[2]
    if windows is None:
        windows = [None] * H
    out = torch.empty_like(q)
    groups = {}
    for h, w in enumerate(windows):
        groups.setdefault(w, []).append(h)
    for w, heads in groups.items():
        hs = torch.tensor(heads)
        prm = _slice_params(params, hs)
        qh, kh, vh = q[:, hs], k[:, hs], v[:, hs]
        step = block if w is None else max(block, w)
        for r0 in range(0, nq, step):
            r1 = min(nq, r0 + step)
            i0, i1 = q_offset + r0, q_offset + r1          # absolute positions of these rows
            j0 = 0 if w is None else max(0, i0 - w)
            out[:, hs, r0:r1] = mod.attention(qh[:, :, r0:r1], kh[:, :, j0:i1], vh[:, :, j0:i1],
                                              **prm, causal=True, q_offset=i0, k_offset=j0)
    return out


# ----------------------------------------------------------------------------------------
# Prefill and decode.
# ----------------------------------------------------------------------------------------
class KVCache:
    """Keys and values per layer, [B, H, n, D] each, and the number of positions held."""

    def __init__(self, n_layers):
        self.k = [None] * n_layers
        self.v = [None] * n_layers
        self.length = 0

    def append(self, layer, k, v):
        if self.k[layer] is None:
            self.k[layer], self.v[layer] = k, v
        else:
            self.k[layer] = torch.cat([self.k[layer], k], dim=2)
            self.v[layer] = torch.cat([self.v[layer], v], dim=2)
        return self.k[layer], self.v[layer]


def model_windows(model, nats, max_distance):
    """Per layer, the head windows of its learned prior (see head_windows); None per head where
    nats is None (no skipping)."""
    out = []
    for block in model.blocks:
        attn = block.attn
        params = {k: v.detach().cpu() for k, v in attn.prior.prior_params().items()}
        if nats is None or not params:
            out.append(None)
        else:
            out.append(head_windows(attn.module_name, params, nats, max_distance))
    return out


@torch.no_grad()
def forward_cached(model, tokens, cache, windows=None, last_only=False):
    """Run tokens [B, n] at positions cache.length.. through the model, appending their keys and
    values to the cache. Returns logits [B, n, V], or [B, 1, V] for the last token only when
    last_only (the last layer then attends for that row alone)."""
    pos0, n = cache.length, tokens.shape[1]
    x = model.embed(tokens)
    last = len(model.blocks) - 1
    for li, block in enumerate(model.blocks):
        attn = block.attn
        b, _, c = x.shape
        q, k, v = attn.qkv(block.ln1(x)).view(b, n, 3, attn.n_heads, c // attn.n_heads).permute(2, 0, 3, 1, 4)
        if attn.rope:
            q, k = rotary(q, offset=pos0), rotary(k, offset=pos0)
        keys, values = cache.append(li, k, v)
        q_off = pos0
        if li == last and last_only:
            q, x, q_off = q[:, :, -1:], x[:, -1:], pos0 + n - 1
        y = attend(attn, q, keys, values, q_off, None if windows is None else windows[li])
        x = x + attn.out(y.transpose(1, 2).reshape(b, x.shape[1], c))
        x = x + block.mlp(block.ln2(x))
    cache.length += n
    return model.head(model.ln(x))


@torch.no_grad()
def greedy_decode(model, prompt, steps, windows=None, return_logits=False):
    """Greedy continuation of prompt [B, n] for `steps` tokens with a KV cache: the prompt runs
    once (only its last row through the last layer's attention), then one row per new token.
    Returns the new tokens [B, steps] (and with return_logits the logits each token was chosen
    from, [B, steps, V])."""
    cache = KVCache(len(model.blocks))
    logits = forward_cached(model, prompt, cache, windows=windows, last_only=True)
    new, seen = [], []
    for t in range(steps):
        seen.append(logits[:, -1])
        token = logits[:, -1].argmax(-1, keepdim=True)
        new.append(token)
        if t + 1 < steps:
            logits = forward_cached(model, token, cache, windows=windows, last_only=True)
    tokens = torch.cat(new, dim=1)
    return (tokens, torch.stack(seen, dim=1)) if return_logits else tokens
