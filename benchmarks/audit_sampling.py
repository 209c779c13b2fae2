"""What sampling batches from a Trainer's own dataloader adds to the audit.

A Llama-shaped model (hidden 512, 4 layers, vocab 8192), a Trainer over N ragged tokenised examples
with transformers' DataCollatorForLanguageModeling (a real tokenizer built from a vocabulary), and
the audit of the Trainer (samples 8 batches, runs every rule) against the audit of the same model and
arguments with no batch at all.

    OMP_NUM_THREADS=1 .venv/bin/python benchmarks/audit_sampling.py --runs 7
"""
from __future__ import annotations

import argparse
import statistics
import tempfile
import time

import torch


def build(examples: int, batch_size: int, vocab: int):
    from tokenizers import Tokenizer
    from tokenizers.models import WordLevel
    from transformers import (
        DataCollatorForLanguageModeling,
        LlamaConfig,
        LlamaForCausalLM,
        PreTrainedTokenizerFast,
        Trainer,
        TrainingArguments,
    )

    words = {"<unk>": 0, "<s>": 1, "</s>": 2, **{f"w{i}": i for i in range(3, vocab)}}
    tok = PreTrainedTokenizerFast(tokenizer_object=Tokenizer(WordLevel(words, unk_token="<unk>")),
                                  unk_token="<unk>", bos_token="<s>", eos_token="</s>", pad_token="<unk>")
    gen = torch.Generator().manual_seed(0)
    rows = [{"input_ids": torch.randint(3, vocab, (int(torch.randint(32, 257, (1,), generator=gen)),),
                                        generator=gen).tolist() + [2]} for _ in range(examples)]
    model = LlamaForCausalLM(LlamaConfig(vocab_size=vocab, hidden_size=512, intermediate_size=1024,
                                         num_hidden_layers=4, num_attention_heads=8, num_key_value_heads=4))
    args = TrainingArguments(output_dir=tempfile.mkdtemp(), use_cpu=True, report_to=[], save_strategy="no",
                             per_device_train_batch_size=batch_size, disable_tqdm=True)
    return Trainer(model=model, args=args, train_dataset=rows, processing_class=tok,
                   data_collator=DataCollatorForLanguageModeling(tok, mlm=False))


def timed(fn, runs: int) -> list[float]:
    out = []
    for _ in range(runs):
        start = time.perf_counter()
        fn()
        out.append(time.perf_counter() - start)
    return out


def main(argv=None) -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    parser.add_argument("--runs", type=int, default=7)
    parser.add_argument("--examples", type=int, default=10_000)
    parser.add_argument("--batch-size", type=int, default=8)
    parser.add_argument("--vocab", type=int, default=8192)
    args = parser.parse_args(argv)
    import nbguard

    trainer = build(args.examples, args.batch_size, args.vocab)
    nbguard.audit(trainer=trainer, hardware="a100")  # warm-up: imports, first dataloader
    rows = [("nbguard.audit(trainer=trainer): 8 sampled batches + every rule",
             timed(lambda: nbguard.audit(trainer=trainer, hardware="a100"), args.runs)),
            ("nbguard.audit(trainer.model, args=trainer.args): no batch",
             timed(lambda: nbguard.audit(trainer.model, args=trainer.args, hardware="a100"), args.runs))]
    print(f"\n### audit with sampled batches ({args.examples} examples, batch {args.batch_size}, "
          f"{args.runs} runs)\n")
    print("| what | median | min | max |\n|---|---:|---:|---:|")
    for name, times in rows:
        print(f"| `{name}` | {statistics.median(times):.3f} s | {min(times):.3f} s | {max(times):.3f} s |")


if __name__ == "__main__":
    main()
