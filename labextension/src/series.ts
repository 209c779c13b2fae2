/**
 * A watch's per-step series (loss, total grad norm, loss scale) as SVG, one panel per series the
 * history records: the Lab counterpart of nbguard/render/series.py, in the same palette.
 *
 * Non-finite values cannot be plotted as points: their steps get a vertical line in the NaN colour
 * (the line has a gap there) and skipped steps a triangle on each panel's bottom edge. Built with
 * createElementNS and text nodes only.
 */
import { Num, decodeNumber, formatNumber, isObject } from './document';
import type { Palette } from './schema';

const SVG = 'http://www.w3.org/2000/svg';
export const SERIES: Array<[key: string, label: string, log: boolean]> = [
  ['loss', 'loss', false],
  ['total_grad_norm', 'total grad norm', true],
  ['loss_scale', 'loss scale', true]
];
const WIDTH = 640;
const LABEL = 110;
const PANEL = 64;
const GAP = 10;

export interface SeriesPanel {
  key: string;
  label: string;
  log: boolean;
  values: Num[];
  /** Indexes of steps whose value is NaN or +/-Inf. */
  nonFinite: number[];
  min: number;
  max: number;
}

/** The panels to draw: one per series with at least one recorded value (none when no steps). */
export function seriesPanels(history: unknown): SeriesPanel[] {
  if (!isObject(history) || !Array.isArray(history.steps) || history.steps.length === 0) {
    return [];
  }
  const n = history.steps.length;
  const panels: SeriesPanel[] = [];
  for (const [key, label, logWanted] of SERIES) {
    const raw = Array.isArray(history[key]) ? (history[key] as unknown[]) : [];
    const values = Array.from({ length: n }, (_, i) => decodeNumber(raw[i]));
    if (values.every(v => v === null)) {
      continue;
    }
    const nonFinite = values.flatMap((v, i) => (v !== null && !Number.isFinite(v) ? [i] : []));
    const positive = values.filter((v): v is number => v !== null && Number.isFinite(v) && v > 0);
    // log only across decades, as the matplotlib panel does
    const log = logWanted && positive.length > 1 && Math.max(...positive) > 10 * Math.min(...positive);
    const shown = values.filter((v): v is number => v !== null && Number.isFinite(v) && (!log || v > 0));
    const scaled = shown.map(v => (log ? Math.log10(v) : v));
    panels.push({
      key,
      label,
      log,
      values,
      nonFinite,
      min: scaled.length ? Math.min(...scaled) : 0,
      max: scaled.length ? Math.max(...scaled) : 1
    });
  }
  return panels;
}

