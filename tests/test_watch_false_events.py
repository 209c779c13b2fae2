"""Issue 30 item 4: no false events from nbguard's own arithmetic and output reading.

A nanoGPT-style GPT written here (its forward returns ``(logits, loss)``) trained in plain loops:

- lr=1000 drives the gradients to ~1e24 while every one stays finite; their fp32 2-norm overflows
  (the sum of squares passes 3.4e38 once elements pass ~1e19). That is an explosion, never a
  non-finite gradient.
- a module that makes NaN at one step: a non-finite *loss*, read from the tuple wherever the loss sits.
- the loss found in any output users return (a tuple with the loss anywhere, a dict, a bare scalar).
- a healthy run memorising one batch: its gradient norm swings 10x while the loss falls, and no
  spike or divergence event is raised.
"""
from __future__ import annotations

import math
import statistics

import pytest
import torch
import torch.nn as nn
import torch.nn.functional as F

import nbguard
from nbguard.document.view import view
from nbguard.step.capture import find_loss
from nbguard.testing import tiny_batch, tiny_llama
from nbguard.watcher.detectors.divergence import DivergenceDetector

torch.set_num_threads(1)

VOCAB, BLOCK = 64, 16


class CausalSelfAttention(nn.Module):
    def __init__(self, d: int, heads: int):
        super().__init__()
        self.c_attn, self.c_proj, self.heads = nn.Linear(d, 3 * d), nn.Linear(d, d), heads

    def forward(self, x):
        B, T, C = x.shape
        q, k, v = (t.view(B, T, self.heads, C // self.heads).transpose(1, 2) for t in self.c_attn(x).split(C, dim=2))
        y = F.scaled_dot_product_attention(q, k, v, is_causal=True)
        return self.c_proj(y.transpose(1, 2).contiguous().view(B, T, C))


class MLP(nn.Module):
    def __init__(self, d: int):
        super().__init__()
        self.c_fc, self.gelu, self.c_proj = nn.Linear(d, 4 * d), nn.GELU(), nn.Linear(4 * d, d)

    def forward(self, x):
        return self.c_proj(self.gelu(self.c_fc(x)))


class Block(nn.Module):
    def __init__(self, d: int, heads: int):
        super().__init__()
        self.ln_1, self.attn = nn.LayerNorm(d), CausalSelfAttention(d, heads)
        self.ln_2, self.mlp = nn.LayerNorm(d), MLP(d)

    def forward(self, x):
        x = x + self.attn(self.ln_1(x))
        return x + self.mlp(self.ln_2(x))


class GPT(nn.Module):
    """nanoGPT's model, tiny: ``forward(idx, targets)`` returns ``(logits, loss)``."""

    def __init__(self, d: int = 32, heads: int = 2, layers: int = 2, returns: str = "tuple"):
        super().__init__()
        torch.manual_seed(0)
        self.transformer = nn.ModuleDict(dict(
            wte=nn.Embedding(VOCAB, d), wpe=nn.Embedding(BLOCK, d),
            h=nn.ModuleList([Block(d, heads) for _ in range(layers)]), ln_f=nn.LayerNorm(d)))
        self.lm_head = nn.Linear(d, VOCAB, bias=False)
        self.transformer.wte.weight = self.lm_head.weight  # weight tying, as nanoGPT
        self.returns = returns

    def forward(self, idx, targets=None):
        x = self.transformer.wte(idx) + self.transformer.wpe(torch.arange(idx.shape[1]))
        for block in self.transformer.h:
            x = block(x)
        logits = self.lm_head(self.transformer.ln_f(x))
        loss = None if targets is None else F.cross_entropy(logits.view(-1, VOCAB), targets.view(-1))
        if self.returns == "dict":
            return {"logits": logits, "loss": loss}
        if self.returns == "scalar":
            return loss
        return logits, loss


class FlakyLayerNorm(nn.LayerNorm):
    """A LayerNorm that makes NaN while ``armed`` (the replay of the armed step sees it too)."""

    armed = False

    def forward(self, x):
        out = super().forward(x)
        return out * float("nan") if self.armed else out


def batches(steps: int, seed: int = 0):
    gen = torch.Generator().manual_seed(seed)
    return [(torch.randint(0, VOCAB, (4, BLOCK), generator=gen), torch.randint(0, VOCAB, (4, BLOCK), generator=gen))
            for _ in range(steps)]


def loss_of(output):
    """How the loop takes the loss from what the model returned."""
    return output["loss"] if isinstance(output, dict) else output if isinstance(output, torch.Tensor) else output[1]


def train(model, lr: float, steps: int, clip: float | None = None, before=lambda step: None,
          scale_loss=lambda step: 1.0, grads: list | None = None, **watch):
    """nanoGPT's loop: AdamW, forward, backward, an optional clip, step, zero_grad (set_to_none).
    ``grads``: each step's gradients, measured from scratch (``measure``), are appended to it."""
    opt = torch.optim.AdamW(model.parameters(), lr=lr)
    losses = []
    with nbguard.watch(model, optimizer=opt, verify=False, **watch) as w:
        for step, (x, y) in enumerate(batches(steps)):
            before(step)
            loss = loss_of(model(x, y))
            (loss * scale_loss(step)).backward()
            losses.append(loss.item())
            if grads is not None:
                grads.append(measure(model))
            if clip is not None:
                torch.nn.utils.clip_grad_norm_(model.parameters(), clip)
            opt.step()
            opt.zero_grad(set_to_none=True)
    return w, losses


def measure(model) -> dict:
    """The gradients as they are, measured without nbguard: all finite? fp64 2-norm, max |g|, and
    whether an fp32 norm (torch's, per tensor) overflows."""
    grads = [p.grad for p in model.parameters() if p.grad is not None]
    return {"finite": all(bool(torch.isfinite(g).all()) for g in grads),
            "norm": math.sqrt(sum(torch.linalg.vector_norm(g.double()).item() ** 2 for g in grads)),
            "max": max(g.abs().max().item() for g in grads),
            "fp32_overflows": any(math.isinf(n) for n in torch.stack(torch._foreach_norm(grads)).tolist())}


def kinds(watch) -> list[tuple[str, int]]:
    return [(e.kind, e.step) for e in watch.events]


def story(watch) -> list[str]:
    """The report's first screen, line by line."""
    section = view(watch.to_document()).section("story")
    assert section is not None
    return [fact.text for fact in section.facts]


# ---- the loss, wherever the model returns it ---------------------------------------------------------
def planted_nan_run(returns: str):
    model = GPT(returns=returns)
    flaky = FlakyLayerNorm(32)
    flaky.load_state_dict(model.transformer.h[0].ln_2.state_dict())
    model.transformer.h[0].ln_2 = flaky

    def arm(step: int) -> None:
        flaky.armed = step == 4

    return train(model, lr=1e-3, steps=6, before=arm)


@pytest.mark.parametrize("returns", ["tuple", "dict", "scalar"])
def test_a_planted_nan_is_a_nonfinite_loss_read_from_any_output(returns):
    watch, losses = planted_nan_run(returns)
    assert kinds(watch)[0] == ("nonfinite-loss", 4), watch.summary()
    event = watch.events[0]
    assert math.isnan(event.evidence["loss"])
    assert event.origin("forward").module == "transformer.h.0.ln_2"
    history = watch.history.loss
    assert history[:4] == pytest.approx(losses[:4], rel=1e-6) and all(3.5 < v < 5 for v in history[:4])
    assert math.isnan(history[4]) and math.isnan(losses[4])
    assert story(watch)[:2] == ["What went wrong: step 4: non-finite loss (invalid-op)",
                                "Where: transformer.h.0.ln_2 (forward, float32)"]


def test_the_loss_is_the_scalar_a_backward_can_start_from_wherever_the_tuple_holds_it():
    logits = torch.randn(2, 3, requires_grad=True)
    loss, metric = logits.logsumexp(-1).mean(), torch.tensor(0.5)
    assert find_loss((logits, loss)) == ("[1]", loss)  # nanoGPT
    assert find_loss((loss, logits)) == ("[0]", loss)  # transformers' return_dict=False
    assert find_loss((logits, metric, loss)) == ("[2]", loss)  # a logged metric beside it needs no grad
    assert find_loss([logits, metric]) == ("[1]", metric)  # under no_grad the loss needs none either
    assert find_loss((logits, None)) is None  # nanoGPT without targets


# ---- finite gradients whose fp32 norm overflows: an explosion, never a non-finite gradient -----------
def test_learning_rate_1000_is_an_explosion_not_a_nonfinite_gradient():
    measured = []
    watch, losses = train(GPT(), lr=1000.0, steps=6, grads=measured)
    # the run as it is: step 1 jumps 16 decades; at step 2 every gradient is finite (largest ~1e24) but
    # the fp32 norms overflow; at step 3 the backward itself overflows to a real NaN
    assert measured[2]["finite"] and measured[2]["fp32_overflows"] and 1e20 < measured[2]["max"] < 1e27
    assert not measured[3]["finite"]
    assert kinds(watch) == [("divergence", 1), ("nonfinite-grad", 3)], watch.summary()
    diverged, nonfinite = watch.events
    # the explosion's peak is step 2's true norm and largest gradient, not inf
    assert diverged.evidence["peak_step"] == 2
    assert diverged.evidence["peak_grad_norm"] == pytest.approx(measured[2]["norm"], rel=1e-5)
    overflow = diverged.evidence["fp32_norm_overflow"]
    assert overflow["step"] == 2 and overflow["lower_bound"] is False
    assert overflow["max_abs_grad"] == measured[2]["max"]
    assert watch.history.total_grad_norm[2] == pytest.approx(measured[2]["norm"], rel=1e-5)
    # the real NaN at step 3 is reproduced by the replay; the explosion before it leads the report's story
    assert nonfinite.cause == "overflow" and nonfinite.origin("backward") is not None
    assert story(watch)[:3] == ["What went wrong: step 1: divergence",
                                f"Where: {diverged.evidence['exploded_groups'][0]['group']} (its gradient norm jumped most)",
                                "Fix: lower-learning-rate: not verified yet"]


@pytest.mark.parametrize("clip", [None, 1.0])
def test_a_first_explosion_past_fp32s_range_is_a_divergence_event(clip):
    """Five healthy steps, then a loss scaled by 1e22: gradients ~1e21, all finite, fp32 norms inf.
    Under a clip, torch's clip_grad_norm_ zeroes them (max_norm / inf) before the step's read: the
    event then says the norm was at least the least one that overflows."""
    measured = []
    watch, _ = train(GPT(), lr=1e-3, steps=7, clip=clip, scale_loss=lambda step: 1e22 if step == 5 else 1.0,
                     grads=measured)
    assert measured[5]["finite"] and measured[5]["fp32_overflows"]
    assert kinds(watch) == [("divergence", 5)], watch.summary()
    event = watch.events[0]
    overflow = event.evidence["fp32_norm_overflow"]
    assert overflow["step"] == 5 and overflow["lower_bound"] is (clip is not None)
    if clip is None:
        assert event.evidence["total_grad_norm"] == pytest.approx(measured[5]["norm"], rel=1e-5)
        assert overflow["max_abs_grad"] == measured[5]["max"]
        assert f"exploded to {measured[5]['norm']:.3g} (past fp32's range" in event.message
    else:
        assert 1.8e19 < event.evidence["total_grad_norm"] < measured[5]["norm"]
        assert overflow["max_abs_grad"] is None and "exploded to at least" in event.message


# ---- one judgement of gradient spikes, with the loss as context ------------------------------------
def judged_jump(loss_at_jump: float, jump: float = 200.0):
    """20 quiet steps (norm ~1, loss falling from 5.0 to 4.81), then a jump of the norm to ``jump``."""
    detector = DivergenceDetector()
    for step in range(20):
        norm = 1.0 + 0.05 * (step % 2)
        assert detector.update(step, 5.0 - 0.01 * step, norm, ["g"], [norm]) is None
    return detector.update(20, loss_at_jump, jump, ["g"], [jump])


def test_a_100x_jump_while_the_loss_still_falls_is_a_swing_and_with_the_loss_up_an_explosion():
    assert judged_jump(4.79) is None  # below the recent loss median: the run is learning
    rising = judged_jump(9.0)
    assert rising is not None and rising["loss_falling"] is False and 2 < rising["decades_above_level"] < 3
    falling_far = judged_jump(4.79, jump=1e6)  # no learning-rate explosion stays under 1000x
    assert falling_far is not None and falling_far["loss_falling"] is True


def memorise(seed: int, steps: int = 40):
    """A tiny Llama memorising one batch with AdamW at 0.05: its losses and its watch."""
    model = tiny_llama()
    opt = torch.optim.AdamW(model.parameters(), lr=0.05)
    batch = tiny_batch(4, 16, seed=seed)
    losses = []
    with nbguard.watch(model, optimizer=opt, verify=False) as watch:
        for _ in range(steps):
            loss = model(**batch).loss
            loss.backward()
            losses.append(loss.item())
            opt.step()
            opt.zero_grad()
    return watch, losses


def test_memorising_runs_whose_gradient_norm_swings_10x_while_their_loss_falls_stay_quiet():
    """One repeated batch: the loss falls from 4.9 to about 1 while the gradient norm swings (the
    issue's 24-layer LoRA run at 1e-4 swung 10.6x at step 147; tiny LoRA runs here stay under 6x, so
    a tiny Llama at a high learning rate makes the same swing in 40 steps, on one batch of three)."""
    # Which seeds swing 10x at a falling loss depends on the CPU's float rounding (on an AMD EPYC seeds 5 and 15
    # of 0-15 do, where seeds 0-2 did elsewhere): take seeds in turn until one has, every run quiet.
    swung = tried = 0
    for seed in range(16):
        watch, losses = memorise(seed)
        norms = watch.history.total_grad_norm
        # the ratio the old grad-spike check used: the norm over the median of the last 50, after 10 steps
        swung += any(norms[i] > 10 * statistics.median(norms[max(0, i - 50):i]) and losses[i] < losses[i - 1]
                     for i in range(10, len(norms)))
        tried += 1
        assert losses[-1] < losses[0] / 2  # it learns
        assert watch.events == [], watch.summary()
        if swung and tried >= 3:
            break
    assert swung, f"none of {tried} memorising runs swung 10x at a falling loss: the case is not exercised"


def test_the_overflow_read_costs_two_more_reads_on_its_step_and_none_on_the_others(monkeypatch):
    reads: list[int] = []
    tolist = torch.Tensor.tolist

    def counted(self, *args, **kwargs):
        reads[-1] += 1
        return tolist(self, *args, **kwargs)

    monkeypatch.setattr(torch.Tensor, "tolist", counted)
    watch, _ = train(GPT(), lr=1e-3, steps=7, scale_loss=lambda step: 1e22 if step == 5 else 1.0,
                     before=lambda step: reads.append(0))
    assert kinds(watch) == [("divergence", 5)]
    # the step's one read; on step 5 each tensor's max |g|, then the scaled norms; after the last step, the
    # detach reads its update norms once (a step's update norms otherwise ride in the next step's read)
    assert reads == [1, 1, 1, 1, 1, 3, 2]
