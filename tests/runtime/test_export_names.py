"""How a saved torch.export program finds its prior (docs/packaging.md, "torch.export and
AOTInductor"): the custom ops are named after the prior and the hash of what they run, so a
fresh process that loads the same prior file runs the program as it was exported, whatever else
the exporting process had imported, and one that loaded an edited prior of the same name fails
to load it instead of running the edited formula with the saved parameters.

Each process is a user's: export and save in one, load in another (torch.export.load resolves
the ops by name in the loading process). The torch backend and tiny shapes keep it fast.
"""
import hashlib
import subprocess
import sys

import pytest
import torch

import bamgen
from tests.helpers import ROOT, write_prior

PRIOR_A = "name: myp\nlog_prior: -Abs(d) / b\nparams:\n  b: {init: 2.0, domain: positive}\n"
EDITS = {
    "another formula": "name: myp\nlog_prior: -(d / b) ** 2\nparams:\n  b: {init: 2.0, domain: positive}\n",
    "one more parameter": ("name: myp\nlog_prior: -Abs(d - c) / b\nparams:\n"
                           "  b: {init: 2.0, domain: positive}\n  c: {init: 0.5}\n"),
}

EXPORT = """
import sys, torch, bamgen
first, prior, cache, folder = sys.argv[1:]
bamgen.load(first, cache_dir=cache)       # another build of 'myp', imported first
mod = bamgen.load(prior, cache_dir=cache)
torch.manual_seed(0)
attn = mod.MypAttention(num_heads=2)
with torch.no_grad():
    attn.raw_b.add_(0.4)                  # a trained value, not the initial one
q, k, v = (torch.randn(1, 2, 9, 8) for _ in range(3))

class Model(torch.nn.Module):
    def __init__(self):
        super().__init__()
        self.attn = attn

    def forward(self, q, k, v):
        return self.attn(q, k, v, causal=True)

torch.export.save(torch.export.export(Model(), (q, k, v)), folder + "/program.pt2")
torch.save((q, k, v, attn(q, k, v)), folder + "/io.pt")
print(mod.OP_NAME)
"""

LOAD = """
import sys, torch, bamgen
prior, cache, folder = sys.argv[1:]
mod = bamgen.load(prior, cache_dir=cache)
print(mod.OP_NAME)
program = torch.export.load(folder + "/program.pt2")
q, k, v, expected = torch.load(folder + "/io.pt")
assert torch.equal(program.module()(q, k, v), expected), "the program's output moved"
print("same output")
"""


def run(script, *args):
    return subprocess.run([sys.executable, "-c", script, *map(str, args)], capture_output=True,
                          text=True, timeout=300, cwd=ROOT)


@pytest.fixture(scope="module")
def exported(tmp_path_factory):
    """(folder, prior A's file, its op name): prior A's program saved by a process that imported
    an edited 'myp' first."""
    folder = tmp_path_factory.mktemp("exported")
    prior_a = write_prior(folder, PRIOR_A, "myp.yaml")
    (folder / "edited").mkdir()
    edited = write_prior(folder / "edited", EDITS["another formula"], "myp.yaml")
    res = run(EXPORT, edited, prior_a, folder / "cache", folder)
    assert res.returncode == 0, res.stderr
    return folder, prior_a, res.stdout.split()[-1]


def test_the_same_prior_in_a_fresh_process_runs_the_program_as_exported(exported):
    folder, prior_a, op = exported
    res = run(LOAD, prior_a, folder / "cache", folder)
    assert res.returncode == 0, res.stderr
    assert res.stdout.split() == [op, "same", "output"]


@pytest.mark.parametrize("edit", sorted(EDITS))
def test_an_edited_prior_is_refused_not_run(exported, tmp_path, edit):
    """Before: the program ran the edited formula with the saved parameters (off by 0.53, no
    warning), or failed inside the edited module's hook when the parameters differ."""
    folder, _, op = exported
    edited = write_prior(tmp_path, EDITS[edit], "myp.yaml")
    res = run(LOAD, edited, folder / "cache", folder)
    assert res.returncode != 0 and "same output" not in res.stdout
    loaded = res.stdout.split()[0]
    assert loaded.startswith("myp_") and loaded != op
    assert f"failed to resolve torch.ops.bamgen.{op}_fwd" in res.stderr


