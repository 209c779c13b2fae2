"""Parameters assigned after attach (a module swapped in) are watched from the next step."""
from __future__ import annotations

import torch
import torch.nn.functional as F
from watch_helpers import _NanGrad, batches

import nbguard
from nbguard.testing import tiny_llama


class NanWeightGradLinear(torch.nn.Linear):
    """A head whose weight gradient is NaN while the gradient it passes back stays finite."""

    def forward(self, x):
        return F.linear(x, _NanGrad.apply(self.weight), self.bias)


def test_a_head_swapped_in_after_attach_is_watched_and_skipped():
    torch.manual_seed(0)
    model = tiny_llama()
    opt = torch.optim.SGD(model.parameters(), lr=0.1)
    watch = nbguard.watch(model, optimizer=opt, policy="skip", verify=False)
    hidden, vocab = model.config.hidden_size, model.config.vocab_size
    model.lm_head = NanWeightGradLinear(hidden, vocab, bias=False)  # after attach
    opt.add_param_group({"params": list(model.lm_head.parameters())})
    opt.zero_grad()
    model(**batches(1)[0]).loss.backward()
    assert not torch.isfinite(model.lm_head.weight.grad).all()
    assert all(torch.isfinite(p.grad).all() for n, p in model.named_parameters() if not n.startswith("lm_head"))
    opt.step()
    watch.detach()
    [event] = watch.events
    assert event.kind == "nonfinite-grad" and event.evidence["nonfinite_groups"] == ["lm_head"]
    assert watch.history.skipped_steps == [0]
    assert all(torch.isfinite(p).all() for p in model.parameters())