/** The SVG element for `history`, or null when it records no series. */
export function createSeries(
  alt: string,
  history: unknown,
  palette: Pick<Palette, 'line' | 'nan' | 'skipped'> & Partial<Pick<Palette, 'rewind'>>
): SVGSVGElement | null {
  const panels = seriesPanels(history);
  if (!panels.length || !isObject(history)) {
    return null;
  }
  const steps = (history.steps as unknown[]).map(s => Number(s));
  const skipped = new Set(Array.isArray(history.skipped_steps) ? history.skipped_steps.map(Number) : []);
  const [first, last] = [steps[0], steps[steps.length - 1]];
  const atStep = (step: number) => LABEL + ((step - first) / Math.max(1, last - first)) * (WIDTH - LABEL - 8);
  const x = (i: number) => atStep(steps[i]);
  const rewinds = rewindSpans(history);
  const height = panels.length * (PANEL + GAP) + 6;
  const svg = svgEl('svg', { class: 'nbg-series', width: WIDTH, height, viewBox: `0 0 ${WIDTH} ${height}`, role: 'img' }) as SVGSVGElement;
  svg.setAttribute('aria-label', alt);
  svg.appendChild(svgEl('title', {}, alt));
  panels.forEach((panel, p) => {
    const top = p * (PANEL + GAP) + 4;
    const y = (v: number) => {
      const s = panel.log ? Math.log10(v) : v;
      const span = panel.max - panel.min || 1;
      return top + PANEL - 4 - ((s - panel.min) / span) * (PANEL - 8);
    };
    const g = svgEl('g', { class: `nbg-series-panel nbg-series-${panel.key}` });
    g.appendChild(svgEl('rect', { x: LABEL, y: top, width: WIDTH - LABEL - 4, height: PANEL, class: 'nbg-series-frame' }));
    const scale = panel.log ? ' (log)' : '';
    g.appendChild(svgEl('text', { x: LABEL - 6, y: top + 12, 'text-anchor': 'end', class: 'nbg-series-label' }, panel.label + scale));
    const range = panel.log ? [10 ** panel.min, 10 ** panel.max] : [panel.min, panel.max];
    g.appendChild(
      svgEl('text', { x: LABEL - 6, y: top + PANEL - 4, 'text-anchor': 'end', class: 'nbg-series-range' },
        `${formatNumber(range[0])} – ${formatNumber(range[1])}`)
    );
    for (const r of palette.rewind ? rewinds : []) {
      // the steps a rewind undid (shaded back to the state it restored) and the rewind itself (dashed)
      const [from, to] = [atStep(Math.max(first, r.restored)), atStep(Math.min(last, r.step))];
      g.appendChild(svgEl('rect', { x: from, y: top, width: Math.max(1, to - from), height: PANEL, fill: palette.rewind as string,
        'fill-opacity': 0.12, class: 'nbg-series-undone' }));
      g.appendChild(
        svgEl('line', { x1: to, x2: to, y1: top, y2: top + PANEL, stroke: palette.rewind as string, 'stroke-width': 2,
          'stroke-dasharray': '4 3', class: 'nbg-series-rewind' }, `step ${r.step}: rewound to the state after step ${r.restored}`)
      );
    }
    for (const i of panel.nonFinite) {
      g.appendChild(
        svgEl('line', { x1: x(i), x2: x(i), y1: top, y2: top + PANEL, stroke: palette.nan, 'stroke-width': 1.5, class: 'nbg-series-bad' },
          `step ${steps[i]}: ${formatNumber(panel.values[i])}`)
      );
    }
    // The line, with a gap wherever the value is missing, non-finite, or not positive on a log axis.
    let d = '';
    let pen = false;
    panel.values.forEach((v, i) => {
      if (v === null || !Number.isFinite(v) || (panel.log && v <= 0)) {
        pen = false;
        return;
      }
      d += `${pen ? 'L' : 'M'}${x(i).toFixed(1)},${y(v).toFixed(1)}`;
      pen = true;
    });
    if (d) {
      g.appendChild(svgEl('path', { d, fill: 'none', stroke: palette.line, 'stroke-width': 1.2, class: 'nbg-series-line' }));
    }
    // Skipped steps on every panel: a triangle on the bottom edge, wider than a NaN line and drawn
    // after it, so a skipped NaN step shows both marks (a tick of the line's width vanished into it).
    steps.forEach((step, i) => {
      if (skipped.has(step)) {
        const [cx, base] = [x(i), top + PANEL];
        g.appendChild(
          svgEl('polygon', { points: `${cx - 4},${base} ${cx + 4},${base} ${cx},${base - 7}`, fill: palette.skipped,
            stroke: 'white', 'stroke-width': 0.8, class: 'nbg-series-skip' }, `step ${step}: skipped`)
        );
      }
    });
    svg.appendChild(g);
  });
  return svg;
}

/** (restored_after_step, step) of each rewind the history records; an entry without both is left out. */
export function rewindSpans(history: Record<string, unknown>): Array<{ restored: number; step: number }> {
  const entries = Array.isArray(history.rewinds) ? history.rewinds : [];
  return entries
    .filter(isObject)
    .map(e => ({ restored: Number(e.restored_after_step), step: Number(e.step) }))
    .filter(r => Number.isFinite(r.restored) && Number.isFinite(r.step));
}

function svgEl(tag: string, attrs: Record<string, string | number>, title?: string): SVGElement {
  const node = document.createElementNS(SVG, tag) as SVGElement;
  for (const [name, value] of Object.entries(attrs)) {
    node.setAttribute(name, String(value));
  }
  if (title !== undefined) {
    if (tag === 'text' || tag === 'title') {
      node.textContent = title;
    } else {
      node.appendChild(svgEl('title', {}, title)); // hover text
    }
  }
  return node;
}
