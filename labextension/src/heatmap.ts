/**
 * The gradient-norm (or activation abs-max) heatmap: module groups x optimizer steps.
 *
 * `buildHeatmapModel` is pure: it bins steps (and groups) down to what a canvas can show
 * legibly, keeping every NaN/Inf visible (a bin with one NaN is a NaN bin: aggregation must
 * never hide the value the user is hunting). `HeatmapView` draws the model on a canvas and
 * answers hover with the group, step range and value under the pointer.
 */
import { Num, formatNumber } from './document';
import type { Palette } from './schema';
import { safeColor } from './safety';
import { setText } from './text';
import { fitLabels } from './labels';

/** The colours a heatmap needs, from the view's palette (nbguard/document/palette.py): the canvas
 * keeps no colour of its own, so it matches the static HTML's matplotlib picture. */
export type HeatPalette = Pick<Palette, 'nan' | 'inf' | 'over' | 'missing' | 'skipped' | 'scale'> & Partial<Pick<Palette, 'rewind'>>;

export type CellKind = 'finite' | 'nan' | 'inf' | 'missing';

export interface HeatCell {
  kind: CellKind;
  /** Max of the finite values in the bin (finite), NaN/+-Infinity, or null (missing). */
  value: Num;
}

export interface HeatColumn {
  first: number;
  last: number;
  skipped: boolean;
  /** A policy rewind happened at a step of this column (the state before it was put back). */
  rewound: boolean;
}

export interface HeatRow {
  label: string;
  groups: string[];
}

export interface HeatmapModel {
  rows: HeatRow[];
  columns: HeatColumn[];
  /** rows x columns */
  cells: HeatCell[][];
  /** Smallest and largest positive finite value: the ends of the log colour scale. */
  min: number | null;
  max: number | null;
  nanCount: number;
  infCount: number;
  /** A finite value above it is drawn in the palette's "over" colour (activations: 65504 for fp16). */
  limit: number | null;
  overCount: number;
}

export interface HeatmapInput {
  groups: string[];
  steps: number[];
  values: Num[][];
  skippedSteps?: number[];
  /** Steps at which policy rewind restored an earlier state. */
  rewindSteps?: number[];
  limit?: number | null;
}

export interface HeatmapOptions {
  maxColumns?: number;
  maxRows?: number;
}

export const DEFAULT_MAX_COLUMNS = 400;
export const DEFAULT_MAX_ROWS = 96;
/** A row label longer than this loses its head, never its layer index or leaf (labels.ts). */
export const LABEL_CHARS = 36;

/** Split `n` items into at most `max` contiguous bins of near-equal size: [start, end) pairs. */
export function bins(n: number, max: number): Array<[number, number]> {
  const count = Math.max(0, Math.min(n, Math.max(1, Math.floor(max))));
  const out: Array<[number, number]> = [];
  for (let b = 0; b < count; b++) {
    out.push([Math.floor((b * n) / count), Math.floor(((b + 1) * n) / count)]);
  }
  return out;
}

/** Combine values into one cell: NaN beats Inf beats the finite max beats missing. */
export function aggregate(values: Num[]): HeatCell {
  let sawNan = false;
  let inf: number | null = null;
  let max: number | null = null;
  for (const v of values) {
    if (v === null || v === undefined) {
      continue;
    }
    if (Number.isNaN(v)) {
      sawNan = true;
    } else if (!Number.isFinite(v)) {
      inf = inf === null || v > inf ? v : inf;
    } else {
      max = max === null || v > max ? v : max;
    }
  }
  if (sawNan) {
    return { kind: 'nan', value: NaN };
  }
  if (inf !== null) {
    return { kind: 'inf', value: inf };
  }
  if (max !== null) {
    return { kind: 'finite', value: max };
  }
  return { kind: 'missing', value: null };
}

