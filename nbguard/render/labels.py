"""Row labels of a heatmap that fit a width and still tell the rows apart.

A module path is read from the right: the leaf (``input_layernorm``) and the layer index
(``layers.0``) tell two rows apart, the head before them (``model.language_model.``) does not. So a
label too long for the width loses its head (``…layers.0.input_layernorm``), never the index or the
leaf; and two rows never end up with the same label (labels that would collide get more room until
they differ, at worst their full names).
The lab extension's canvas (labextension/src/heatmap.ts, ``fitLabels``) applies the same rule.
"""
from __future__ import annotations

ELLIPSIS = "…"


def fit_labels(labels: list[str], max_chars: int) -> list[str]:
    """``labels`` shortened to ``max_chars`` each where that keeps them distinct (see the module doc)."""
    budget = max(8, max_chars)
    longest = max((len(label) for label in labels), default=0)
    while True:
        fitted = _fit_all(labels, budget)
        if len(set(fitted)) == len(set(labels)) or budget >= longest:
            break
        budget += 4  # a collision: more room, until the colliding labels keep what tells them apart
    return fitted if len(set(fitted)) == len(set(labels)) else list(labels)


def _fit_all(labels: list[str], budget: int) -> list[str]:
    """Every layer row sharing a head with one too long loses that head, so sibling rows read alike
    (``…layers.0.mlp`` under ``…layers.0.post_feedforward_layernorm``, not the one full, the other cut)."""
    split = [head_and_tail(label) for label in labels]
    cut = {head for label, (head, _) in zip(labels, split) if head and len(label) > budget}
    # a row too long is cut; so is each layer row beside it (same head); a short one-off like model.norm is not
    return [ELLIPSIS + tail if head and (len(label) > budget or (head in cut and _has_index(tail))) else label
            for label, (head, tail) in zip(labels, split)]


def _has_index(tail: str) -> bool:
    return any(_is_index(part) for part in tail.split("."))


def head_and_tail(label: str) -> tuple[str, str]:
    """(what a short label may drop, what it always keeps): the tail runs from the container of the last
    layer index (``layers.0.input_layernorm``), else it is the leaf alone."""
    parts = label.split(".")
    keep = len(parts) - 1
    for index in range(len(parts) - 1, -1, -1):
        if _is_index(parts[index]):
            keep = max(0, index - 1)  # "layers.0": an index needs its container's name to be read
            break
    return ".".join(parts[:keep]), ".".join(parts[keep:])


def _is_index(part: str) -> bool:
    """A layer index: ``0``, ``12``, a binned range ``0–4``, or a count suffix ``3 (7)``."""
    head = part.split(" ", 1)[0]
    return head.replace("–", "").isdigit()