def test_the_op_name_does_not_depend_on_import_order(exported, tmp_path):
    """This process imports prior A before the edited one; the exporting process did the
    reverse."""
    folder, prior_a, op = exported
    a = bamgen.load(prior_a, cache_dir=tmp_path)
    edited = bamgen.load(folder / "edited" / "myp.yaml", cache_dir=tmp_path)
    assert a.OP_NAME == op and edited.OP_NAME not in (op, "myp")
    assert hasattr(torch.ops.bamgen, op + "_fwd") and hasattr(torch.ops.bamgen, edited.OP_NAME + "_fwd")


def test_a_build_that_differs_outside_the_math_shares_the_ops(tmp_path):
    """A new description or initial value is a new build but the same ops: one registration,
    the name unchanged, so a saved program still loads."""
    a = bamgen.load(write_prior(tmp_path, PRIOR_A, "a.yaml"), cache_dir=tmp_path / "cache")
    text = PRIOR_A.replace("init: 2.0", "init: 3.0") + "description: the same formula\n"
    b = bamgen.load(write_prior(tmp_path, text, "b.yaml"), cache_dir=tmp_path / "cache")
    assert a.PRIOR["build_hash"] != b.PRIOR["build_hash"]
    assert b.OP_NAME == a.OP_NAME and b._prior.ops is a._prior.ops
    q, k, v = (torch.randn(1, 2, 5, 8) for _ in range(3))
    torch.testing.assert_close(b.attention(q, k, v, b=1.5), a.attention(q, k, v, b=1.5),
                               rtol=0, atol=0)


def test_theta_of_another_prior_is_refused_inside_the_op(tmp_path):
    """The ops check theta's width before a hook unpacks it (before: "not enough values to
    unpack" from inside the module)."""
    mod = bamgen.load(write_prior(tmp_path, PRIOR_A, "myp.yaml"), cache_dir=tmp_path / "cache")
    q, k, v = (torch.randn(1, 2, 5, 8) for _ in range(3))
    fwd = getattr(torch.ops.bamgen, mod.OP_NAME + "_fwd")
    with pytest.raises(ValueError, match=r"theta: the prior 'myp' takes theta of shape \[heads, 1\] "
                                         r"\(its parameters: b\), got \(2, 2\)"):
        fwd(q, k, v, torch.ones(2, 2), True, 0.125, 0, 0, None, None, None, None, None, False,
            False, False)


# The ops' schemas (names left out) of each OPS_SCHEMA, as sha256: a change to an op's arguments
# must bump OPS_SCHEMA, which renames every op, or a program saved before it would load and run
# with an argument dropped or defaulted by torch.
SCHEMAS = {1: "0327e184366e9180192961be9821e791800f962a6a607243d826755e2ba86da9"}
KINDS = ("fwd", "bwd", "pfwd", "pbwd", "prepare", "fwd_triton", "bwd_triton")


def test_a_change_to_the_ops_arguments_bumps_ops_schema():
    from bamgen.generated import gaussian
    from bamgen.runtime.ops import OPS_SCHEMA
    schemas = "\n".join(str(getattr(torch.ops.bamgen, f"{gaussian.OP_NAME}_{kind}").default._schema)
                        .replace(gaussian.OP_NAME, "<name>") for kind in KINDS)
    digest = hashlib.sha256(schemas.encode()).hexdigest()
    assert SCHEMAS.get(OPS_SCHEMA) == digest, (
        f"the ops' arguments are not those of OPS_SCHEMA {OPS_SCHEMA}: bump OPS_SCHEMA in "
        f"bamgen/runtime/ops.py and record {OPS_SCHEMA + 1}: {digest!r} here. Now:\n{schemas}")