export function buildHeatmapModel(input: HeatmapInput, options: HeatmapOptions = {}): HeatmapModel {
  const maxColumns = options.maxColumns ?? DEFAULT_MAX_COLUMNS;
  const maxRows = options.maxRows ?? DEFAULT_MAX_ROWS;
  const nSteps = input.steps.length;
  const skipped = new Set(input.skippedSteps ?? []);
  const rewinds = new Set(input.rewindSteps ?? []);
  const columnBins = bins(nSteps, maxColumns);
  const rowBins = bins(input.groups.length, maxRows);

  const columns: HeatColumn[] = columnBins.map(([a, b]) => {
    let isSkipped = false;
    let rewound = false;
    for (let i = a; i < b; i++) {
      isSkipped = isSkipped || skipped.has(input.steps[i]);
      rewound = rewound || rewinds.has(input.steps[i]);
    }
    return { first: input.steps[a], last: input.steps[b - 1], skipped: isSkipped, rewound };
  });
  const names = fitLabels(input.groups, LABEL_CHARS);
  const rows: HeatRow[] = rowBins.map(([a, b]) => {
    const groups = input.groups.slice(a, b);
    const label = b - a === 1 ? names[a] : `${names[a]} – ${names[b - 1]}`;
    return { label, groups };
  });

  let min: number | null = null;
  let max: number | null = null;
  let nanCount = 0;
  let infCount = 0;
  let overCount = 0;
  const limit = input.limit ?? null;
  // One pass over the values the rows hold (cells past a short row are missing, never visited):
  // linear in the values plus the bins, not in groups x steps, which names alone can make huge.
  const columnOf = (c: number): number => {
    let lo = 0;
    let hi = columnBins.length - 1;
    while (lo < hi) {
      const mid = (lo + hi + 1) >> 1;
      if (columnBins[mid][0] <= c) {
        lo = mid;
      } else {
        hi = mid - 1;
      }
    }
    return lo;
  };
  const cells = rowBins.map(([ra, rb]) => {
    const gathered: Num[][] = columnBins.map(() => []);
    for (let r = ra; r < rb; r++) {
      const row = input.values[r];
      if (!Array.isArray(row)) {
        continue;
      }
      const n = Math.min(row.length, nSteps);
      let column = 0;
      for (let c = 0; c < n; c++) {
        if (c === 0 || c >= columnBins[column][1]) {
          column = columnOf(c);
        }
        gathered[column].push(row[c]);
      }
    }
    return gathered.map(values => {
      const cell = aggregate(values);
      if (cell.kind === 'nan') {
        nanCount++;
      } else if (cell.kind === 'inf') {
        infCount++;
      } else if (cell.kind === 'finite' && (cell.value as number) > 0) {
        const v = cell.value as number;
        overCount += limit !== null && v > limit ? 1 : 0;
        min = min === null || v < min ? v : min;
        max = max === null || v > max ? v : max;
      }
      return cell;
    });
  });
  return { rows, columns, cells, min, max, nanCount, infCount, limit, overCount };
}

/** Position of a finite value on the log colour scale, 0 (smallest) to 1 (largest). */
export function logPosition(value: number, min: number | null, max: number | null): number {
  if (min === null || max === null || value <= 0) {
    return 0;
  }
  if (max <= min) {
    return 1;
  }
  const t = (Math.log10(value) - Math.log10(min)) / (Math.log10(max) - Math.log10(min));
  return Math.min(1, Math.max(0, t));
}

/** Parse "#rrggbb" into [r, g, b]. */
function rgb(hex: string): [number, number, number] {
  const match = /^#?([0-9a-f]{2})([0-9a-f]{2})([0-9a-f]{2})$/i.exec(hex.trim());
  if (!match) {
    throw new Error(`nbguard: palette colour ${JSON.stringify(hex)} is not #rrggbb`);
  }
  return [parseInt(match[1], 16), parseInt(match[2], 16), parseInt(match[3], 16)];
}

/** The colour at position t (0..1) of the palette's scale, interpolated between its stops. */
export function scaleColor(t: number, scale: string[]): string {
  if (scale.length === 0) {
    throw new Error('nbguard: the palette has an empty scale');
  }
  const stops = scale.map(rgb);
  if (stops.length === 1) {
    return `rgb(${stops[0].join(', ')})`;
  }
  const x = Math.min(1, Math.max(0, t)) * (stops.length - 1);
  const i = Math.min(stops.length - 2, Math.floor(x));
  const f = x - i;
  const [a, b] = [stops[i], stops[i + 1]];
  const mix = (k: number) => Math.round(a[k] + (b[k] - a[k]) * f);
  return `rgb(${mix(0)}, ${mix(1)}, ${mix(2)})`;
}

export function cellColor(cell: HeatCell, model: HeatmapModel, palette: HeatPalette): string {
  switch (cell.kind) {
    case 'nan':
      return palette.nan;
    case 'inf':
      return palette.inf;
    case 'finite':
      if (model.limit !== null && (cell.value as number) > model.limit) {
        return palette.over;
      }
      return scaleColor(logPosition(cell.value as number, model.min, model.max), palette.scale);
    default:
      return palette.missing;
  }
}

