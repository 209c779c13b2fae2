/**
 * The Lab view of an nbguard output: a formatter of the payload's `view` (nbguard/document/view.py).
 *
 * view.py decides what is said (section order, titles, counts, the spelling of every number, the
 * palette); this module decides only the layout, so the Lab view shows the same sections and
 * values as the static HTML, the text and the Markdown. The document beside the view is read for
 * the pictures only: a chart's `source` is the path of the data it draws.
 *
 * Everything is built with text nodes (never innerHTML), so a document from an untrusted notebook
 * cannot inject markup; the renderer is therefore safe for untrusted outputs. The payload was
 * checked against the schema before it got here (document.ts); still, no class name is taken from
 * data: each enumeration maps to its classes through a fixed table below. Every string is shown
 * with its control, bidirectional and invisible characters marked (text.ts), and a fix's cell is
 * one string, normalised once, that is both shown and inserted.
 */
import { Payload, decodeNumber, documentHeading, isObject, lookup } from './document';
import { confirmSavedFix, SavedFix, wrapCode } from './confirm';
import { createHeatmap } from './heatmap';
import { safeColor, severityColor } from './safety';
import type { Card, Chart, Fact, FixView, Fold, NbguardDocument, Palette, Section, Table, Verdict, View } from './schema';
import { createSeries } from './series';
import { cellSource, markedText, setText } from './text';

// The classes each enumeration of the view draws with: from these tables only, never from data.
// Typed by the generated enumerations, so a new value in the schema fails the type check here.
const SECTION_CLASS: Record<Section['kind'], string> = {
  story: 'nbg-section-story',
  notes: 'nbg-section-notes',
  entry: 'nbg-section-entry',
  hardware: 'nbg-section-hardware',
  stack: 'nbg-section-stack',
  findings: 'nbg-section-findings',
  probe: 'nbg-section-probe',
  watch: 'nbg-section-watch',
  verifications: 'nbg-section-verifications',
  diagnoses: 'nbg-section-diagnoses',
  fixes_applied: 'nbg-section-fixes_applied',
  fix_cells: 'nbg-section-fix_cells',
  environment: 'nbg-section-environment'
};
const CARD_TONE_CLASS: Record<Card['tone'], string> = {
  error: 'nbg-tone-error',
  warning: 'nbg-tone-warning',
  info: 'nbg-tone-info'
};
const BADGE_TONE_CLASS: Record<Card['tone'], string> = {
  error: 'nbg-badge-error',
  warning: 'nbg-badge-warning',
  info: 'nbg-badge-info'
};
const FACT_TONE_CLASS: Record<Fact['tone'], string> = { bad: 'nbg-fact-bad', skip: 'nbg-fact-skip', good: 'nbg-fact-good', '': '' };
const FOLD_KIND_CLASS: Record<Fold['kind'], string> = { json: 'nbg-fold-json', text: 'nbg-fold-text', code: 'nbg-fold-code' };
const VERDICT_CLASS: Record<Verdict['status'], string> = {
  verified: 'nbg-verdict-verified',
  'not-enough': 'nbg-verdict-not-enough',
  'not-checked': 'nbg-verdict-not-checked'
};
const CHART_CLASS: Record<Chart['kind'], string> = {
  heatmap: 'nbg-chart-heatmap',
  updates: 'nbg-chart-updates',
  series: 'nbg-chart-series',
  activations: 'nbg-chart-activations'
};

/** The class `value` maps to in `table`; '' for anything the table does not hold (or "__proto__"). */
export function classFor<K extends string>(table: Record<K, string>, value: unknown): string {
  return typeof value === 'string' && Object.prototype.hasOwnProperty.call(table, value) ? table[value as K] : '';
}

function classes(...names: string[]): string {
  return names.filter(Boolean).join(' ');
}

/** Inserts `code` as a new cell below the cell owning this output, runs it when `run`. */
export type FixInserter = (code: string, run: boolean) => Promise<string | void>;

export interface RenderContext {
  /** null where the output is not inside a notebook: the buttons are then disabled. */
  insertFix: FixInserter | null;
  /**
   * The notebook's trust in this output (the MIME model's `trusted`). An untrusted output is data,
   * never an action: no "Insert and run", "Insert cell" only after `confirmInsert`, and "verified"
   * read as "verified when saved" (the saved file says so; this kernel has not checked it).
   */
  trusted: boolean;
  /** Asks before an untrusted fix cell is inserted; default: the dialog of confirm.ts. */
  confirmInsert?: (fix: SavedFix) => Promise<boolean>;
}

