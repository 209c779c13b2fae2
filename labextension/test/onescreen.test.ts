/**
 * Issue 41, "one screen": a failing watch drawn in the Lab tells its story in sight (what went wrong, where,
 * the recommended fix with its verdict, one insert button, one line of proof) and leaves the detail one click
 * away: its heatmap is drawn once, the table of the fixes run on the failing step is folded, and a short run's
 * heatmap rows are as tall as their labels need, no taller.
 */
import { beforeEach, describe, expect, it, vi } from 'vitest';

import { readPayload } from '../src/document';
import { buildHeatmapModel, layoutFor, LABEL_FONT_PX } from '../src/heatmap';
import { renderPayload } from '../src/render';
import { loadFixture } from './fixtures';

beforeEach(() => {
  vi.spyOn(HTMLCanvasElement.prototype, 'getContext').mockReturnValue(null);
});

function renderWatch() {
  const raw = loadFixture('watch');
  return { raw, root: renderPayload(readPayload(raw), { insertFix: null, trusted: true }) };
}

describe('a failing watch in one screen', () => {
  it('draws its heatmap once: in the watch, the story pointing there', () => {
    const { raw, root } = renderWatch();
    const story = raw.view.sections.find(s => s.kind === 'story')!;
    const watch = raw.view.sections.find(s => s.kind === 'watch')!;
    expect(story.charts.map(c => [c.kind, c.source])).toEqual([['heatmap', watch.charts[0].source]]); // the same picture
    expect(root.querySelectorAll('.nbg-history canvas')).toHaveLength(1);
    expect(root.querySelector('.nbg-section-watch .nbg-history canvas')).not.toBeNull();
    expect(root.querySelector('.nbg-section-story canvas')).toBeNull();
    expect(root.querySelector('.nbg-section-story .nbg-chart-below')!.textContent).toBe(
      `${story.charts[0].alt}: drawn below, in the watch`
    );
  });

  it('keeps the recommended fix, its verdict, its proof and one insert button in sight', () => {
    const raw = loadFixture('watch');
    // the fixture's planted fault has no verified fix; the quickstart's has one, ranked first by the view
    const card = raw.view.sections.find(s => s.kind === 'watch')!.cards.find(c => c.tone !== 'info')!;
    card.fixes[0].verdict = { status: 'verified', label: 'verified', detail: 'the failing step is healthy under it: loss 4.972' };
    card.fixes[0].code = card.fixes[0].code || 'trainer.args.fp16 = False';
    const root = renderPayload(readPayload(raw), { insertFix: null, trusted: true });
    const event = root.querySelector('.nbg-section-watch > .nbg-card[data-event="nonfinite-loss"]')!;
    const fix = event.querySelector(':scope > .nbg-fix')!;
    expect(fix.querySelector('.nbg-verdict')!.textContent).toBe('verified');
    expect(fix.querySelector('.nbg-verdict-detail')!.textContent).toMatch(/healthy under it/);
    expect(root.querySelectorAll('.nbg-fix-actions button.nbg-insert')).toHaveLength(
      root.querySelectorAll('details .nbg-fix-actions button.nbg-insert').length + 1
    );
  });

  it("folds an event's origin table and evidence under one line: its title says what and where", () => {
    const { raw, root } = renderWatch();
    const card = raw.view.sections.find(s => s.kind === 'watch')!.cards.find(c => c.tone !== 'info')!;
    const event = root.querySelector('.nbg-section-watch > .nbg-card[data-event]')!;
    expect(event.querySelector('.nbg-card-title')!.textContent).toBe(card.title);
    const detail = event.querySelector(':scope > details.nbg-event-detail') as HTMLDetailsElement;
    expect(detail.open).toBe(false);
    expect(detail.querySelector('summary')!.textContent).toBe(
      `where it was born: ${card.table!.rows.length} origin${card.table!.rows.length === 1 ? '' : 's'} and evidence`
    );
    expect(detail.querySelector(':scope > .nbg-table, :scope > .nbg-table-wrap')).not.toBeNull();
    expect(detail.querySelectorAll(':scope > details.nbg-fold')).toHaveLength(card.folds.length);
    expect(event.querySelector(':scope > .nbg-table')).toBeNull();
  });

  it('folds the table of the fixes run on the failing step under one line', () => {
    const { raw, root } = renderWatch();
    const fixesRun = raw.view.sections.find(s => s.kind === 'watch')!.cards.find(c => c.tone === 'info')!;
    expect(fixesRun.fixes).toEqual([]); // its fixes are the event card's own
    const fold = root.querySelector('.nbg-section-watch > details.nbg-card-fold') as HTMLDetailsElement;
    expect(fold.open).toBe(false);
    expect(fold.querySelector('summary')!.textContent).toBe(
      `${fixesRun.title}: each fix's verdict and measurements (${fixesRun.table!.rows.length})`
    );
    expect(fold.querySelector('.nbg-card table')!.querySelectorAll('tbody tr')).toHaveLength(fixesRun.table!.rows.length);
    // an event's own card is never folded
    expect(root.querySelectorAll('.nbg-section-watch > .nbg-card[data-event]')).toHaveLength(
      raw.view.sections.find(s => s.kind === 'watch')!.cards.filter(c => c.tone !== 'info').length
    );
  });

  it("sizes a short run's heatmap rows to their labels", () => {
    const groups = ['model.embed_tokens', ...[0, 1].flatMap(i => ['self_attn', 'mlp', 'input_layernorm'].map(n => `model.layers.${i}.${n}`))];
    const layout = layoutFor(buildHeatmapModel({ groups, steps: [0, 1, 2, 3, 4, 5, 6, 7], values: groups.map(() => Array(8).fill(1)) }));
    expect(layout.cellHeight).toBe(LABEL_FONT_PX + 1); // every row labelled (drawHeatmap labels each row of at least the font's height)
    expect(layout.height).toBeLessThan(130);
  });
});
