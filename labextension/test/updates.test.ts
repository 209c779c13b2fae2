/**
 * The update-norm heatmap (||Δw|| / ||w|| per group and step; view chart kind "updates") of a real
 * watch's output: test/fixtures/watch.json is written by scripts/make_fixtures.py from a real run.
 */
import { beforeEach, describe, expect, it, vi } from 'vitest';

import { decodeNumber, formatNumber, readPayload } from '../src/document';
import { renderPayload } from '../src/render';
import { loadFixture } from './fixtures';

beforeEach(() => {
  vi.spyOn(HTMLCanvasElement.prototype, 'getContext').mockReturnValue(null); // jsdom draws nothing
});

function watchChart(raw: ReturnType<typeof loadFixture>, kind: string) {
  return raw.view.sections.find(s => s.kind === 'watch')!.charts.find(c => c.kind === kind);
}

describe('the update-norm heatmap of a real watch', () => {
  it('is in the view the kernel sends, drawn from the history it names', () => {
    const raw = loadFixture('watch');
    const chart = watchChart(raw, 'updates')!;
    expect(chart).toBeDefined();
    expect(chart.source).toEqual(['history']);
    expect(chart.empty).toBe('');
    expect(raw.history!.update_norm!.length).toBe(raw.history!.groups.length);
  });

  it('draws a canvas of update/weight values, beside the gradient-norm heatmap', () => {
    const raw = loadFixture('watch');
    const chart = watchChart(raw, 'updates')!;
    const history = raw.history!;
    const root = renderPayload(readPayload(raw), { insertFix: null, trusted: true });
    const box = root.querySelector('.nbg-section-watch .nbg-chart-updates')!;
    expect(box).not.toBeNull();
    expect(box.classList.contains('nbg-history')).toBe(false); // the gradient-norm heatmap keeps that mark
    const canvas = box.querySelector('canvas')!;
    expect(canvas).not.toBeNull();
    expect(canvas.getAttribute('aria-label')).toContain(chart.alt);
    expect(box.querySelector('.nbg-heatmap-title')!.textContent).toBe(
      `${chart.alt} — ${history.groups.length} groups × ${history.steps.length} steps`
    );
    // the legend's log scale runs over the update norms, not the gradient norms
    const values = history.update_norm!.flat().map(v => decodeNumber(v)).filter((v): v is number => v !== null && v > 0 && Number.isFinite(v));
    const scale = box.querySelector('.nbg-heatmap-legend .nbg-legend-item')!.textContent!;
    expect(scale).toContain(`update/weight (log) ${formatNumber(Math.min(...values))}`);
    expect(scale).toContain(formatNumber(Math.max(...values)));
    expect(root.querySelector('.nbg-section-watch .nbg-history .nbg-legend-item')!.textContent).toContain('grad norm (log)');
    // hovering the first cell names the first group's first update
    const layout = JSON.parse(canvas.dataset.layout!);
    const tooltip = box.querySelector('.nbg-heatmap-tooltip') as HTMLElement;
    canvas.dispatchEvent(new MouseEvent('mousemove', { clientX: layout.labelWidth + 1, clientY: layout.markerHeight + 1 }));
    expect(tooltip.hidden).toBe(false);
    expect(tooltip.textContent).toContain(
      `· step ${history.steps[0]} · update/weight ${formatNumber(decodeNumber(history.update_norm![0][0]))}`
    );
  });

  it('says so instead of drawing another grid when the output has no update norms', () => {
    const raw = loadFixture('watch');
    delete raw.history!.update_norm;
    const chart = watchChart(raw, 'updates')!;
    const root = renderPayload(readPayload(raw), { insertFix: null, trusted: true });
    const box = root.querySelector('.nbg-section-watch .nbg-chart-updates')!;
    expect(box.querySelector('canvas')).toBeNull();
    expect(box.querySelector('.nbg-chart-empty')!.textContent).toBe(`${chart.alt}: not in this output`);
  });
});
