"""Names without any wrapper's prefix (#44 item 3): a model set up by Lightning Fabric, or with torch's
activation-checkpoint wrapper around a block, is named as the user built it in events, gradient groups
and the heatmap; one function (``nbguard.step.eager.eager_name``) makes every shown name."""
from __future__ import annotations

import warnings

import pytest
import torch

import nbguard
from nbguard.step.eager import eager_name, unwrap_wrappers, user_module

lightning = pytest.importorskip("lightning")


class Block(torch.nn.Module):
    def __init__(self):
        super().__init__()
        self.up = torch.nn.Linear(8, 16)
        self.down = torch.nn.Linear(16, 8)

    def forward(self, x):
        return x + self.down(torch.relu(self.up(x)))


class Stack(torch.nn.Module):
    def __init__(self):
        super().__init__()
        self.blocks = torch.nn.ModuleList([Block(), Block()])
        self.head = torch.nn.Linear(8, 4)

    def forward(self, x):
        for block in self.blocks:
            x = block(x)
        return self.head(x)


def _fabric_run(*, watched: bool, plant_at: int | None = None, steps: int = 4):
    """A Fabric loop as its docs write it: setup, a loss after the model, fabric.backward."""
    fabric = lightning.Fabric(accelerator="cpu", devices=1)
    torch.manual_seed(0)
    net = Stack()
    model, opt = fabric.setup(net, torch.optim.AdamW(net.parameters(), lr=1e-2))
    watch = nbguard.watch(model, optimizer=opt, policy="skip", log_to=None, verify=False) if watched else None
    data = torch.Generator().manual_seed(1)
    losses = []
    for step in range(steps):
        x, y = torch.randn(4, 8, generator=data), torch.randn(4, 4, generator=data)
        hook = None
        if plant_at == step:
            hook = model.module.blocks[1].down.register_forward_hook(lambda m, a, out: out * float("nan"))
        opt.zero_grad()
        loss = torch.nn.functional.mse_loss(model(x), y)
        fabric.backward(loss)
        opt.step()
        losses.append(float(loss.detach()))
        if hook is not None:
            hook.remove()
    if watch is not None:
        watch.detach()
    return model, watch, losses


def test_fabric_setup_model_is_hooked_inside_its_wrapper_and_named_as_built():
    fabric = lightning.Fabric(accelerator="cpu", devices=1)
    inner = Stack()
    wrapped = fabric.setup_module(inner)
    assert type(wrapped).__name__ == "_FabricModule"
    assert user_module(wrapped) is inner
    assert unwrap_wrappers(wrapped) == (inner, "_forward_module.")
    assert any(n.startswith("_forward_module.") for n, _ in wrapped.named_parameters())  # what named_* say


def test_a_fabric_loop_is_quiet_identical_and_read_with_its_loss():
    twin, _, twin_losses = _fabric_run(watched=False)
    model, watch, losses = _fabric_run(watched=True)
    assert losses == twin_losses and watch.events == []
    for mine, theirs in zip(model.parameters(), twin.parameters()):
        assert torch.equal(mine, theirs)
    assert watch.history.loss == pytest.approx(losses, rel=1e-6)  # fabric.backward(loss): the step's loss
    assert watch.history.groups and not any("_forward_module" in g for g in watch.history.groups)


def test_a_nan_in_a_fabric_model_names_the_users_module():
    model, watch, _ = _fabric_run(watched=True, plant_at=2)
    bad = [e for e in watch.events if e.kind.startswith("nonfinite")]
    assert [(e.kind, e.step) for e in bad] == [("nonfinite-loss", 2)]
    assert bad[0].origins[0].module == "blocks.1.down"
    assert all(torch.isfinite(p).all() for p in model.parameters())


def test_checkpoint_wrapped_blocks_are_named_without_the_wrapper():
    from torch.distributed.algorithms._checkpoint.checkpoint_wrapper import checkpoint_wrapper

    torch.manual_seed(0)
    model = Stack()
    model.blocks[1] = checkpoint_wrapper(model.blocks[1])
    assert any("_checkpoint_wrapped_module" in n for n, _ in model.named_modules())
    opt = torch.optim.SGD(model.parameters(), lr=0.01)
    watch = nbguard.watch(model, optimizer=opt, policy="skip", log_to=None, verify=False)
    model.blocks[1]._checkpoint_wrapped_module.up.register_forward_hook(lambda m, a, out: out * float("inf"))
    with warnings.catch_warnings():
        warnings.simplefilter("ignore")  # torch's own note on the reentrant checkpoint default
        loss = torch.nn.functional.mse_loss(model(torch.randn(4, 8)), torch.randn(4, 4))
        loss.backward()
        opt.step()
    watch.detach()
    assert not any("_checkpoint_wrapped_module" in g for g in watch.history.groups)
    bad = [e for e in watch.events if e.kind.startswith("nonfinite")]
    assert bad and bad[0].origins[0].module == "blocks.1.up"


@pytest.mark.parametrize(("shown", "user"), [
    ("_orig_mod.model.layers.1", "model.layers.1"),
    ("_forward_module.transformer.h.1.mlp", "transformer.h.1.mlp"),
    ("layers.0._checkpoint_wrapped_module.mlp.up", "layers.0.mlp.up"),
    ("_fsdp_wrapped_module.layers.0._fsdp_wrapped_module.attn", "layers.0.attn"),
    ("blocks.3._orig_mod.mlp", "blocks.3.mlp"),
    ("encoder._forward_module.proj", "encoder._forward_module.proj"),  # inside: may be the user's own name
    ("model.layers.0.self_attn.q_proj", "model.layers.0.self_attn.q_proj"),
])
def test_eager_name_drops_only_wrappers_segments(shown, user):
    assert eager_name(shown) == user
