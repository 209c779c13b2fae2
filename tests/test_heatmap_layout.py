"""The heatmap PNG read as a person reads it (issue 41): row labels that keep the layer index and the leaf
and never repeat, a step axis, a size that follows the rows and columns, and no text over another."""
from __future__ import annotations

import itertools
import struct

import numpy as np

from nbguard.render.heatmap import heatmap_figure, heatmap_png
from nbguard.render.labels import fit_labels

LEAVES = ("input_layernorm", "self_attn", "mlp", "post_attention_layernorm", "post_feedforward_layernorm")


def gemma_history(layers: int = 2, steps: int = 8, head: str = "model.language_model") -> dict:
    """A Gemma 3 watch's history: long module paths whose layers differ only by their index."""
    groups = ["model.embed_tokens", *(f"{head}.layers.{i}.{leaf}" for i in range(layers) for leaf in LEAVES),
              "lm_head"]
    grid = np.exp(np.random.default_rng(0).normal(0, 1, (len(groups), steps))).tolist()
    for row in grid:
        row[min(2, steps - 1)] = "nan"
    return {"groups": groups, "steps": list(range(steps)), "grad_norm": grid, "skipped_steps": [min(2, steps - 1)]}


def png_size(png: bytes) -> tuple[int, int]:
    width, height = struct.unpack(">II", png[16:24])  # the IHDR chunk
    return width, height


def row_labels(history: dict) -> list[str]:
    fig = heatmap_figure(history)
    return [t.get_text() for t in fig.axes[0].get_yticklabels()]


def drawn_texts(fig) -> list:
    """Every text the picture shows: figure texts, legend, axis labels, and the tick labels within view."""
    texts = [*fig.texts, *(t for legend in fig.legends for t in legend.get_texts())]
    for ax in fig.axes:
        texts += [ax.title, ax.xaxis.label, ax.yaxis.label]
        for axis in (ax.xaxis, ax.yaxis):
            low, high = sorted(axis.get_view_interval())
            for tick in [*axis.get_major_ticks(), *axis.get_minor_ticks()]:
                if low - 1e-9 <= tick.get_loc() <= high + 1e-9 * max(1.0, abs(high)):
                    texts += [label for label in (tick.label1, tick.label2) if label.get_visible()]
    return texts


def test_row_labels_keep_the_layer_index_and_the_leaf_and_never_repeat():
    labels = row_labels(gemma_history())
    assert len(labels) == len(set(labels)) == 12
    for layer, leaf in itertools.product((0, 1), LEAVES):
        assert sum(label.endswith(f"layers.{layer}.{leaf}") for label in labels) == 1, labels
    assert "model.embed_tokens" in labels and "lm_head" in labels
    # siblings read alike: every layer row lost the same head, none kept it
    assert all(label.startswith("…layers.") for label in labels[1:-1]), labels


def test_labels_that_would_collide_keep_more_until_they_differ():
    names = ["model.vision_tower.encoder.layers.0.mlp", "model.language_model.layers.0.mlp", "lm_head"]
    fitted = fit_labels(names, 12)
    assert len(set(fitted)) == 3 and all(label.endswith("layers.0.mlp") for label in fitted[:2])
    assert fit_labels(["model.layers.0.mlp"], 40) == ["model.layers.0.mlp"]  # what fits stays whole
    # a short one-off row beside cut layer rows keeps its name (the quickstart's Gemma 3: model.norm)
    quickstart = ["model.embed_tokens", "model.layers.0.post_feedforward_layernorm", "model.norm"]
    assert fit_labels(quickstart, 36) == ["model.embed_tokens", "…layers.0.post_feedforward_layernorm", "model.norm"]


def test_the_step_axis_is_labelled_with_steps():
    fig = heatmap_figure(gemma_history(steps=8))
    ax = fig.axes[0]
    assert ax.get_xlabel() == "optimizer step"
    assert [t.get_text() for t in ax.get_xticklabels()] == [str(s) for s in range(8)]
    many = heatmap_figure(gemma_history(steps=300)).axes[0]
    ticks = [t.get_text() for t in many.get_xticklabels()]
    assert ticks[0] == "0" and 5 <= len(ticks) <= 30 and all(t.isdigit() for t in ticks)


def test_the_picture_grows_with_rows_and_columns():
    short = png_size(heatmap_png(gemma_history(layers=2, steps=8)))
    long_run = png_size(heatmap_png(gemma_history(layers=2, steps=300)))
    deep = png_size(heatmap_png(gemma_history(layers=8, steps=8)))
    assert short[0] <= 800  # eight steps: not a page-wide strip that a notebook shrinks to unreadable labels
    assert long_run[0] > short[0] + 300 and long_run[1] <= short[1]
    assert deep[1] > short[1] + 200 and deep[0] == short[0]


def test_no_text_lands_on_another_or_off_the_picture():
    for history in (gemma_history(), gemma_history(layers=8, steps=300), gemma_history(steps=1)):
        fig = heatmap_figure(history)
        fig.canvas.draw()  # texts land where the drawing puts them
        renderer = fig.canvas.get_renderer()
        frame = fig.bbox
        texts = [t for t in drawn_texts(fig) if t.get_visible() and t.get_text().strip()]
        boxes = [(t.get_text(), t.get_window_extent(renderer)) for t in texts]
        for text, bbox in boxes:
            assert frame.x0 - 1 <= bbox.x0 and bbox.x1 <= frame.x1 + 1, text
            assert frame.y0 - 1 <= bbox.y0 and bbox.y1 <= frame.y1 + 1, text
        for (a, box_a), (b, box_b) in itertools.combinations(boxes, 2):
            assert not box_a.overlaps(box_b), (a, b)
