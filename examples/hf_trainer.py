"""BAM's training set-up inside Hugging Face (docs/huggingface.md, "Tutorial: one shared prior
through Trainer"): one prior shared by every layer, Trainer on packed documents from
DataCollatorWithFlattening, torch.compile, then save_pretrained, from_pretrained and generate.

    python examples/hf_trainer.py                 # a tiny Llama from a config, on the CPU
    python examples/hf_trainer.py --steps 3 --compile-backend aot_eager --out /tmp/run

Nothing is downloaded: the model is built from a config and the documents are a toy task
(counting upwards from a random start, modulo 99), so the script runs anywhere bamgen does.
"""
from __future__ import annotations

import argparse
import tempfile

import torch
from transformers import (DataCollatorWithFlattening, LlamaConfig, LlamaForCausalLM, Trainer,
                          TrainingArguments)

import bamgen
from bamgen.integrations.transformers import apply_prior, from_pretrained


def documents(count: int, seed: int = 0) -> list[dict]:
    """Counting documents of ragged lengths (5 to 24 tokens; token 0 is padding)."""
    g = torch.Generator().manual_seed(seed)
    rows = []
    for _ in range(count):
        start, length = torch.randint(1, 100, (1,), generator=g), int(torch.randint(5, 25, (1,), generator=g))
        rows.append({"input_ids": ((start + torch.arange(length)) % 99 + 1).tolist()})
    return rows


class PriorParamTrainer(Trainer):
    """Trainer whose optimizer leaves the prior's parameters out of weight decay
    (bamgen.param_groups), as the BAM authors train them."""

    def create_optimizer(self):
        if self.optimizer is None:
            self.optimizer = torch.optim.AdamW(
                bamgen.param_groups(self.model, weight_decay=self.args.weight_decay),
                lr=self.args.learning_rate)
        return self.optimizer


def main(argv=None) -> int:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--steps", type=int, default=200)
    ap.add_argument("--compile-backend", default="inductor",
                    help="torch.compile's backend (aot_eager compiles fastest on a CPU)")
    ap.add_argument("--out", default=None, help="where to save the model (default: a temp dir)")
    args = ap.parse_args(argv)

    torch.manual_seed(0)
    config = LlamaConfig(hidden_size=64, num_hidden_layers=2, num_attention_heads=4,
                         num_key_value_heads=2, intermediate_size=128, vocab_size=100,
                         pad_token_id=0)
    # One Generalized Gaussian prior for every layer; RoPE removed: the prior is the only
    # positional encoding.
    model = apply_prior(LlamaForCausalLM(config), "generalized_gaussian", rope="remove",
                        shared=True)

    out = args.out or tempfile.mkdtemp(prefix="bamgen-hf-")
    training = TrainingArguments(
        output_dir=out, max_steps=args.steps, per_device_train_batch_size=8, learning_rate=3e-3,
        weight_decay=0.1, logging_steps=max(1, args.steps // 4), report_to=[],
        save_strategy="no", use_cpu=not torch.cuda.is_available(), dataloader_num_workers=0,
        # a packed row has no graph break and no recompile per length (docs/huggingface.md)
        torch_compile=True, torch_compile_backend=args.compile_backend)
    trainer = PriorParamTrainer(model=model, args=training, train_dataset=documents(512),
                                data_collator=DataCollatorWithFlattening())
    result = trainer.train()
    print(f"trained {result.global_step} steps, loss {result.training_loss:.3f}")
    print("the shared prior:", model.model.bamgen_prior.prior_params())

    model.save_pretrained(out)
    model = from_pretrained(out).eval()
    prompts = torch.tensor([[0, 0, 0, 10, 11, 12], [50, 51, 52, 53, 54, 55]])   # left-padded
    generated = model.generate(prompts, attention_mask=(prompts != 0).long(), max_new_tokens=5,
                               do_sample=False, pad_token_id=0)
    print("generated:", generated[:, prompts.shape[1]:].tolist())
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
