/**
 * The nbguard document drawn as DOM: header, finding and diagnosis cards with their fix
 * buttons, probe table, events with origins, heatmaps, applied fixes and watches.
 *
 * Everything is built with text nodes (never innerHTML), so a document from an untrusted
 * notebook cannot inject markup; the renderer is therefore safe for untrusted outputs.
 */
import {
  Diagnosis,
  FixApplied,
  Finding,
  History,
  NbEvent,
  NbguardDocument,
  Probe,
  Watch,
  formatNumber
} from './document';
import { createHeatmap } from './heatmap';

/** Inserts `code` as a new cell below the cell owning this output, runs it when `run`. */
export type FixInserter = (code: string, run: boolean) => Promise<string | void>;

export interface RenderContext {
  /** null where the output is not inside a notebook: the buttons are then disabled. */
  insertFix: FixInserter | null;
}

const SEVERITY_ORDER: Record<string, number> = { error: 0, warning: 1, info: 2 };

export function renderDocument(doc: NbguardDocument, context: RenderContext): HTMLElement {
  const root = el('div', 'nbg-report');
  root.dataset.kind = doc.kind;
  root.appendChild(renderHeader(doc));

  if (doc.findings.length > 0 || doc.kind === 'audit') {
    const section = addSection(root, `Findings (${doc.findings.length})`, 'nbg-findings');
    if (doc.findings.length === 0) {
      section.appendChild(el('div', 'nbg-ok', 'No findings: this setup passed every rule.'));
    }
    const sorted = [...doc.findings].sort(
      (a, b) => (SEVERITY_ORDER[a.severity] ?? 3) - (SEVERITY_ORDER[b.severity] ?? 3)
    );
    for (const finding of sorted) {
      section.appendChild(renderFinding(finding, doc, context));
    }
  }
  if (doc.diagnoses.length > 0) {
    const section = addSection(root, 'Diagnosis', 'nbg-diagnoses');
    for (const diagnosis of doc.diagnoses) {
      section.appendChild(renderDiagnosis(diagnosis, doc, context));
    }
  }
  if (doc.events.length > 0) {
    addSection(root, `Events (${doc.events.length})`, 'nbg-events').appendChild(renderEvents(doc.events));
  }
  if (doc.history) {
    addSection(root, 'Gradient norms', 'nbg-history').appendChild(renderHistory(doc.history));
  }
  if (doc.activations && doc.activations.groups.length > 0) {
    const a = doc.activations;
    const section = addSection(root, 'Activation abs-max', 'nbg-activations');
    section.appendChild(
      createHeatmap(`activation abs-max (limit ${formatNumber(a.limit)})`, {
        groups: a.groups,
        steps: a.steps,
        values: a.absmax
      }, 'abs-max')
    );
  }
  if (doc.probe && doc.probe.modules.length > 0) {
    addSection(root, 'Activation probe', 'nbg-probe').appendChild(renderProbe(doc.probe));
  }
  if (doc.fixes_applied.length > 0) {
    addSection(root, 'Fixes applied', 'nbg-fixes-applied').appendChild(renderFixesApplied(doc.fixes_applied));
  }
  for (const watch of doc.watches) {
    root.appendChild(renderWatch(watch));
  }
  if (doc.environment) {
    root.appendChild(renderKeyValues('Environment', doc.environment));
  }
  return root;
}

function renderHeader(doc: NbguardDocument): HTMLElement {
  const header = el('div', 'nbg-header');
  const title = doc.title ?? `nbguard ${doc.kind}`;
  header.appendChild(el('span', 'nbg-title', title));
  const counts = severityCounts(doc.findings);
  const summary: string[] = [];
  for (const severity of ['error', 'warning', 'info']) {
    if (counts[severity]) {
      summary.push(`${counts[severity]} ${severity}${counts[severity] > 1 ? 's' : ''}`);
    }
  }
  if (doc.events.length) {
    summary.push(`${doc.events.length} event${doc.events.length > 1 ? 's' : ''}`);
  }
  if (summary.length) {
    header.appendChild(el('span', 'nbg-summary', summary.join(' · ')));
  }
  const hardware = doc.hardware?.display_name ?? doc.hardware?.name;
  const meta = [hardware ? `hardware: ${String(hardware)}` : '', doc.nbguard_version ? `nbguard ${doc.nbguard_version}` : '']
    .filter(Boolean)
    .join(' · ');
  if (meta) {
    header.appendChild(el('span', 'nbg-meta', meta));
  }
  return header;
}

function severityCounts(findings: Finding[]): Record<string, number> {
  const counts: Record<string, number> = {};
  for (const f of findings) {
    counts[f.severity] = (counts[f.severity] ?? 0) + 1;
  }
  return counts;
}