export interface HeatLayout {
  labelWidth: number;
  markerHeight: number;
  cellWidth: number;
  cellHeight: number;
  /** The step axis under the grid: tick labels and its title. */
  axisHeight: number;
  width: number;
  height: number;
}

/** Label font size and the width of one of its characters (a sans-serif average, with room to spare). */
export const LABEL_FONT_PX = 11;
const CHAR_PX = 6.4;
const TICK_FONT_PX = 10;
const TICK_CHAR_PX = 6.2;
/** The tallest row: the label font and a pixel, so every row keeps its label. */
export const ROW_PX = LABEL_FONT_PX + 1;

/** Sizes that follow the rows, the columns and the longest label: cells wide enough to hover, a grid
 * never wider than ~600 px nor taller than ~320 px, a label margin that holds the labels uncut. A row is at
 * most ROW_PX tall: room for its label, and a short run's map stays a third of a screen (issue 41). */
export function layoutFor(model: HeatmapModel): HeatLayout {
  const longest = model.rows.reduce((n, row) => Math.max(n, row.label.length), 0);
  const labelWidth = Math.max(60, Math.min(360, Math.ceil(longest * CHAR_PX) + 12));
  const markerHeight = 8;
  const axisHeight = 30;
  const cols = Math.max(1, model.columns.length);
  const rows = Math.max(1, model.rows.length);
  const cellWidth = Math.max(2, Math.min(24, Math.floor(600 / cols)));
  const cellHeight = Math.max(4, Math.min(ROW_PX, Math.floor(320 / rows)));
  return {
    labelWidth,
    markerHeight,
    cellWidth,
    cellHeight,
    axisHeight,
    // room at the right for the last step number, and under a narrow grid for the axis title
    width: labelWidth + Math.max(cols * cellWidth, 100) + 16,
    height: markerHeight + rows * cellHeight + axisHeight
  };
}

/** The step numbers under the grid: the first column, then every k-th, k a round number chosen so
 * neighbouring labels never touch. x is the centre of the column, in canvas pixels. */
export function stepTicks(model: HeatmapModel, layout: HeatLayout): Array<{ x: number; label: string }> {
  const n = model.columns.length;
  if (n === 0) {
    return [];
  }
  const widest = model.columns.reduce((w, c) => Math.max(w, String(c.first).length), 1);
  const room = (widest + 2) * TICK_CHAR_PX; // the label and a gap
  const needed = Math.max(1, Math.ceil(room / layout.cellWidth));
  const nice = [1, 2, 5, 10, 20, 25, 50, 100, 200, 250, 500, 1000];
  const every = nice.find(v => v >= needed) ?? needed;
  const ticks: Array<{ x: number; label: string }> = [];
  for (let c = 0; c < n; c += every) {
    ticks.push({ x: layout.labelWidth + c * layout.cellWidth + layout.cellWidth / 2, label: String(model.columns[c].first) });
  }
  return ticks;
}

/** The cell under a point in canvas coordinates, or null outside the grid. */
export function cellAt(
  model: HeatmapModel,
  layout: HeatLayout,
  x: number,
  y: number
): { row: number; column: number } | null {
  const column = Math.floor((x - layout.labelWidth) / layout.cellWidth);
  const row = Math.floor((y - layout.markerHeight) / layout.cellHeight);
  if (x < layout.labelWidth || y < layout.markerHeight) {
    return null;
  }
  if (row < 0 || row >= model.rows.length || column < 0 || column >= model.columns.length) {
    return null;
  }
  return { row, column };
}

/** What the tooltip says about one cell: group(s), step (range), value, and its marks. */
export function describeCell(model: HeatmapModel, row: number, column: number, valueName: string): string {
  const r = model.rows[row];
  const c = model.columns[column];
  const cell = model.cells[row][column];
  const steps = c.first === c.last ? `step ${c.first}` : `steps ${c.first}–${c.last}`;
  const value = cell.kind === 'missing' ? 'no value' : `${valueName} ${formatNumber(cell.value)}`;
  const group = r.groups.length > 1 ? `${r.label} (${r.groups.length} groups)` : r.label;
  const over = cell.kind === 'finite' && model.limit !== null && (cell.value as number) > model.limit;
  const marks = `${over ? ` · over the limit ${formatNumber(model.limit)}` : ''}${c.skipped ? ' · optimizer step skipped' : ''}` +
    `${c.rewound ? ' · rewound here' : ''}`;
  return `${group} · ${steps} · ${value}${marks}`;
}

