"""Every output and gradient of every shipped prior, bit for bit, for checking a refactor.

    python scripts/bit_snapshot.py generated/ /tmp/before.pt      # on the old tree
    python scripts/bit_snapshot.py generated/ /tmp/after.pt       # on the new tree
    python scripts/bit_snapshot.py --compare /tmp/before.pt /tmp/after.pt

Each built module in the folder runs a fixed set of calls on both paths (the CPU path and the
Triton kernels under TRITON_INTERPRET=1): training calls (causal and not, GQA, offsets, bf16),
key_mask with per-row offsets, packed documents, decode steps, the block API, the nn.Module and
log_prior_at. Every tensor that comes out (outputs, statistics, gradients of q, k, v and of every
learnable parameter) is stored; --compare reports each one whose bits differ (NaN included: the
bits are compared as integers). Refactors of the runtime or the compiler that must not change a
number (docs/architecture.md, "How a refactor is checked") are checked with it.
"""
from __future__ import annotations

import argparse
import importlib.util
import os
import sys
from pathlib import Path

os.environ.setdefault("TRITON_INTERPRET", "1")
os.environ.setdefault("TRITON_DEFAULT_FP_FUSION", "1")

import torch  # noqa: E402


def load(path: Path):
    spec = importlib.util.spec_from_file_location(f"snapshot_{path.stem}", path)
    module = importlib.util.module_from_spec(spec)
    sys.modules[spec.name] = module
    spec.loader.exec_module(module)
    return module


def params_for(mod, heads: int, seed: int) -> dict:
    """Per-head values near the initial ones (each in its domain), learnable ones with grad."""
    g = torch.Generator().manual_seed(seed)
    out = {}
    for name, value in mod.default_params(heads).items():
        jitter = 1 + 0.3 * torch.rand(heads, generator=g)
        kind = mod.PRIOR["params"][name]["domain"]
        value = value * jitter if kind != "real" else value + jitter - 1
        out[name] = value.detach().requires_grad_(name in mod.LEARNABLE)
    return out


def tensors(B, Hq, Hk, Nq, Nk, D, dtype, seed):
    g = torch.Generator().manual_seed(seed)
    make = lambda *shape: torch.randn(*shape, generator=g).to(dtype)  # noqa: E731
    return make(B, Hq, Nq, D), make(B, Hk, Nk, D), make(B, Hk, Nk, D), make(B, Hq, Nq, D)


def train_call(mod, record, tag, backend, shape, dtype=torch.float32, seed=0, **kw):
    B, Hq, Hk, Nq, Nk, D = shape
    q, k, v, dout = tensors(B, Hq, Hk, Nq, Nk, D, dtype, seed)
    params = params_for(mod, Hq, seed)
    leaves = [t.clone().requires_grad_(True) for t in (q, k, v)]
    out = mod.attention(*leaves, **params, backend=backend, **kw)
    learn = [params[n] for n in mod.LEARNABLE]
    grads = torch.autograd.grad(out, leaves + learn, dout, allow_unused=True)
    record[f"{tag}/out"] = out.detach()
    for name, grad in zip(["q", "k", "v", *mod.LEARNABLE], grads):
        if grad is not None:
            record[f"{tag}/d{name}"] = grad


def decode_call(mod, record, tag, backend, shape, **kw):
    B, Hq, Hk, Nq, Nk, D = shape
    q, k, v, _ = tensors(B, Hq, Hk, Nq, Nk, D, torch.float32, 3)
    params = {n: t.detach() for n, t in params_for(mod, Hq, 3).items()}
    with torch.no_grad():
        record[f"{tag}/out"] = mod.attention(q, k, v, **params, backend=backend, **kw)


def block_calls(mod, record, tag, backend):
    B, Hq, Hk, Nq, Nk, D = 1, 4, 2, 24, 40, 16
    q, k, v, dout = tensors(B, Hq, Hk, Nq, Nk, D, torch.float32, 5)
    params = {n: t.detach() for n, t in params_for(mod, Hq, 5).items()}
    n = torch.arange(1, Nq + 1, dtype=torch.float32) + 16
    parts = []
    for k0, k1 in ((0, 16), (16, 40)):
        out_b, stats_b = mod.forward_block(q, k[:, :, k0:k1], v[:, :, k0:k1], **params, causal=True,
                                           q_offset=16, k_offset=k0, backend=backend, n=n)
        record[f"{tag}/fwd{k0}/out"], record[f"{tag}/fwd{k0}/stats"] = out_b, stats_b
        parts.append((out_b, stats_b))
    (o1, s1), (o2, s2) = parts
    m = torch.maximum(s1[..., 0], s2[..., 0])
    m_safe = torch.where(torch.isinf(m), torch.zeros_like(m), m)
    w1 = s1[..., 1] * torch.exp2(s1[..., 0] - m_safe)
    w2 = s2[..., 1] * torch.exp2(s2[..., 0] - m_safe)
    l = w1 + w2
    out = (o1 * w1[..., None] + o2 * w2[..., None]) / torch.where(l == 0, 1.0, l)[..., None]
    stats = torch.stack([m, l], -1)
    sums, rows = {}, None
    for k0, k1 in ((0, 16), (16, 40)):
        dq, dk, dv, dparams, row_sums = mod.backward_block(
            dout, q, k[:, :, k0:k1], v[:, :, k0:k1], out, stats, **params, causal=True, q_offset=16,
            k_offset=k0, backend=backend, n=n)
        for name, t in (("dq", dq), ("dk", dk), ("dv", dv), ("rows", row_sums)):
            record[f"{tag}/bwd{k0}/{name}"] = t
        for name, t in dparams.items():
            record[f"{tag}/bwd{k0}/d{name}"] = t
            sums[name] = sums.get(name, 0) + t
        rows = row_sums if rows is None else rows + row_sums
    for name, t in mod.finish_param_grads(sums, rows).items():
        record[f"{tag}/finished/d{name}"] = t