/** What to draw for a payload: its view, or a note for outputs saved before views existed. */
export function renderPayload(payload: Payload, context: RenderContext): HTMLElement {
  return payload.view ? renderView(payload.view, payload.doc, context) : renderWithoutView(payload.doc);
}

export function renderView(view: View, doc: NbguardDocument, context: RenderContext): HTMLElement {
  const root = el('div', 'nbg-report');
  root.dataset.kind = String(doc.kind ?? '');
  const header = el('div', 'nbg-header');
  header.append(el('span', 'nbg-title', view.title), el('span', 'nbg-meta', view.meta));
  root.appendChild(header);
  if (view.summary) {
    root.appendChild(el('div', 'nbg-summary', view.summary));
  }
  // Each picture once (issue 41): the story's chart is its watch's own, drawn in the watch's section (where
  // its hover and the browser tests look for it); the story keeps one line pointing there.
  const drawnLater = new Set(view.sections.filter(s => s.kind !== 'story').flatMap(s => s.charts.map(chartKey)));
  for (const section of view.sections) {
    root.appendChild(renderSection(section, doc, view.palette, context, section.kind === 'story' ? drawnLater : undefined));
  }
  return root;
}

function chartKey(chart: Chart): string {
  return `${chart.kind} ${JSON.stringify(chart.source)}`;
}

/** An output saved by an nbguard without views: its title, and what to do. */
export function renderWithoutView(doc: NbguardDocument): HTMLElement {
  const root = el('div', 'nbg-report nbg-legacy');
  root.dataset.kind = String(doc.kind ?? '');
  const header = el('div', 'nbg-header');
  header.appendChild(el('span', 'nbg-title', documentHeading(doc)));
  root.append(
    header,
    el('div', 'nbg-note', 'This output was saved by an older nbguard and carries no view: re-run the cell to see it here.')
  );
  return root;
}

/** A section; `drawnElsewhere` names the charts (by `chartKey`) another section of the view draws, which
 * this one only points at. */
export function renderSection(
  section: Section,
  doc: NbguardDocument,
  palette: Palette,
  context: RenderContext,
  drawnElsewhere?: Set<string>
): HTMLElement {
  if (section.kind === 'entry') {
    return el('h3', 'nbg-entry', section.title);
  }
  const box = el('div', classes('nbg-section', classFor(SECTION_CLASS, section.kind)));
  box.dataset.section = section.kind;
  if (section.kind === 'notes') {
    for (const note of section.notes) {
      box.appendChild(el('div', 'nbg-note', note));
    }
    return box;
  }
  if (section.title) {
    box.appendChild(el('div', 'nbg-section-title', section.title));
  }
  if (section.facts.length) {
    box.appendChild(renderFacts(section.facts, palette));
  }
  // A folded section (the environment) shows its title and facts; the rest opens on demand.
  let body: HTMLElement = box;
  if (section.folded) {
    body = el('details', 'nbg-fold');
    body.appendChild(el('summary', '', 'details'));
    box.appendChild(body);
  }
  if (section.table) {
    body.appendChild(renderTable(section.table));
  }
  if (section.empty) {
    body.appendChild(el('div', 'nbg-empty', section.empty));
  }
  if (section.cards_title) {
    body.appendChild(el('div', 'nbg-cards-title', section.cards_title));
  }
  for (const card of section.cards) {
    const drawn = renderCard(card, section.kind, palette, context);
    body.appendChild(isFixesRun(card, section.kind) ? foldedCard(card, drawn) : drawn);
  }
  for (const note of section.notes) {
    body.appendChild(el('div', 'nbg-note', note));
  }
  const charts = section.charts.filter(chart => !drawnElsewhere?.has(chartKey(chart)));
  for (const chart of section.charts.filter(chart => drawnElsewhere?.has(chartKey(chart)))) {
    body.appendChild(el('div', 'nbg-note nbg-chart-below', `${chart.alt}: drawn below, in the watch`));
  }
  // The first chart (a watch's gradient heatmap) in sight; the others (update norms, the series) one click
  // away, so a watch's output stays near one screen (issue 41).
  const [firstChart, ...moreCharts] = charts;
  if (firstChart) {
    body.appendChild(renderChart(firstChart, doc, palette));
  }
  if (moreCharts.length) {
    const more = el('details', 'nbg-fold nbg-more-charts');
    more.appendChild(el('summary', '', `${moreCharts.length} more chart${moreCharts.length > 1 ? 's' : ''}: ${moreCharts.map(c => c.alt).join('; ')}`));
    for (const chart of moreCharts) {
      more.appendChild(renderChart(chart, doc, palette));
    }
    body.appendChild(more);
  }
  return box;
}