/** Draw the model; a no-op where the canvas has no 2D context (e.g. jsdom). */
export function drawHeatmap(canvas: HTMLCanvasElement, model: HeatmapModel, layout: HeatLayout, palette: HeatPalette): void {
  const ctx = canvas.getContext('2d');
  if (!ctx) {
    return;
  }
  const style = getComputedStyle(canvas);
  // Labels in the theme's text colour (the inherited colour outside JupyterLab).
  const text = style.getPropertyValue('--jp-ui-font-color1').trim() || style.color;
  const font = style.getPropertyValue('--jp-ui-font-family').trim() || 'sans-serif';
  const ratio = window.devicePixelRatio || 1;
  canvas.width = Math.ceil(layout.width * ratio);
  canvas.height = Math.ceil(layout.height * ratio);
  canvas.style.width = `${layout.width}px`;
  canvas.style.height = `${layout.height}px`;
  ctx.setTransform(ratio, 0, 0, ratio, 0, 0);
  ctx.clearRect(0, 0, layout.width, layout.height);

  const { labelWidth, markerHeight, cellWidth: w, cellHeight: h } = layout;
  // Skipped optimizer steps: a strip above the grid, so a skipped column cannot be missed.
  ctx.fillStyle = palette.skipped;
  model.columns.forEach((col, c) => {
    if (col.skipped) {
      ctx.fillRect(labelWidth + c * w, 0, Math.max(1, w - (w > 3 ? 1 : 0)), markerHeight - 2);
    }
  });
  model.cells.forEach((row, r) => {
    row.forEach((cell, c) => {
      const x = labelWidth + c * w;
      const y = markerHeight + r * h;
      ctx.fillStyle = cellColor(cell, model, palette);
      ctx.fillRect(x, y, w, h);
      if ((cell.kind === 'nan' || cell.kind === 'inf') && w >= 4 && h >= 4) {
        // A pattern as well as a colour: NaN gets an X, Inf a single stroke.
        ctx.strokeStyle = palette.missing; // light: stands out on both the NaN and the Inf colour
        ctx.lineWidth = 1;
        ctx.beginPath();
        ctx.moveTo(x + 1, y + h - 1);
        ctx.lineTo(x + w - 1, y + 1);
        if (cell.kind === 'nan') {
          ctx.moveTo(x + 1, y + 1);
          ctx.lineTo(x + w - 1, y + h - 1);
        }
        ctx.stroke();
      }
    });
  });
  // Policy rewinds: a line down the column, over the cells (the state before it was put back there).
  if (palette.rewind) {
    ctx.strokeStyle = palette.rewind;
    ctx.lineWidth = 2;
    model.columns.forEach((col, c) => {
      if (col.rewound) {
        const x = labelWidth + c * w + w / 2;
        ctx.beginPath();
        ctx.moveTo(x, markerHeight);
        ctx.lineTo(x, markerHeight + model.rows.length * h);
        ctx.stroke();
      }
    });
  }
  // Labels: all of them when they fit, otherwise every k-th; each as fitted (labels.ts), never cut here.
  const fontSize = Math.min(LABEL_FONT_PX, Math.max(8, h));
  ctx.font = `${fontSize}px ${font}`;
  ctx.fillStyle = text;
  ctx.textBaseline = 'middle';
  ctx.textAlign = 'right';
  const every = Math.max(1, Math.ceil(fontSize / h));
  model.rows.forEach((row, r) => {
    if (r % every === 0) {
      ctx.fillText(row.label, labelWidth - 4, markerHeight + r * h + h / 2);
    }
  });
  // The step axis: round step numbers under their columns, and what they count.
  const gridBottom = markerHeight + model.rows.length * h;
  ctx.font = `${TICK_FONT_PX}px ${font}`;
  ctx.textAlign = 'center';
  ctx.textBaseline = 'top';
  for (const tick of stepTicks(model, layout)) {
    ctx.fillRect(tick.x - 0.5, gridBottom, 1, 3);
    ctx.fillText(tick.label, tick.x, gridBottom + 4);
  }
  ctx.fillText('optimizer step', labelWidth + (model.columns.length * w) / 2, gridBottom + 4 + TICK_FONT_PX + 3);
}