export function renderFinding(finding: Finding, doc: NbguardDocument, context: RenderContext): HTMLElement {
  const card = el('div', `nbg-card nbg-severity-${finding.severity}`);
  card.dataset.rule = finding.rule;
  const head = el('div', 'nbg-card-head');
  head.append(
    el('span', `nbg-badge nbg-badge-${finding.severity}`, finding.severity),
    el('span', 'nbg-card-title', finding.title),
    el('code', 'nbg-rule', finding.rule)
  );
  card.appendChild(head);
  if (finding.detail) {
    card.appendChild(el('div', 'nbg-detail', finding.detail));
  }
  if (Object.keys(finding.evidence).length > 0) {
    card.appendChild(renderKeyValues('Evidence', finding.evidence));
  }
  for (const fixId of finding.fixes) {
    card.appendChild(renderFix(fixId, doc, context));
  }
  return card;
}

function renderDiagnosis(diagnosis: Diagnosis, doc: NbguardDocument, context: RenderContext): HTMLElement {
  const card = el('div', 'nbg-card nbg-severity-error');
  card.dataset.signature = diagnosis.signature;
  const head = el('div', 'nbg-card-head');
  head.append(
    el('span', 'nbg-badge nbg-badge-error', 'diagnosis'),
    el('span', 'nbg-card-title', diagnosis.title),
    el('code', 'nbg-rule', diagnosis.signature)
  );
  card.appendChild(head);
  if (diagnosis.detail) {
    card.appendChild(el('div', 'nbg-detail', diagnosis.detail));
  }
  if (diagnosis.exception) {
    const details = el('details', 'nbg-evidence');
    details.append(el('summary', '', 'Exception'), el('pre', 'nbg-code', diagnosis.exception));
    card.appendChild(details);
  }
  for (const fixId of diagnosis.fixes) {
    card.appendChild(renderFix(fixId, doc, context));
  }
  return card;
}

/** One fix: its title, its code, and the two insert buttons. */
export function renderFix(fixId: string, doc: NbguardDocument, context: RenderContext): HTMLElement {
  const fix = doc.fix_cells[fixId];
  const box = el('div', 'nbg-fix');
  box.dataset.fix = fixId;
  const head = el('div', 'nbg-fix-head');
  head.append(el('span', 'nbg-fix-title', fix ? fix.title : fixId), el('code', 'nbg-rule', fixId));
  box.appendChild(head);
  if (!fix) {
    box.appendChild(el('div', 'nbg-muted', 'No cell code was recorded for this fix.'));
    return box;
  }
  box.appendChild(el('pre', 'nbg-code', fix.code));
  const actions = el('div', 'nbg-fix-actions');
  const status = el('span', 'nbg-fix-status');
  const insert = button('Insert fix cell', 'nbg-insert');
  const insertRun = button('Insert and run', 'nbg-insert-run');
  if (!context.insertFix) {
    for (const b of [insert, insertRun]) {
      b.disabled = true;
      b.title = 'Open this output in a notebook to insert the fix as a cell.';
    }
  } else {
    const inserter = context.insertFix;
    const onClick = (run: boolean) => async () => {
      insert.disabled = insertRun.disabled = true;
      status.classList.remove('nbg-error-text');
      status.textContent = run ? 'Inserting and running…' : 'Inserting…';
      try {
        const note = await inserter(fix.code, run);
        status.textContent = note || (run ? 'Inserted below and ran.' : 'Inserted below.');
      } catch (error) {
        status.classList.add('nbg-error-text');
        status.textContent = `Could not insert: ${error instanceof Error ? error.message : String(error)}`;
      } finally {
        insert.disabled = insertRun.disabled = false;
      }
    };
    insert.addEventListener('click', onClick(false));
    insertRun.addEventListener('click', onClick(true));
  }
  actions.append(insert, insertRun, status);
  box.appendChild(actions);
  return box;
}

export function renderEvents(events: NbEvent[]): HTMLElement {
  const list = el('div', 'nbg-event-list');
  for (const event of events) {
    const item = el('div', 'nbg-event');
    item.dataset.kind = event.kind;
    const head = el('div', 'nbg-event-head');
    head.append(
      el('span', 'nbg-step', `step ${event.step}`),
      el('code', 'nbg-rule', event.kind),
      ...(event.cause ? [el('span', 'nbg-cause', event.cause)] : []),
      el('span', 'nbg-event-message', event.message)
    );
    item.appendChild(head);
    if (event.origins.length > 0) {
      const rows = event.origins.map(o => [
        o.phase,
        o.module,
        o.tensor ?? '',
        o.dtype ?? '',
        formatNumber(o.input_absmax),
        formatNumber(o.output_absmax),
        o.micro_batch === null ? '' : String(o.micro_batch)
      ]);
      item.appendChild(
        table(['phase', 'module', 'tensor', 'dtype', 'input abs-max', 'output abs-max', 'micro-batch'], rows, 'nbg-origins')
      );
    } else if (event.kind.startsWith('nonfinite')) {
      item.appendChild(el('div', 'nbg-muted', 'No module origin was found for this event.'));
    }
    if (Object.keys(event.evidence).length > 0) {
      item.appendChild(renderKeyValues('Evidence', event.evidence));
    }
    list.appendChild(item);
  }
  return list;
}

