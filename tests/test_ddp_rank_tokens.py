"""Uneven supervised tokens across two DDP ranks (gloo, CPU, notebook_launcher): the watch predicts from
the token counts its step exchange carries that the ranks' mean losses weigh tokens unequally, and the
mechanism is checked against one process over the same rows (transformers#39392). Both runs are scenarios
of this pytest run's shared notebook_launcher launch (ddp_helpers.NOTEBOOK_BATCH)."""
import pytest
import torch
from ddp_helpers import batch_ranks, uneven_batch

pytestmark = pytest.mark.multirank


def _single_process_grad() -> torch.Tensor:
    """lm_head's gradient of one process over both ranks' rows, every supervised token weighing alike."""
    from nbguard.testing import tiny_llama

    model = tiny_llama()
    batches = [uneven_batch(rank, 0) for rank in (0, 1)]
    merged = {k: torch.cat([b[k] for b in batches]) for k in batches[0]}
    model(**merged).loss.backward()
    return model.lm_head.weight.grad.flatten()


def _relative_gap(ddp: list[float], reference: torch.Tensor) -> float:
    got = torch.tensor(ddp)
    return float((got - reference).norm() / reference.norm())


def test_uneven_tokens_per_rank_get_one_event_on_every_rank_and_really_skew_the_gradient(tmp_path_factory):
    uneven, normalised = (batch_ranks(tmp_path_factory, "notebook_launcher", scenario, "warn", fn="train_uneven_rank")
                          for scenario in ("uneven", "normalised"))
    reference = _single_process_grad()
    # the mechanism: per-rank means averaged by DDP are not one process's token mean; normalised they are
    assert _relative_gap(uneven[0]["first_grad"], reference) > 0.3
    assert _relative_gap(normalised[0]["first_grad"], reference) < 1e-4
    # the prediction, from the counts alone, the same on both ranks
    events = []
    for r in uneven:
        [event] = [e for e in r["events"] if e["kind"] == "rank-token-imbalance"]
        assert [e["kind"] for e in r["events"]] == ["rank-token-imbalance"], r["events"]
        events.append(event)
    assert events[0] == events[1]
    evidence = events[0]["evidence"]
    assert evidence["tokens_by_rank"] == [22, 4] and evidence["ratio"] == pytest.approx(5.5)
    assert evidence["occurrences"] == 3 and evidence["steps"] == [0, 1, 2]
    assert events[0]["step"] == 0 and "rank 1 trained on 4 supervised token(s)" in events[0]["message"]
    assert "num_items_in_batch" in events[0]["message"]  # a loop gets the loop's fix, not TrainingArguments'
    for r in normalised:  # the loop passes num_items_in_batch: normalised across ranks, quiet
        assert r["events"] == [], r["events"]