/** A heatmap element: title, canvas with hover tooltip, and a legend. */
export function createHeatmap(title: string, input: HeatmapInput, valueName: string, palette: HeatPalette): HTMLElement {
  const model = buildHeatmapModel(input);
  const layout = layoutFor(model);
  const root = document.createElement('div');
  root.className = 'nbg-heatmap';
  const heading = document.createElement('div');
  heading.className = 'nbg-heatmap-title';
  setText(heading, `${title} — ${input.groups.length} groups × ${input.steps.length} steps`); // marked: the title is saved text
  root.appendChild(heading);
  if (model.rows.length === 0 || model.columns.length === 0) {
    const empty = document.createElement('div');
    empty.className = 'nbg-muted';
    empty.textContent = 'No steps recorded yet.';
    root.appendChild(empty);
    return root;
  }
  const frame = document.createElement('div');
  frame.className = 'nbg-heatmap-frame';
  const canvas = document.createElement('canvas');
  canvas.className = 'nbg-heatmap-canvas';
  canvas.setAttribute('role', 'img');
  canvas.setAttribute(
    'aria-label',
    `${title}: ${model.nanCount} NaN cells, ${model.infCount} Inf cells, ` +
      `${model.columns.filter(c => c.skipped).length} skipped step columns`
  );
  canvas.style.width = `${layout.width}px`;
  canvas.style.height = `${layout.height}px`;
  // Geometry in CSS pixels, for tools (and the browser test) that point at a given cell.
  canvas.dataset.layout = JSON.stringify(layout);
  const tooltip = document.createElement('div');
  tooltip.className = 'nbg-heatmap-tooltip';
  tooltip.hidden = true;
  frame.append(canvas, tooltip);
  root.append(frame, legend(model, valueName, palette));

  canvas.addEventListener('mousemove', event => {
    const rect = canvas.getBoundingClientRect();
    const x = event.clientX - rect.left;
    const y = event.clientY - rect.top;
    const hit = cellAt(model, layout, x, y);
    if (!hit) {
      tooltip.hidden = true;
      return;
    }
    setText(tooltip, describeCell(model, hit.row, hit.column, valueName)); // group names are saved text: marked
    tooltip.style.left = `${x + 12}px`;
    tooltip.style.top = `${y + 12}px`;
    tooltip.hidden = false;
  });
  canvas.addEventListener('mouseleave', () => {
    tooltip.hidden = true;
  });
  // Draw once attached, so theme variables resolve against the real page.
  requestAnimationFrame(() => drawHeatmap(canvas, model, layout, palette));
  return root;
}

function legend(model: HeatmapModel, valueName: string, palette: HeatPalette): HTMLElement {
  const el = document.createElement('div');
  el.className = 'nbg-heatmap-legend';
  const scale = document.createElement('span');
  scale.className = 'nbg-legend-item';
  const bar = document.createElement('span');
  bar.className = 'nbg-legend-gradient';
  bar.style.background = `linear-gradient(to right, ${palette.scale.map(safeColor).join(', ')})`;
  scale.append(
    `${valueName} (log) ${formatNumber(model.min)} `,
    bar,
    ` ${formatNumber(model.max)}`
  );
  el.appendChild(scale);
  el.appendChild(swatch(palette.nan, `NaN (${model.nanCount})`, 'nbg-swatch-nan'));
  el.appendChild(swatch(palette.inf, `Inf (${model.infCount})`, 'nbg-swatch-inf'));
  if (model.limit !== null) {
    el.appendChild(swatch(palette.over, `over the limit ${formatNumber(model.limit)} (${model.overCount})`, 'nbg-swatch-over'));
  }
  el.appendChild(swatch(palette.missing, 'no value', 'nbg-swatch-missing'));
  el.appendChild(swatch(palette.skipped, 'skipped step (strip above)', 'nbg-swatch-skip'));
  if (palette.rewind && model.columns.some(c => c.rewound)) {
    el.appendChild(swatch(palette.rewind, 'rewind (line over the column)', 'nbg-swatch-rewind'));
  }
  if (model.columns.length > 0 && model.columns[0].first !== model.columns[0].last) {
    const note = document.createElement('span');
    note.className = 'nbg-legend-item nbg-muted';
    note.textContent = 'steps binned; a bin shows its worst value';
    el.appendChild(note);
  }
  return el;
}

function swatch(color: string, label: string, cls: string): HTMLElement {
  const item = document.createElement('span');
  item.className = `nbg-legend-item ${cls}`;
  const box = document.createElement('span');
  box.className = 'nbg-legend-swatch';
  box.style.backgroundColor = safeColor(color); // a colour, never a url() from the saved data
  item.append(box, ` ${label}`);
  return item;
}
