"""A ``%%nanwatch`` cell's output, on a real run: a real IPython shell with nbguard loaded, a tiny Llama and AdamW,
a NaN planted in a weight at step 2 (the event names the module and the rows, a message of ~170 characters).

What the cell prints under its view when it ends is one line, saying only what the view does not show (the watch
detached, the policy it ran under): the steps, skipped steps and events printed again below it took 51 px of the
quickstart's Lab screen (test-artifacts/browser/quickstart-lab-heights.json). An event's title fits one line (it ran
to two); the rest of its message opens the card's body."""
from __future__ import annotations

import html
import re

from notebook_helpers import run, shell  # noqa: F401 - the fixture
from test_magics import LOOP, WATCH_SETUP

from nbguard.render.text import WIDTH

PLANT_NAN = "with torch.no_grad():\n    net.model.layers[0].mlp.down_proj.weight[0, 0] = float('nan')\n"


def _watched_cell(shell):  # noqa: F811
    """The cell, and its non-finite event."""
    from nbguard.session import SESSION

    run(shell, WATCH_SETUP)
    cell = run(shell, "%%nanwatch net --policy skip\n" + LOOP.format(steps=2) + PLANT_NAN + LOOP.format(steps=1))
    assert cell.error is None, cell.stderr
    [event] = [e for e in SESSION.watches[-1].events if e.kind.startswith("nonfinite")]
    return cell, event


def _words(text: str) -> list[str]:
    return re.sub(r"[;,:]", " ", text).split()


def test_the_line_under_the_view_says_only_what_the_view_does_not(shell):  # noqa: F811
    cell, event = _watched_cell(shell)
    shown = cell.updates[-1]["text/plain"]  # the view, brought up to date when the cell ended
    assert "× 3 steps" in shown and f"step {event.step}:" in shown and event.kind in shown
    printed = [line for line in cell.stdout.splitlines() if line.strip()]
    assert printed == ["nbguard: the watch detached when the cell ended (policy skip); its steps and events are "
                       "in the view above"]
    assert not any(said in printed[0] for said in (event.kind, f"step {event.step}", "optimizer step", "skipped"))


def test_an_event_title_fits_one_line_and_its_message_goes_on_in_the_body(shell):  # noqa: F811
    cell, event = _watched_cell(shell)
    assert len(f"step {event.step}: {event.message}") > WIDTH  # a title that would not fit, whole
    bundle = cell.updates[-1]  # the view as saved when the cell ended
    text = bundle["text/plain"].splitlines()
    [at] = [i for i, line in enumerate(text) if line.endswith(f"  ({event.kind})")]
    assert len(text[at]) <= WIDTH  # one line of the text view, its kind tag beside it
    title = text[at].strip()[:-len(f"  ({event.kind})")]
    body = [line.strip() for line in text[at + 1:at + 4]]
    assert _words(" ".join([title, *body]))[:len(_words(event.message)) + 2] == _words(f"step {event.step}: {event.message}")
    card = re.search(r"<strong>([^<]*)</strong> <code class=\"nbg-meta\">" + re.escape(event.kind) + r"</code></p><p>([^<]*)</p>",
                     bundle["text/html"])
    assert card is not None, "the event's card in the static HTML"
    shown_title, first_line = html.unescape(card[1]), html.unescape(card[2])
    assert shown_title == title and len(shown_title) + len(event.kind) + 6 <= WIDTH  # the same one-line title
    assert first_line.startswith(body[0])  # the message goes on in the card's body
