"""``%nbguard help`` names the fix the story recommends as the report's data hold it (``story_fix``), not as a line
of its text reads: a real notebook (the plain float16 loop of test_plain_loop_fixes, one batch overflowing float16
at step 4) watched by ``%%nanwatch`` in an IPython shell with nbguard loaded."""
from __future__ import annotations

from notebook_helpers import run, shell  # noqa: F401 - the fixture
from test_plain_loop_fixes import _watched

import nbguard
from nbguard.document.view import recommended_fix, story_fix, view


def test_story_fix_is_the_event_cards_verified_fix_and_help_names_it(shell):  # noqa: F811
    assert story_fix(nbguard.report().to_dict()) is None  # nothing went wrong yet
    watch = _watched(shell)
    card = next(c for s in view(watch.to_document()).sections if s.kind == "watch" for c in s.cards)
    doc = nbguard.report().to_dict()
    fix = story_fix(doc)
    assert fix is not None and fix.id == recommended_fix(card.fixes).id
    assert fix.verdict is not None and fix.verdict.status == "verified"
    story = [f.text for f in view(doc).section("story").facts]
    assert f"Fix: {fix.id} ({fix.title}): verified on the failing step" in story
    shown = run(shell, "%nbguard help")
    assert shown.error is None
    [line] = [row for row in shown.stdout.splitlines() if row.startswith("Recommended fix:")]
    assert line.startswith(f"Recommended fix: {fix.id}: %nbguard fix {fix.id} --apply")
