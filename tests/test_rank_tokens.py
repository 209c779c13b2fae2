"""rank-token-imbalance's judgement, on the counts the step exchange carries (the two-rank run is
tests/test_ddp_rank_tokens.py)."""
from types import SimpleNamespace

from nbguard.watcher.distributed.rank_tokens import RankTokenBalance, losses_are_rank_means


def test_a_trainer_normalises_across_ranks_unless_told_not_to(tmp_path):
    from transformers import TrainingArguments

    def trainer(**options):
        return SimpleNamespace(args=TrainingArguments(output_dir=str(tmp_path), use_cpu=True, **options))

    assert losses_are_rank_means(trainer(), []) is False  # average_tokens_across_devices defaults to True
    assert losses_are_rank_means(trainer(average_tokens_across_devices=False), []) is True
    loop = [SimpleNamespace(kwargs={"input_ids": None, "labels": None})]
    assert losses_are_rank_means(None, loop) is True
    assert losses_are_rank_means(None, [SimpleNamespace(kwargs={"num_items_in_batch": 7})]) is False


def test_one_event_counts_later_steps_and_a_trainer_gets_the_trainer_fix():
    balance = RankTokenBalance()
    assert balance.judge(0, [40.0, 30.0], rank_means=True, trainer=True) is None  # 1.3x: within noise
    assert balance.judge(1, [40.0, 0.0], rank_means=True, trainer=True) is None  # 0/0: the non-finite path's
    assert balance.judge(2, [40.0, -1.0], rank_means=True, trainer=True) is None  # a rank without token labels
    assert balance.judge(3, [10.0, 80.0], rank_means=False, trainer=True) is None  # normalised across ranks
    event = balance.judge(4, [10.0, 80.0], rank_means=True, trainer=True)
    assert event is not None and event.step == 4 and event.evidence["ratio"] == 8.0
    assert "rank 0 trained on 10 supervised token(s) and rank 1 on 80" in event.message
    assert "average_tokens_across_devices=True" in event.message
    assert balance.judge(5, [60.0, 20.0], rank_means=True, trainer=True) is None  # counted on the first event
    assert event.evidence["occurrences"] == 2 and event.evidence["steps"] == [4, 5]
    assert event.evidence["worst_ratio"] == 8.0
