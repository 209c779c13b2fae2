"""A tiny Qwen2-VL built from a config, its image processor (PIL backend) and batches expanded the way
Qwen2VLProcessor expands them (the processor itself needs torchvision for its video half, not installed here)."""
from __future__ import annotations

import numpy
import torch

IMAGE, VIDEO, VISION_START, VISION_END = 150, 151, 152, 153


def tiny_qwen2_vl():
    from transformers import Qwen2VLConfig, Qwen2VLForConditionalGeneration

    torch.manual_seed(0)
    cfg = Qwen2VLConfig(
        text_config=dict(vocab_size=160, hidden_size=64, intermediate_size=128, num_hidden_layers=1,
                         num_attention_heads=4, num_key_value_heads=2,
                         rope_scaling={"type": "mrope", "mrope_section": [2, 2, 4]}),
        vision_config=dict(depth=1, embed_dim=32, hidden_size=64, num_heads=2, mlp_ratio=2, patch_size=14,
                           spatial_merge_size=2, temporal_patch_size=2, in_channels=3),
        image_token_id=IMAGE, video_token_id=VIDEO, vision_start_token_id=VISION_START, vision_end_token_id=VISION_END)
    return Qwen2VLForConditionalGeneration(cfg)


class VLMExamples(torch.utils.data.Dataset):
    """Examples of a few words, one 56x56 image expanded to its placeholder tokens, then more words."""

    def __init__(self, rows: int = 4, max_length: int | None = None):
        from transformers.models.qwen2_vl.image_processing_pil_qwen2_vl import Qwen2VLImageProcessorPil

        self.processor = Qwen2VLImageProcessorPil(min_pixels=56 * 56, max_pixels=56 * 56)
        self.rows, self.max_length = rows, max_length

    def __len__(self) -> int:
        return self.rows

    def __getitem__(self, index: int) -> dict:
        rng = numpy.random.default_rng(index)
        image = self.processor(images=[(rng.random((56, 56, 3)) * 255).astype("uint8")], return_tensors="pt")
        placeholders = int(image["image_grid_thw"].prod()) // 4  # spatial_merge_size ** 2
        ids = [5 + index, 6, VISION_START] + [IMAGE] * placeholders + [VISION_END] + list(range(20, 30))
        ids = ids[:self.max_length] if self.max_length else ids  # truncation after the expansion
        return {"input_ids": ids, "pixel_values": image["pixel_values"], "image_grid_thw": image["image_grid_thw"]}


def collate(features: list[dict], labels_from=None) -> dict:
    """Right-pads ids, stacks the images' patches and grids; labels = input_ids with padding and image
    placeholders at -100 (``labels_from(ids, mask)`` builds other labels)."""
    width = max(len(f["input_ids"]) for f in features)
    ids = torch.zeros((len(features), width), dtype=torch.long)
    mask = torch.zeros_like(ids)
    for r, f in enumerate(features):
        ids[r, :len(f["input_ids"])] = torch.tensor(f["input_ids"])
        mask[r, :len(f["input_ids"])] = 1
    labels = ids.masked_fill((mask == 0) | (ids == IMAGE), -100) if labels_from is None else labels_from(ids, mask)
    return {"input_ids": ids, "attention_mask": mask, "labels": labels,
            "mm_token_type_ids": (ids == IMAGE).long(),
            "pixel_values": torch.cat([f["pixel_values"] for f in features]),
            "image_grid_thw": torch.cat([f["image_grid_thw"] for f in features])}