/** The card of the fixes a watch ran on an event's step (nbguard/document/view.py, `_event_cards`): its fixes,
 * verdicts and proof are the event card's own, just above; what it adds (each fix's measurements) is detail. */
function isFixesRun(card: Card, sectionKind: Section['kind']): boolean {
  return sectionKind === 'watch' && card.tone === 'info' && card.fixes.length === 0;
}

/** A card one click away: its title in the summary line, the card itself under it. */
function foldedCard(card: Card, drawn: HTMLElement): HTMLElement {
  const fold = el('details', 'nbg-fold nbg-card-fold');
  const rows = card.table?.rows.length ?? 0;
  fold.append(el('summary', '', rows ? `${card.title}: each fix's verdict and measurements (${rows})` : card.title), drawn);
  return fold;
}

// A fact's tone in the palette's colours: bad news in the NaN colour, as the static HTML shows it.
const TONE_COLOR: Record<string, (palette: Palette) => string> = {
  bad: palette => palette.nan,
  skip: palette => palette.skipped,
  good: palette => palette.good
};

function renderFacts(facts: Fact[], palette: Palette): HTMLElement {
  const list = el('ul', 'nbg-facts');
  for (const fact of facts) {
    const item = el('li', classes('nbg-fact', classFor(FACT_TONE_CLASS, fact.tone)), fact.text);
    if (Object.prototype.hasOwnProperty.call(TONE_COLOR, fact.tone)) {
      item.style.color = safeColor(TONE_COLOR[fact.tone](palette));
    }
    list.appendChild(item);
  }
  return list;
}

// The data attribute a card's tag becomes, per section: what tools and tests select by.
const TAG_ATTRIBUTE: Record<string, string> = { findings: 'rule', diagnoses: 'signature', watch: 'event', fix_cells: 'fix' };

export function renderCard(card: Card, sectionKind: string, palette: Palette, context: RenderContext): HTMLElement {
  const box = el('div', classes('nbg-card', classFor(CARD_TONE_CLASS, card.tone)));
  box.style.borderLeftColor = severityColor(palette, card.tone);
  if (card.tag && TAG_ATTRIBUTE[sectionKind]) {
    box.dataset[TAG_ATTRIBUTE[sectionKind]] = card.tag;
  }
  const head = el('div', 'nbg-card-head');
  if (card.badge) {
    const badge = el('span', classes('nbg-badge', classFor(BADGE_TONE_CLASS, card.tone)), card.badge);
    badge.style.backgroundColor = severityColor(palette, card.tone);
    head.appendChild(badge);
  }
  head.appendChild(el('span', 'nbg-card-title', card.title));
  if (card.tag) {
    head.appendChild(el('code', 'nbg-tag', card.tag));
  }
  box.appendChild(head);
  for (const line of card.lines) {
    box.appendChild(el('div', 'nbg-detail', line));
  }
  if (card.quote) {
    box.appendChild(el('code', 'nbg-quote', card.quote));
  }
  // A watch event's title already says what and where; its origin table and evidence are detail, one click away.
  const detail = sectionKind === 'watch' && card.tone !== 'info' && card.table ? el('details', 'nbg-fold nbg-event-detail') : box;
  if (detail !== box) {
    const origins = card.table!.rows.length;
    const evidence = card.folds.length ? ' and evidence' : '';
    detail.appendChild(el('summary', '', `where it was born: ${origins} origin${origins === 1 ? '' : 's'}${evidence}`));
    box.appendChild(detail);
  }
  if (card.table) {
    detail.appendChild(renderTable(card.table));
  }
  for (const fold of card.folds) {
    detail.appendChild(renderFold(fold));
  }
  const [first, ...others] = shownFirst(card.fixes);
  if (first) {
    box.appendChild(renderFix(first, palette, context));
  }
  if (others.length) {
    // the other fixes one click away, as the static HTML folds them (nbguard/render/html.py, _fixes_html)
    const fold = el('details', 'nbg-fold nbg-fix-others');
    const s = others.length > 1 ? 'es' : '';
    fold.appendChild(el('summary', '', first ? `${others.length} other fix${s}` : `${others.length} fix${s}, none verified`));
    for (const fix of others) {
      fold.appendChild(renderFix(fix, palette, context));
    }
    box.appendChild(fold);
  }
  if (card.code) {
    box.appendChild(codeBox(card.code));
  }
  return box;
}

