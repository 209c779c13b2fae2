"""Issue 20 item 4: the faces of the RL checks: the dashboard's reward/margin sparklines, the event cards."""
from __future__ import annotations

import torch
from dashboard_helpers import every_step_dashboard
from rl_helpers import dpo_trainer, grpo_trainer, length_reward, log_match_reward

import nbguard
import nbguard.fixes
from nbguard.document.view import event_card

torch.set_num_threads(1)


def dashboard_of_run(trainer):
    watch = nbguard.watch(trainer, verify=False)
    dash = every_step_dashboard(watch)
    trainer.train()
    dash.finish()
    assert dash.errors == []
    return watch, dash


def sparkline_labels(dash) -> list[str]:
    return [part.split("</small>")[0] for part in dash.sparks.value.split("<small>")[1:]]


def test_grpo_reward_is_drawn_beside_loss_and_grad_norm(tmp_path):
    _, dash = dashboard_of_run(grpo_trainer(tmp_path, reward_funcs=[length_reward, log_match_reward], max_steps=3))
    labels = sparkline_labels(dash)
    assert [label.split(" (")[0] for label in labels] == ["loss", "grad norm", "reward"]
    assert labels[-1] == "reward (last -inf)"
    reward_svg = dash.sparks.value.split("<small>reward")[1]
    assert reward_svg.count("#D55E00") == 3  # each step's -inf reward is marked, not hidden in a gap


def test_dpo_margin_is_drawn_and_zoomed_with_the_steps(tmp_path):
    _, dash = dashboard_of_run(dpo_trainer(tmp_path))
    assert [label.split(" (")[0] for label in sparkline_labels(dash)] == ["loss", "grad norm", "rewards/margins"]
    whole = dash.sparks.value.split("<small>rewards/margins")[1]
    dash.step_range.value = (0, 2)
    zoomed = dash.sparks.value.split("<small>rewards/margins")[1]
    assert zoomed != whole and zoomed.count(",") < whole.count(",")  # three points instead of six


def test_a_plain_run_draws_no_logged_series():
    from nbguard.testing import tiny_batch, tiny_llama

    model = tiny_llama()
    opt = torch.optim.SGD(model.parameters(), lr=0.01)
    with nbguard.watch(model, optimizer=opt) as watch:
        dash = every_step_dashboard(watch)
        for _ in range(2):
            model(**tiny_batch()).loss.backward()
            opt.step()
            opt.zero_grad()
    assert [label.split(" (")[0] for label in sparkline_labels(dash)] == ["loss", "grad norm"]


def test_rl_event_cards_read_well(tmp_path):
    watch = nbguard.watch(trainer := grpo_trainer(tmp_path, reward_funcs=[log_match_reward], max_steps=2),
                          verify=False)
    trainer.train()
    card = event_card(watch.events[0].to_dict())
    assert card.title.startswith("step 0: reward function 'log_match_reward' returned -inf")
    assert card.tag == "nonfinite-reward"


def test_every_run_check_kind_is_known_to_the_document_and_its_schema():
    import json
    from pathlib import Path

    from nbguard.document import EVENT_KINDS
    from nbguard.watcher.components.run_checks import EVENT_KINDS as RUN_KINDS
    from nbguard.watcher.components.run_checks import FIXES

    schema = json.loads((Path(nbguard.__file__).parent / "document" / "schema.json").read_text())
    enum = schema["$defs"]["eventKind"]["enum"]
    assert set(RUN_KINDS) <= set(EVENT_KINDS) and set(RUN_KINDS) <= set(enum)
    assert all(len(text) > 20 for text in RUN_KINDS.values())
    assert {f for fixes in FIXES.values() for f in fixes} <= set(nbguard.fixes.available())
