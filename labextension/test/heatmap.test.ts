import { beforeEach, describe, expect, it, vi } from 'vitest';

import {
  aggregate,
  bins,
  buildHeatmapModel,
  cellAt,
  cellColor,
  createHeatmap,
  describeCell,
  layoutFor,
  logPosition,
  scaleColor,
  stepTicks
} from '../src/heatmap';
import { fitLabels } from '../src/labels';
import { Num } from '../src/document';
import { loadFixture } from './fixtures';

const palette = loadFixture('watch').view.palette; // the one palette, as the kernel sends it

beforeEach(() => {
  // jsdom has no canvas; drawing is exercised in the browser test.
  vi.spyOn(HTMLCanvasElement.prototype, 'getContext').mockReturnValue(null);
});

function hexToRgb(hex: string): string {
  const [r, g, b] = [1, 3, 5].map(i => parseInt(hex.slice(i, i + 2), 16));
  return `rgb(${r}, ${g}, ${b})`;
}

describe('bins', () => {
  it('covers every item exactly once in at most max bins', () => {
    const b = bins(2000, 400);
    expect(b).toHaveLength(400);
    expect(b[0][0]).toBe(0);
    expect(b[b.length - 1][1]).toBe(2000);
    for (let i = 1; i < b.length; i++) {
      expect(b[i][0]).toBe(b[i - 1][1]);
    }
  });

  it('keeps one bin per item when they fit', () => {
    expect(bins(3, 400)).toEqual([[0, 1], [1, 2], [2, 3]]);
    expect(bins(0, 400)).toEqual([]);
  });
});

describe('aggregate', () => {
  it('lets NaN win over Inf and Inf over finite values', () => {
    expect(aggregate([1, NaN, Infinity]).kind).toBe('nan');
    expect(aggregate([1, Infinity, 3]).kind).toBe('inf');
    expect(aggregate([1, -Infinity]).value).toBe(-Infinity);
    expect(aggregate([1, 5, null, 3])).toEqual({ kind: 'finite', value: 5 });
    expect(aggregate([null, null])).toEqual({ kind: 'missing', value: null });
  });
});

describe('buildHeatmapModel', () => {
  it('marks NaN, Inf, missing and skipped cells of a small history', () => {
    const model = buildHeatmapModel({
      groups: ['a', 'b'],
      steps: [0, 1, 2],
      values: [
        [1, NaN, null],
        [10, 100, Infinity]
      ],
      skippedSteps: [1]
    });
    expect(model.rows.map(r => r.label)).toEqual(['a', 'b']);
    expect(model.cells[0].map(c => c.kind)).toEqual(['finite', 'nan', 'missing']);
    expect(model.cells[1].map(c => c.kind)).toEqual(['finite', 'finite', 'inf']);
    expect(model.columns.map(c => c.skipped)).toEqual([false, true, false]);
    expect(model.min).toBe(1);
    expect(model.max).toBe(100);
    expect(model.nanCount).toBe(1);
    expect(model.infCount).toBe(1);
  });

  it('downsamples 200 groups x 2000 steps without losing a single NaN or skipped step', () => {
    const groups = Array.from({ length: 200 }, (_, i) => `model.layers.${i}`);
    const steps = Array.from({ length: 2000 }, (_, i) => i);
    const values: Num[][] = groups.map((_, g) => steps.map(s => 0.1 + ((g * 7 + s) % 13)));
    values[123][1501] = NaN;
    values[7][42] = Infinity;
    const model = buildHeatmapModel({ groups, steps, values, skippedSteps: [1999] });
    expect(model.rows.length).toBeLessThanOrEqual(96);
    expect(model.columns.length).toBeLessThanOrEqual(400);
    expect(model.nanCount).toBe(1);
    expect(model.infCount).toBe(1);
    const nanRow = model.rows.findIndex(r => r.groups.includes('model.layers.123'));
    const nanCol = model.columns.findIndex(c => c.first <= 1501 && 1501 <= c.last);
    expect(model.cells[nanRow][nanCol].kind).toBe('nan');
    expect(model.columns[model.columns.length - 1].skipped).toBe(true);
    expect(model.columns.filter(c => c.skipped)).toHaveLength(1);
    // every group and step is still accounted for
    expect(model.rows.reduce((n, r) => n + r.groups.length, 0)).toBe(200);
    expect(model.columns[0].first).toBe(0);
    expect(model.columns[model.columns.length - 1].last).toBe(1999);
  });

  it('handles ragged rows as missing values', () => {
    const model = buildHeatmapModel({ groups: ['a'], steps: [0, 1, 2], values: [[1]] });
    expect(model.cells[0].map(c => c.kind)).toEqual(['finite', 'missing', 'missing']);
  });
});

