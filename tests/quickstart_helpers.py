"""The quickstart's run, as the tests that follow it build it: a tiny Gemma 3 in float16 whose rare token
overflows fp16 from optimizer step 2 on (rows 8 on, batch size 4), trained by a real Trainer."""
from __future__ import annotations

import torch
from transformers import Trainer, TrainingArguments

from nbguard.testing import TinyDataset, plant_fp16_overflow_token, tiny_gemma3

RARE = 127


class Stream(torch.utils.data.IterableDataset):
    """Ordinary rows, then rows with the rare token from row 8 on (optimizer step 2 at batch size 4)."""

    def __iter__(self):
        for index, row in enumerate(TinyDataset(rows=24, seq_len=16, vocab_size=RARE).rows):
            if index >= 8:
                row = {k: v.clone() for k, v in row.items()}
                row["input_ids"][5] = row["labels"][5] = RARE
            yield row


def quickstart_into(ip, tmp_path) -> None:
    """``model``, ``args`` and ``trainer`` (and ``Trainer``, ``Stream``) in the shell's namespace."""
    torch.manual_seed(0)
    model = tiny_gemma3(seed=0)
    plant_fp16_overflow_token(model, RARE)
    model = model.to(torch.float16)
    args = TrainingArguments(output_dir=str(tmp_path), use_cpu=True, max_steps=4, per_device_train_batch_size=4,
                             learning_rate=1e-4, logging_steps=1, save_strategy="no", report_to=[], disable_tqdm=True)
    ip.user_ns.update(model=model, args=args, trainer=Trainer(model=model, args=args, train_dataset=Stream()),
                      Trainer=Trainer, Stream=Stream)
