"""The main job in one run: GGD attention (the BAM prior) forward and backward on the CPU,
checked against a naive float64 computation. `make demo` builds generated/ first.

    python examples/demo.py
"""
import sys
import time
from pathlib import Path

import torch

sys.path.insert(0, str(Path(__file__).resolve().parent.parent))
from generated.generalized_gaussian import PRIOR, attention, default_params  # noqa: E402


def naive_float64(q, k, v, alpha, beta, mu, causal=True):
    """Materialised logits in float64: s + log_prior, masked softmax, then @ v."""
    n_q, n_k = q.shape[2], k.shape[2]
    d = (torch.arange(n_q)[:, None] - torch.arange(n_k)[None, :]).double()
    alpha, beta, mu = (p.view(-1, 1, 1) for p in (alpha, beta, mu))
    # |d - mu|^beta has an infinite slope in mu at d == mu when beta < 1; the demo uses beta >= 1.
    log_prior = -(torch.abs(d - mu) / alpha) ** beta
    logits = q @ k.transpose(-1, -2) / q.shape[-1] ** 0.5 + log_prior
    if causal:
        logits = logits.masked_fill(d < 0, float("-inf"))
    return torch.softmax(logits, dim=-1) @ v


def main():
    torch.manual_seed(0)
    B, H, N, D = 2, 4, 300, 64
    q, k, v = (torch.randn(B, H, N, D) for _ in range(3))
    params = default_params(H)
    params["beta"] = torch.tensor([1.0, 1.5, 2.0, 1.2])   # a mix of shapes, as after training
    params["mu"] = torch.tensor([0.0, 0.5, 2.0, 7.0])
    grad_out = torch.randn(B, H, N, D)
    print(f"prior '{PRIOR['name']}': log_prior = {PRIOR['log_prior']}")
    print(f"q, k, v [B={B}, H={H}, N={N}, D={D}] float32, causal, CPU (torch backend)")

    inputs = [t.clone().requires_grad_() for t in (q, k, v, *params.values())]
    start = time.perf_counter()
    out = attention(*inputs[:3], alpha=inputs[3], beta=inputs[4], mu=inputs[5], causal=True)
    grads = torch.autograd.grad(out, inputs, grad_out)
    elapsed = time.perf_counter() - start

    ref_inputs = [t.double().requires_grad_() for t in (q, k, v, *params.values())]
    ref = naive_float64(*ref_inputs)
    ref_grads = torch.autograd.grad(ref, ref_inputs, grad_out.double())

    print(f"forward + backward: {elapsed * 1000:.0f} ms")
    worst = 0.0
    for name, mine, theirs in zip(["out", "dq", "dk", "dv", "dalpha", "dbeta", "dmu"],
                                  [out, *grads], [ref, *ref_grads]):
        err = (mine.double() - theirs).abs().max().item()
        rel = err / max(theirs.abs().max().item(), 1e-12)
        worst = max(worst, rel)
        print(f"  {name:7s} max |bamgen - float64| = {err:.2e}  (relative {rel:.1e})")
    ok = worst < 1e-4
    print("agreement with the float64 reference:", "OK" if ok else "FAILED")
    return 0 if ok else 1


if __name__ == "__main__":
    sys.exit(main())
