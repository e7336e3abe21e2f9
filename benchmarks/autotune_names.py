"""How the benchmarks name a Triton autotune config: one spelling for benchmarks/gpu.py, which
records the configs an autotuner kept, and benchmarks/tutorial_model.py, which prints its
model's pick beside them."""


def config_name(config) -> str:
    """"128x64 w4 s3": the config's constexprs (its tile), warps and stages."""
    tile = "x".join(str(v) for v in config.kwargs.values())
    return f"{tile} w{config.num_warps} s{config.num_stages}"