def module_call(mod, record, tag, backend):
    torch.manual_seed(7)
    cls = getattr(mod, mod.PRIOR["class_name"])
    attn = cls(num_heads=4)
    q, k, v, dout = tensors(2, 4, 4, 21, 21, 16, torch.float32, 7)
    leaves = [t.clone().requires_grad_(True) for t in (q, k, v)]
    out = attn(*leaves, causal=True, backend=backend)
    out.backward(dout)
    record[f"{tag}/out"] = out.detach()
    for name, t in zip("qkv", leaves):
        record[f"{tag}/d{name}"] = t.grad
    for name, p in attn.named_parameters():
        record[f"{tag}/{name}.grad"] = p.grad


def snapshot(mod) -> dict:
    record = {}
    for backend in ("torch", "triton"):
        b = backend
        train_call(mod, record, f"{b}/causal", b, (2, 4, 2, 37, 37, 16), causal=True)
        train_call(mod, record, f"{b}/full", b, (1, 4, 4, 19, 45, 16), causal=False, seed=1)
        train_call(mod, record, f"{b}/offsets", b, (1, 4, 2, 23, 40, 16), causal=True, seed=2,
                   q_offset=17, k_offset=0)
        train_call(mod, record, f"{b}/bf16", b, (1, 4, 2, 33, 33, 16), dtype=torch.bfloat16,
                   causal=True, seed=4)
        key_mask = torch.ones(2, 30, dtype=torch.bool)
        key_mask[0, :5] = False
        pad = torch.tensor([-5, 0])
        train_call(mod, record, f"{b}/padded", b, (2, 4, 2, 30, 30, 16), causal=True, seed=6,
                   key_mask=key_mask, q_offset=pad, k_offset=pad)
        cu = torch.tensor([0, 13, 14, 40], dtype=torch.int32)
        train_call(mod, record, f"{b}/packed", b, (1, 4, 2, 40, 40, 16), causal=True, seed=8,
                   cu_seqlens_q=cu, cu_seqlens_k=cu)
        decode_call(mod, record, f"{b}/decode", b, (2, 4, 2, 1, 70, 16), causal=True,
                    q_offset=69, k_offset=0)
        decode_call(mod, record, f"{b}/decode3", b, (1, 4, 4, 3, 50, 16), causal=True,
                    q_offset=47, k_offset=0)
        block_calls(mod, record, f"{b}/blocks", b)
        module_call(mod, record, f"{b}/module", b)
    try:
        values = {n: t.detach() for n, t in params_for(mod, 4, 9).items()}
        record["log_prior_at"] = mod.log_prior_at(torch.arange(-40, 41), **values)
    except ValueError:
        pass
    return record


def bits(t: torch.Tensor) -> torch.Tensor:
    t = t.detach().contiguous()
    view = {torch.float32: torch.int32, torch.float64: torch.int64, torch.bfloat16: torch.int16,
            torch.float16: torch.int16}.get(t.dtype)
    return t.view(view) if view is not None else t


def compare(before: dict, after: dict) -> int:
    bad = 0
    for prior in sorted(set(before) | set(after)):
        a, b = before.get(prior, {}), after.get(prior, {})
        for key in sorted(set(a) | set(b)):
            if key not in a or key not in b:
                print(f"{prior} {key}: only in {'after' if key in b else 'before'}")
                bad += 1
            elif a[key].shape != b[key].shape or a[key].dtype != b[key].dtype:
                print(f"{prior} {key}: {tuple(a[key].shape)} {a[key].dtype} -> "
                      f"{tuple(b[key].shape)} {b[key].dtype}")
                bad += 1
            elif not torch.equal(bits(a[key]), bits(b[key])):
                diff = (a[key].double() - b[key].double()).abs().nan_to_num(float("inf")).max()
                print(f"{prior} {key}: bits differ (max |diff| {float(diff):.3g})")
                bad += 1
        print(f"{prior}: {len(set(a) & set(b))} tensors compared")
    print("identical" if not bad else f"{bad} tensors differ")
    return bad


def main():
    parser = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    parser.add_argument("paths", nargs=2, help="modules folder and output file, or two snapshots")
    parser.add_argument("--compare", action="store_true", help="compare two snapshots")
    parser.add_argument("--only", action="append", help="only these priors")
    args = parser.parse_args()
    if args.compare:
        sys.exit(1 if compare(torch.load(args.paths[0]), torch.load(args.paths[1])) else 0)
    folder, out = Path(args.paths[0]), Path(args.paths[1])
    record = {}
    for path in sorted(folder.glob("*.py")):
        if path.stem.startswith("_") or (args.only and path.stem not in args.only):
            continue
        record[path.stem] = snapshot(load(path))
        print(f"{path.stem}: {len(record[path.stem])} tensors", flush=True)
    torch.save(record, out)


if __name__ == "__main__":
    main()