describe('colours and hit-testing', () => {
  const model = buildHeatmapModel({
    groups: ['embed', 'layers.0'],
    steps: [10, 11],
    values: [
      [0.001, 1000],
      [NaN, Infinity]
    ],
    skippedSteps: [11]
  });

  it('uses a log scale and reserved colours for NaN and Inf', () => {
    expect(logPosition(0.001, model.min, model.max)).toBe(0);
    expect(logPosition(1000, model.min, model.max)).toBe(1);
    expect(logPosition(1, model.min, model.max)).toBeCloseTo(0.5);
    expect(cellColor(model.cells[1][0], model, palette)).toBe(palette.nan);
    expect(cellColor(model.cells[1][1], model, palette)).toBe(palette.inf);
    expect(cellColor(model.cells[0][0], model, palette)).not.toBe(cellColor(model.cells[0][1], model, palette));
    expect(cellColor({ kind: 'missing', value: null }, model, palette)).toBe(palette.missing);
  });

  it('takes the ends of its scale from the palette', () => {
    expect(scaleColor(0, palette.scale)).toBe(hexToRgb(palette.scale[0]));
    expect(scaleColor(1, palette.scale)).toBe(hexToRgb(palette.scale[palette.scale.length - 1]));
    expect(scaleColor(0, ['#000000', '#ffffff'])).toBe('rgb(0, 0, 0)');
    expect(scaleColor(0.5, ['#000000', '#ffffff'])).toBe('rgb(128, 128, 128)');
    expect(() => scaleColor(0.5, ['red'])).toThrow(/#rrggbb/);
  });

  it('draws finite values above an activation limit in the palette\'s over colour, and says so', () => {
    const acts = buildHeatmapModel({ groups: ['mlp'], steps: [0, 1, 2], values: [[100, 70000, NaN]], limit: 65504 });
    expect(acts.overCount).toBe(1);
    expect(cellColor(acts.cells[0][1], acts, palette)).toBe(palette.over);
    expect(cellColor(acts.cells[0][0], acts, palette)).not.toBe(palette.over);
    expect(cellColor(acts.cells[0][2], acts, palette)).toBe(palette.nan); // NaN stays NaN
    expect(describeCell(acts, 0, 1, 'abs-max')).toBe('mlp · step 1 · abs-max 70000 · over the limit 65504');
    const gradients = buildHeatmapModel({ groups: ['mlp'], steps: [0, 1], values: [[100, 70000]] });
    expect(gradients.overCount).toBe(0);
    expect(cellColor(gradients.cells[0][1], gradients, palette)).not.toBe(palette.over); // no limit: no over
  });

  it('finds the cell under the pointer and describes group, step and value', () => {
    const layout = layoutFor(model);
    const x = layout.labelWidth + layout.cellWidth * 1 + 1;
    const y = layout.markerHeight + layout.cellHeight * 1 + 1;
    expect(cellAt(model, layout, x, y)).toEqual({ row: 1, column: 1 });
    expect(cellAt(model, layout, 2, y)).toBeNull();
    expect(cellAt(model, layout, layout.width + 5, y)).toBeNull();
    expect(describeCell(model, 1, 1, 'grad norm')).toBe('layers.0 · step 11 · grad norm Inf · optimizer step skipped');
    expect(describeCell(model, 1, 0, 'grad norm')).toBe('layers.0 · step 10 · grad norm NaN');
  });

  it('builds a canvas with a tooltip that follows the pointer', () => {
    const el = createHeatmap('gradient norm', { groups: ['embed', 'layers.0'], steps: [10, 11], values: [[1, 2], [NaN, 3]] }, 'grad norm', palette);
    document.body.appendChild(el);
    const canvas = el.querySelector('canvas')!;
    const tooltip = el.querySelector('.nbg-heatmap-tooltip') as HTMLElement;
    expect(canvas.getAttribute('aria-label')).toContain('1 NaN cells');
    const layout = layoutFor(buildHeatmapModel({ groups: ['embed', 'layers.0'], steps: [10, 11], values: [[1, 2], [NaN, 3]] }));
    canvas.dispatchEvent(
      new MouseEvent('mousemove', { clientX: layout.labelWidth + 1, clientY: layout.markerHeight + layout.cellHeight + 1 })
    );
    expect(tooltip.hidden).toBe(false);
    expect(tooltip.textContent).toBe('layers.0 · step 10 · grad norm NaN');
    canvas.dispatchEvent(new MouseEvent('mouseleave'));
    expect(tooltip.hidden).toBe(true);
    expect(el.querySelector('.nbg-swatch-nan')!.textContent).toContain('NaN (1)');
    el.remove();
  });
});

describe('readable rows and steps (issue 41)', () => {
  const leaves = ['input_layernorm', 'self_attn', 'mlp', 'post_attention_layernorm', 'post_feedforward_layernorm'];
  const gemma = (layers: number, steps: number, head = 'model.language_model') => {
    const groups = ['model.embed_tokens', ...Array.from({ length: layers }, (_, i) => leaves.map(l => `${head}.layers.${i}.${l}`)).flat(), 'lm_head'];
    return { groups, steps: Array.from({ length: steps }, (_, i) => i), values: groups.map(() => Array.from({ length: steps }, () => 1 as Num)) };
  };

  it('keeps the layer index and the leaf of every row, and never repeats a label', () => {
    const labels = buildHeatmapModel(gemma(2, 8)).rows.map(r => r.label);
    expect(new Set(labels).size).toBe(labels.length);
    for (const layer of [0, 1]) {
      for (const leaf of leaves) {
        expect(labels.filter(l => l.endsWith(`layers.${layer}.${leaf}`))).toHaveLength(1);
      }
    }
    expect(labels.slice(1, -1).every(l => l.startsWith('…layers.'))).toBe(true); // siblings read alike
    expect(labels).toContain('model.embed_tokens');
  });

  it('gives colliding labels more room until they differ, and leaves short ones whole', () => {
    const fitted = fitLabels(['model.vision_tower.encoder.layers.0.mlp', 'model.language_model.layers.0.mlp', 'lm_head'], 12);
    expect(new Set(fitted).size).toBe(3);
    expect(fitted.slice(0, 2).every(l => l.endsWith('layers.0.mlp'))).toBe(true);
    expect(fitLabels(['model.layers.0.mlp'], 40)).toEqual(['model.layers.0.mlp']);
    // a short one-off row beside cut layer rows keeps its name (the quickstart's Gemma 3: model.norm)
    expect(fitLabels(['model.embed_tokens', 'model.layers.0.post_feedforward_layernorm', 'model.norm'], 36)).toEqual(
      ['model.embed_tokens', '…layers.0.post_feedforward_layernorm', 'model.norm']);
  });

  it('sizes the label margin, the grid and the axis from the rows, the columns and the labels', () => {
    const short = layoutFor(buildHeatmapModel({ groups: ['a', 'b'], steps: [0, 1], values: [[1, 1], [1, 1]] }));
    const long = layoutFor(buildHeatmapModel(gemma(2, 8)));
    expect(long.labelWidth).toBeGreaterThan(short.labelWidth + 100);
    expect(long.labelWidth).toBeGreaterThanOrEqual('…layers.1.post_feedforward_layernorm'.length * 6);
    const deep = layoutFor(buildHeatmapModel(gemma(8, 8)));
    const wide = layoutFor(buildHeatmapModel(gemma(2, 60)));
    expect(deep.height).toBeGreaterThan(long.height);
    expect(wide.width).toBeGreaterThan(long.width);
    expect(long.axisHeight).toBeGreaterThanOrEqual(24);
    expect(long.height).toBe(long.markerHeight + 12 * long.cellHeight + long.axisHeight);
  });

  it('labels the step axis with steps that never touch', () => {
    for (const steps of [8, 60, 400, 2000]) {
      const model = buildHeatmapModel(gemma(1, steps));
      const layout = layoutFor(model);
      const ticks = stepTicks(model, layout);
      expect(ticks[0].label).toBe('0');
      expect(ticks.length).toBeGreaterThan(1);
      for (let i = 1; i < ticks.length; i++) {
        const room = (ticks[i].label.length + ticks[i - 1].label.length) / 2 * 6.2;
        expect(ticks[i].x - ticks[i - 1].x).toBeGreaterThan(room);
      }
      expect(ticks[ticks.length - 1].x).toBeLessThan(layout.width);
    }
  });
});