/** [the fix shown open, ...the rest]: the view sends a card's fixes ranked (nbguard/document/view.py), so the
 * first is the recommended one when verified, or when nothing was run at all; with fixes run and none
 * verified, none is shown open (the first slot is null) and all wait under the fold. */
export function shownFirst(fixes: FixView[]): [FixView | null, ...FixView[]] {
  if (!fixes.length) {
    return [null];
  }
  const [top, ...rest] = fixes;
  const open = top.verdict?.status === 'verified' || fixes.every(f => !f.verdict);
  return open ? [top, ...rest] : [null, ...fixes];
}

function renderFold(fold: Fold): HTMLElement {
  const details = el('details', classes('nbg-fold', classFor(FOLD_KIND_CLASS, fold.kind)));
  details.append(el('summary', '', fold.label), codeBox(fold.text));
  return details;
}

/** One fix: its id and title, its verdict, its cell code, and the two insert buttons. */
export function renderFix(fix: FixView, palette: Palette, context: RenderContext): HTMLElement {
  const box = el('div', 'nbg-fix');
  box.dataset.fix = fix.id;
  const head = el('div', 'nbg-fix-head');
  head.append(el('code', 'nbg-fix-id', fix.id));
  if (!context.trusted) {
    head.appendChild(el('span', 'nbg-saved-mark', 'from a saved file'));
  }
  if (fix.title) {
    head.appendChild(el('span', 'nbg-fix-title', fix.title));
  }
  if (fix.verdict) {
    const verified = fix.verdict.status === 'verified';
    // "verified" in an untrusted output is only what the saved file claims
    const label = verified && !context.trusted ? 'verified when saved' : fix.verdict.label;
    const verdict = el('span', classes('nbg-verdict', classFor(VERDICT_CLASS, fix.verdict.status)), label);
    if (verified) {
      verdict.style.color = safeColor(palette.good);
    }
    head.appendChild(verdict);
    if (fix.verdict.detail) {
      head.appendChild(el('span', 'nbg-verdict-detail', fix.verdict.detail));
    }
  }
  box.appendChild(head);
  if (!fix.code) {
    return box; // no cell was recorded for this fix: nothing to insert
  }
  // The one string this fix's cell is: shown here (a click away, as the static HTML folds it: the buttons
  // stay in sight), shown in the confirmation, inserted.
  const cell = cellSource(fix.code);
  const lines = cell.source.split('\n').length;
  const folded = el('details', 'nbg-fold nbg-fold-code nbg-fix-cell');
  folded.append(el('summary', '', `the cell (${lines} line${lines === 1 ? '' : 's'})`), codeBox(cell.source));
  box.appendChild(folded);
  if (!cell.ok) {
    box.appendChild(
      el('div', 'nbg-note nbg-fix-refused', `This cell holds control characters (${cell.refused.join(', ')}) and cannot be inserted.`)
    );
    return box;
  }
  const source = cell.source;
  const actions = el('div', 'nbg-fix-actions');
  const status = el('span', 'nbg-fix-status');
  const insert = button('Insert fix cell', 'nbg-insert');
  // Running a cell from a saved output of an untrusted notebook would run its sender's code.
  const buttons = context.trusted ? [insert, button('Insert and run', 'nbg-insert-run')] : [insert];
  if (!context.insertFix) {
    for (const b of buttons) {
      b.disabled = true;
      b.title = 'Open this output in a notebook to insert the fix as a cell.';
    }
  } else {
    const inserter = context.insertFix;
    const confirm = context.trusted ? null : context.confirmInsert ?? confirmSavedFix;
    const onClick = (run: boolean) => async () => {
      if (confirm && !(await confirm({ id: fix.id, code: source }))) {
        return;
      }
      for (const b of buttons) {
        b.disabled = true;
      }
      status.classList.remove('nbg-error-text');
      status.textContent = run ? 'Inserting and running…' : 'Inserting…';
      try {
        const note = await inserter(source, run && context.trusted);
        status.textContent = note || (run ? 'Inserted below and ran.' : 'Inserted below.');
      } catch (error) {
        status.classList.add('nbg-error-text');
        status.textContent = `Could not insert: ${error instanceof Error ? error.message : String(error)}`;
      } finally {
        for (const b of buttons) {
          b.disabled = false;
        }
      }
    };
    buttons.forEach((b, i) => b.addEventListener('click', onClick(i === 1)));
  }
  actions.append(...buttons, status);
  box.appendChild(actions);
  return box;
}