function renderHistory(history: History): HTMLElement {
  const box = el('div', 'nbg-history-box');
  box.appendChild(
    createHeatmap('gradient norm', {
      groups: history.groups,
      steps: history.steps,
      values: history.grad_norm,
      skippedSteps: history.skipped_steps
    }, 'grad norm')
  );
  const series: Array<[string, (number | null)[]]> = [
    ['loss', history.loss],
    ['total grad norm', history.total_grad_norm],
    ['loss scale', history.loss_scale]
  ];
  const rows = series
    .filter(([, values]) => values.length > 0)
    .map(([name, values]) => {
      const last = values[values.length - 1];
      const nonFinite = values.filter(v => v !== null && !Number.isFinite(v)).length;
      return [name, formatNumber(last), String(nonFinite)];
    });
  if (rows.length) {
    box.appendChild(table(['series', 'last', 'non-finite steps'], rows, 'nbg-series'));
  }
  if (history.skipped_steps.length) {
    box.appendChild(
      el('div', 'nbg-muted', `Skipped optimizer steps: ${history.skipped_steps.join(', ')}`)
    );
  }
  return box;
}

function renderProbe(probe: Probe): HTMLElement {
  const rows = probe.modules.map(m => [
    m.module,
    m.dtype ?? '',
    formatNumber(m.absmax),
    formatNumber(m.input_absmax),
    formatNumber(m.headroom)
  ]);
  const wrap = el('div', 'nbg-probe-box');
  wrap.appendChild(
    el('div', 'nbg-muted', `limit ${formatNumber(probe.limit)}; headroom = limit / max(output, input abs-max)`)
  );
  wrap.appendChild(
    table(['module', 'dtype', 'output abs-max', 'input abs-max', 'headroom'], rows, 'nbg-probe-table')
  );
  return wrap;
}

function renderFixesApplied(fixes: FixApplied[]): HTMLElement {
  const list = el('div', 'nbg-applied-list');
  for (const fix of fixes) {
    const item = el('div', 'nbg-applied');
    item.appendChild(el('code', 'nbg-rule', fix.fix));
    if (fix.changed !== undefined && fix.changed !== null) {
      item.appendChild(el('span', 'nbg-muted', ` changed: ${summarise(fix.changed)}`));
    }
    if (fix.code) {
      item.appendChild(el('pre', 'nbg-code', fix.code));
    }
    list.appendChild(item);
  }
  return list;
}

function renderWatch(watch: Watch): HTMLElement {
  const section = el('div', 'nbg-section nbg-watch');
  section.appendChild(el('div', 'nbg-section-title', watch.title));
  if (watch.events.length) {
    section.appendChild(renderEvents(watch.events));
  } else {
    section.appendChild(el('div', 'nbg-ok', 'No events.'));
  }
  if (watch.history) {
    section.appendChild(renderHistory(watch.history));
  }
  return section;
}

/** A collapsible key/value table (evidence, environment). */
export function renderKeyValues(label: string, values: Record<string, unknown>): HTMLElement {
  const details = el('details', 'nbg-evidence');
  details.appendChild(el('summary', '', label));
  const rows = Object.entries(values).map(([k, v]) => [k, summarise(v)]);
  details.appendChild(table(['', ''], rows, 'nbg-kv', false));
  return details;
}

function summarise(value: unknown): string {
  if (value === null || value === undefined) {
    return '—';
  }
  if (typeof value === 'string') {
    return value;
  }
  if (typeof value === 'number') {
    return formatNumber(value);
  }
  return JSON.stringify(value);
}

function addSection(root: HTMLElement, title: string, cls: string): HTMLElement {
  const section = el('div', `nbg-section ${cls}`);
  section.appendChild(el('div', 'nbg-section-title', title));
  root.appendChild(section);
  return section;
}

function table(headers: string[], rows: string[][], cls: string, showHeader = true): HTMLElement {
  const t = el('table', `nbg-table ${cls}`);
  if (showHeader) {
    const tr = document.createElement('tr');
    for (const h of headers) {
      tr.appendChild(el('th', '', h));
    }
    t.appendChild(el('thead', '')).appendChild(tr);
  }
  const body = el('tbody', '');
  for (const row of rows) {
    const tr = document.createElement('tr');
    for (const cell of row) {
      tr.appendChild(el('td', '', cell));
    }
    body.appendChild(tr);
  }
  t.appendChild(body);
  return t;
}

function button(label: string, cls: string): HTMLButtonElement {
  const b = el('button', `jp-Button nbg-button ${cls}`, label) as HTMLButtonElement;
  b.type = 'button';
  return b;
}

function el<K extends keyof HTMLElementTagNameMap>(tag: K, cls: string, text?: string): HTMLElementTagNameMap[K] {
  const node = document.createElement(tag);
  if (cls) {
    node.className = cls;
  }
  if (text !== undefined) {
    node.textContent = text;
  }
  return node;
}
