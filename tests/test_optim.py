"""``bamgen.param_groups``: prior parameters out of weight decay, on a model as users build them."""
import importlib

import pytest
import torch

import bamgen

GGD = importlib.import_module("generated.generalized_gaussian")


class Block(torch.nn.Module):
    """A pre-norm attention block, the way a user's model holds a generated module."""

    def __init__(self, dim=16, heads=4):
        super().__init__()
        self.norm = torch.nn.LayerNorm(dim)
        self.qkv = torch.nn.Linear(dim, 3 * dim)
        self.attn = GGD.GeneralizedGaussianAttention(num_heads=heads)
        self.heads = heads

    def forward(self, x):
        B, N, C = x.shape
        q, k, v = self.qkv(self.norm(x)).view(B, N, 3, self.heads, -1).permute(2, 0, 3, 1, 4)
        return x + self.attn(q, k, v, causal=True).transpose(1, 2).reshape(B, N, C)


def _ids(params):
    return {id(p) for p in params}


def test_prior_parameters_get_no_decay_and_everything_else_does():
    model = torch.nn.Sequential(Block(), Block())
    model(torch.randn(2, 5, 16)).sum().backward()
    assert model[0].attn.raw_alpha.grad is not None
    groups = bamgen.param_groups(model, weight_decay=0.1)
    assert [g["weight_decay"] for g in groups] == [0.1, 0.0]
    priors = {id(getattr(model[i].attn, f"raw_{n}")) for i in range(2) for n in ("alpha", "beta", "mu")}
    assert _ids(groups[1]["params"]) == priors
    assert _ids(groups[0]["params"]) == _ids(model.parameters()) - priors
    assert sum(len(g["params"]) for g in groups) == len(list(model.parameters()))


def test_adamw_step_decays_weights_but_not_priors():
    torch.manual_seed(0)
    model = Block()
    with torch.no_grad():
        model.attn.raw_alpha.add_(0.5)     # trained away from 0, where decay would pull it
    before = {n: p.detach().clone() for n, p in model.named_parameters()}
    opt = torch.optim.AdamW(bamgen.param_groups(model, weight_decay=0.5), lr=0.1)
    for p in model.parameters():
        p.grad = torch.zeros_like(p)       # only the decay moves anything
    opt.step()
    for name, p in model.named_parameters():
        if name.startswith("attn.raw_"):
            assert torch.equal(p, before[name]), name
    assert not torch.equal(model.qkv.weight, before["qkv.weight"])


def test_a_module_from_bamgen_load_and_a_subclass_are_found(tmp_path):
    laplace = bamgen.load("laplace", cache_dir=tmp_path)

    class Scaled(laplace.LaplaceAttention):
        pass

    model = torch.nn.ModuleDict({"a": laplace.LaplaceAttention(num_heads=2), "b": Scaled(num_heads=2),
                                 "proj": torch.nn.Linear(4, 4)})
    decay, no_decay = bamgen.param_groups(model, weight_decay=0.1)
    assert _ids(no_decay["params"]) == {id(model["a"].raw_b), id(model["b"].raw_b)}
    assert _ids(decay["params"]) == _ids(model["proj"].parameters())


def test_timm_style_no_weight_decay_is_honoured_on_any_submodule():
    class WithToken(torch.nn.Module):
        def __init__(self):
            super().__init__()
            self.token = torch.nn.Parameter(torch.zeros(4))
            self.proj = torch.nn.Linear(4, 4)

        def no_weight_decay(self):
            return {"token", "not_a_parameter"}

    model = torch.nn.Sequential(WithToken(), Block(dim=8, heads=2))
    decay, no_decay = bamgen.param_groups(model, weight_decay=0.1)
    expected = {id(model[0].token)} | _ids(getattr(model[1].attn, f"raw_{n}") for n in ("alpha", "beta", "mu"))
    assert _ids(no_decay["params"]) == expected


def test_frozen_parameters_and_models_without_priors():
    model = torch.nn.Sequential(torch.nn.Linear(3, 3), Block(dim=8, heads=2))
    model[0].requires_grad_(False)
    groups = bamgen.param_groups(model, weight_decay=0.1)
    assert not _ids(model[0].parameters()) & set().union(*(_ids(g["params"]) for g in groups))
    plain = bamgen.param_groups(torch.nn.Linear(3, 3), weight_decay=0.2)
    assert [g["weight_decay"] for g in plain] == [0.2] and len(plain[0]["params"]) == 2