export function renderTable(table: Table): HTMLElement {
  const t = el('table', 'nbg-table');
  const headed = table.columns.some(c => c);
  if (headed) {
    const tr = el('tr', '');
    for (const column of table.columns) {
      tr.appendChild(el('th', '', column));
    }
    t.appendChild(el('thead', '')).appendChild(tr);
  }
  const body = el('tbody', '');
  const bad = new Set(table.bad_rows);
  table.rows.forEach((row, r) => {
    const tr = el('tr', bad.has(r) ? 'nbg-bad-row' : '');
    row.forEach((value, c) => {
      // a key/value table (no column titles) heads each row with its key
      const cell = el(!headed && c === 0 ? 'th' : 'td', table.numeric[c] ? 'nbg-num' : '');
      cell.appendChild(table.code[c] && value ? el('code', '', value) : markedText(value));
      tr.appendChild(cell);
    });
    body.appendChild(tr);
  });
  t.appendChild(body);
  if (!table.note) {
    return t;
  }
  const wrap = el('div', 'nbg-table-wrap');
  wrap.append(t, el('div', 'nbg-note', table.note));
  return wrap;
}

const VALUE_NAMES: Record<string, string> = { heatmap: 'grad norm', updates: 'update/weight', activations: 'abs-max' };
/** The grid each heatmap kind draws from its section. */
const VALUE_KEYS: Record<string, string> = { heatmap: 'grad_norm', updates: 'update_norm', activations: 'absmax' };

/** A chart drawn from the document part its `source` names; its `empty` text when there is nothing to draw. */
export function renderChart(chart: Chart, doc: NbguardDocument, palette: Palette): HTMLElement {
  const box = el('div', classes('nbg-chart', classFor(CHART_CLASS, chart.kind)));
  if (chart.source[chart.source.length - 1] === 'history' && chart.kind === 'heatmap') {
    box.classList.add('nbg-history'); // the gradient-norm heatmap: what the browser tests point at
  }
  if (chart.empty) {
    box.appendChild(el('div', 'nbg-note nbg-chart-empty', `${chart.alt}: ${chart.empty}`));
    return box;
  }
  const data = lookup(doc, chart.source);
  const drawn = chart.kind === 'series' ? createSeries(chart.alt, data, palette) : heatmap(chart, data, palette);
  if (!drawn) {
    box.appendChild(el('div', 'nbg-note nbg-chart-empty', `${chart.alt}: not in this output`));
    return box;
  }
  if (chart.kind === 'series') {
    box.appendChild(el('div', 'nbg-heatmap-title', chart.alt));
  }
  box.appendChild(drawn);
  return box;
}

function heatmap(chart: Chart, data: unknown, palette: Palette): HTMLElement | null {
  const values = classFor(VALUE_KEYS, chart.kind) || 'grad_norm';
  if (!isObject(data) || !Array.isArray(data.groups) || !Array.isArray(data.steps) || !Array.isArray(data[values])) {
    return null;
  }
  return createHeatmap(
    chart.alt,
    {
      groups: data.groups.map(String),
      steps: data.steps.map(Number),
      values: (data[values] as unknown[]).map(row => (Array.isArray(row) ? row.map(decodeNumber) : [])),
      skippedSteps: Array.isArray(data.skipped_steps) ? data.skipped_steps.map(Number) : [],
      rewindSteps: Array.isArray(data.rewinds) ? data.rewinds.filter(isObject).map(r => Number(r.step)) : [],
      limit: chart.kind === 'activations' ? decodeNumber(data.limit) : null // cells above it: the "over" colour
    },
    VALUE_NAMES[chart.kind] ?? 'value',
    palette
  );
}

function button(label: string, cls: string): HTMLButtonElement {
  const b = el('button', `jp-Button nbg-button ${cls}`, label);
  b.type = 'button';
  return b;
}

/** A code box that wraps (confirm.ts): what it shows is the whole text, line breaks where Python breaks. */
function codeBox(text: string): HTMLElement {
  const pre = el('pre', 'nbg-code', text.replace(/\r\n?/g, '\n'));
  wrapCode(pre);
  return pre;
}

function el<K extends keyof HTMLElementTagNameMap>(tag: K, cls: string, text?: string): HTMLElementTagNameMap[K] {
  const node = document.createElement(tag);
  if (cls) {
    node.className = cls;
  }
  if (text !== undefined) {
    setText(node, text); // control, bidirectional and invisible characters marked (text.ts)
  }
  return node;
}
