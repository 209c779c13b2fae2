"""The export rule on the saved adapter's tensors themselves (``ctx.export.saved``, read by
:func:`..saved_tensors.hollow_tensors`): zero-element tensors, as a ZeRO-3 save without a gather writes them,
and all-zero ones that training cannot leave at zero. Judged from the file, whether or not it reloads."""
from __future__ import annotations

from ..export import ExportFacts
from ..registry import finding, rule


def _shape(shape: list[int]) -> str:
    return "[" + ", ".join(str(n) for n in shape) + "]"


@rule("export-empty-tensors", "error")
def export_empty_tensors(ctx):
    """The saved adapter holds zero-element tensors (a DeepSpeed ZeRO-3 save that did not gather the parameters)
    or all-zero ones training cannot leave at zero (lora_A): the file is not the model trained."""
    facts = getattr(ctx, "export", None)
    if not isinstance(facts, ExportFacts) or facts.kind != "adapter":
        return None
    saved = facts.saved
    empty, zero = saved.get("empty_count", 0), saved.get("all_zero_count", 0)
    if not empty and not zero:
        return None
    file = saved.get("file") or "the adapter file"
    said = []
    if empty:
        named = ", ".join(f"{k} {_shape(v)}" for k, v in saved["empty"].items())
        said.append(f"{empty} of its {saved['tensors']} tensors have no elements ({named}"
                    + (", ..." if empty > len(saved["empty"]) else "") + ")")
    if zero:
        said.append(f"{zero} are all zeros though training never leaves them at zero ({', '.join(saved['all_zero'])}"
                    + (", ..." if zero > len(saved["all_zero"]) else "") + "; LoRA's A matrices start random)")
    return finding(
        "export-empty-tensors",
        f"the saved adapter holds {'empty' if empty else 'all-zero'} tensors: it is not the model trained",
        f"In {file}, " + "; ".join(said) + ". Under DeepSpeed ZeRO-3 every parameter outside a gather is an empty "
        "placeholder, so save_pretrained called on the sharded model writes shape [0] tensors (trl#4416, "
        "peft#2892), and a gather that went wrong writes zeros; the folder cannot reload, or reloads as another "
        "model. Save through the Trainer (trainer.save_model() gathers the shards; set "
        "stage3_gather_16bit_weights_on_model_save: true in the DeepSpeed config), or inside "
        "deepspeed.zero.GatheredParameters(model.parameters()), or save the trained model again where it is whole.",
        {"file": file, "empty": saved.get("empty"), "empty_count": empty, "all_zero": saved.get("all_zero"),
         "all_zero_count": zero, "tensors": saved.get("tensors")}, fixes=["resave-adapter"])