def test_prior_learning_rate():
    model = Block(dim=8, heads=2)
    decay, priors = bamgen.param_groups(model, weight_decay=0.1, prior_lr=3e-2)
    assert "lr" not in decay and priors["lr"] == 3e-2
    opt = torch.optim.AdamW([decay, priors], lr=3e-3)
    assert [g["lr"] for g in opt.param_groups] == [3e-3, 3e-2]


def test_prior_learning_rate_leaves_timms_no_decay_names_at_the_models():
    """A timm-style model lists its position embedding and norm weights in no_weight_decay():
    they joined the prior parameters' group, and so prior_lr too (the position embedding
    trained at the prior scalars' larger rate). With prior_lr the priors have a group of
    their own; the listed names keep no decay at the model's rate."""
    class Vit(Block):
        def __init__(self):
            super().__init__(dim=8, heads=2)
            self.pos_embed = torch.nn.Parameter(torch.zeros(1, 4, 8))

        def no_weight_decay(self):
            return {"pos_embed", "norm.weight"}
    model = Vit()
    decay, listed, priors = bamgen.param_groups(model, weight_decay=0.1, prior_lr=3e-2)
    assert _ids(listed["params"]) == _ids([model.pos_embed, model.norm.weight])
    assert "lr" not in listed and listed["weight_decay"] == 0.0
    assert _ids(priors["params"]) == _ids([model.attn.raw_alpha, model.attn.raw_beta, model.attn.raw_mu])
    assert priors["lr"] == 3e-2 and priors["weight_decay"] == 0.0 and decay["weight_decay"] == 0.1
    _, no_decay = bamgen.param_groups(model, weight_decay=0.1)   # without prior_lr: two groups
    assert _ids(no_decay["params"]) == _ids(listed["params"]) | _ids(priors["params"])


def test_bad_arguments_are_clear_errors():
    with pytest.raises(ValueError, match="model"):
        bamgen.param_groups([torch.nn.Parameter(torch.zeros(2))], weight_decay=0.1)
    with pytest.raises(ValueError, match="prior_lr"):
        bamgen.param_groups(Block(dim=8, heads=2), weight_decay=0.1, prior_lr=float("nan"))
    with pytest.raises(ValueError, match=r"prior_lr: expected a number >= 0, got '1e-3' \(str\)"):
        bamgen.param_groups(Block(dim=8, heads=2), weight_decay=0.1, prior_lr="1e-3")
    with pytest.raises(ValueError, match="weight_decay: expected a number"):
        bamgen.param_groups(Block(dim=8, heads=2), weight_decay="0.1")


def test_a_tensor_learning_rate_is_a_number():
    """torch's optimizers take a tensor lr (for capturable steps): so does prior_lr."""
    _, priors = bamgen.param_groups(Block(dim=8, heads=2), weight_decay=0.1, prior_lr=torch.tensor(1e-2))
    assert float(priors["lr"]) == pytest.approx(1e-2)


def test_prior_lr_on_a_model_without_prior_parameters_warns():
    """A config that sets prior_lr for a model whose attention has no learnable prior (NoPE, a
    frozen prior) would otherwise give no parameter that rate, silently."""
    model = Block(dim=8, heads=2)
    model.attn.requires_grad_(False)
    with pytest.warns(UserWarning, match="prior_lr: the model has no learnable prior parameter"):
        groups = bamgen.param_groups(model, weight_decay=0.1, prior_lr=1e-2)
    assert all("lr" not in g for g in groups)


def test_fsdp1_with_flat_parameters_is_refused_by_name():
    """FSDP1's default (use_orig_params=False) flattens the prior's scalars into the weights'
    flat tensor: every parameter then decayed at the base rate, silently. use_orig_params=True
    keeps them apart, and their group."""
    import torch.distributed as dist
    from torch.distributed.fsdp import FullyShardedDataParallel as FSDP
    dist.init_process_group("gloo", store=dist.HashStore(), rank=0, world_size=1)
    try:
        flat = FSDP(Block(dim=8, heads=2), device_id=torch.device("cpu"))
        with pytest.raises(ValueError, match="use_orig_params=True"):
            bamgen.param_groups(flat, weight_decay=0.1)
        model = FSDP(Block(dim=8, heads=2), device_id=torch.device("cpu"), use_orig_params=True)
        _, priors = bamgen.param_groups(model, weight_decay=0.1, prior_lr=1e-2)
        assert _ids(priors["params"]) == _ids([model.attn.raw_alpha, model.attn.raw_beta, model.attn.raw_mu])
    finally:
        dist.destroy_process_group()
