"""The compiler: a prior file's text in, a module's text out, no torch.

    formula.py    a formula string -> SymPy, through Python's ast and a whitelist (no eval)
    spec.py       YAML -> PriorSpec: schema, names, domains, inits
    symbolic.py   PriorSpec -> PriorIR: the logit and its derivatives, kink guards
    lower.py      PriorIR -> KernelPlan: the strategy (inline, ramp, table), printed code blocks
    printers.py   SymPy -> Triton and torch source
    tiles.py      which tile table the kernels take (the kind of prior)
    codegen.py    KernelPlan -> the module's text (hooks, traits, the binding), and its hash
    analysis.py   what a prior means at init (symmetry, tails, reach): `bamgen show`
    timeout.py    the bound on the work of one build

The build driver (bamgen/driver) runs these, then the checks of the printed code
(bamgen/checks), then writes (docs/architecture.md, "The stages")."""

# The lowering strategies (lower.py), here so that the command line can offer them without
# importing SymPy.
STRATEGIES = ("inline", "table")
