/**
 * Policy rewinds on the timelines of a real rewound watch's output (test/fixtures/rewound.json, written by
 * scripts/make_fixtures.py from a real run whose LR spike climbs and is rewound): the series shades the steps
 * a rewind undid and draws the rewind, the heatmaps mark its column, in the palette's rewind colour.
 */
import { beforeEach, describe, expect, it, vi } from 'vitest';

import { readPayload } from '../src/document';
import { buildHeatmapModel, describeCell } from '../src/heatmap';
import { renderPayload } from '../src/render';
import { loadFixture } from './fixtures';

beforeEach(() => {
  vi.spyOn(HTMLCanvasElement.prototype, 'getContext').mockReturnValue(null); // jsdom draws nothing
});

describe('rewinds on the timelines of a real rewound watch', () => {
  it('the series shades the undone steps and draws each rewind at its step, with its hover text', () => {
    const raw = loadFixture('rewound');
    const [rewind] = raw.history!.rewinds!;
    expect(rewind.step).toBeGreaterThan(rewind.restored_after_step);
    const root = renderPayload(readPayload(raw), { insertFix: null, trusted: true });
    const lines = root.querySelectorAll('.nbg-series .nbg-series-rewind');
    const panels = root.querySelectorAll('.nbg-series .nbg-series-panel');
    expect(panels.length).toBeGreaterThan(0);
    expect(lines.length).toBe(panels.length); // one line per panel: loss, grad norm, ...
    expect(root.querySelectorAll('.nbg-series .nbg-series-undone').length).toBe(panels.length);
    expect(lines[0].getAttribute('stroke')).toBe(raw.view.palette.rewind);
    expect(lines[0].textContent).toBe(
      `step ${rewind.step}: rewound to the state after step ${rewind.restored_after_step}`
    );
  });

  it('the heatmap marks the rewind column, says so on hover and in its legend', () => {
    const raw = loadFixture('rewound');
    const history = raw.history!;
    const [rewind] = history.rewinds!;
    const model = buildHeatmapModel({
      groups: history.groups,
      steps: history.steps,
      values: [],
      rewindSteps: [rewind.step]
    });
    const marked = model.columns.map((c, i) => (c.rewound ? i : -1)).filter(i => i >= 0);
    expect(marked.map(i => model.columns[i].first)).toEqual([rewind.step]);
    expect(describeCell(model, 0, marked[0], 'grad norm')).toContain('rewound here');
    const root = renderPayload(readPayload(raw), { insertFix: null, trusted: true });
    expect(root.querySelector('.nbg-history .nbg-swatch-rewind')).not.toBeNull();
  });

  it('a watch without rewinds draws none', () => {
    const root = renderPayload(readPayload(loadFixture('watch')), { insertFix: null, trusted: true });
    expect(root.querySelector('.nbg-series-rewind')).toBeNull();
    expect(root.querySelector('.nbg-swatch-rewind')).toBeNull();
  });
});
