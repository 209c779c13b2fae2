"""The served template is read by one public helper (``serving_template.served_template``), which the multi-turn
rule imports too: a tokenizer carrying named templates (a dict) is judged on its "default" one by both rules."""
from __future__ import annotations

import pytest
from chat_helpers import WITHOUT_GENERATION
from test_rules_turn_prefix import DROPS_EARLIER_THINK, findings, grpo, multi_turn_prompts

from nbguard.auditor.rules import serving_template, turn_prefix

pytest.importorskip("trl")

def test_the_multi_turn_rule_reads_the_public_served_template(tmp_path):
    assert turn_prefix.served_template is serving_template.served_template
    trainer = grpo(tmp_path, WITHOUT_GENERATION, multi_turn_prompts())
    trainer.processing_class.chat_template = {"default": DROPS_EARLIER_THINK, "tool_use": WITHOUT_GENERATION}
    (finding,) = findings(trainer)  # the default template drops earlier reasoning: named
    assert finding.evidence["breaks"][0]["earlier_rendering"] == "<think>"
