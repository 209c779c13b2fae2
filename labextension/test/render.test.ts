import { beforeEach, describe, expect, it, vi } from 'vitest';

import { readPayload } from '../src/document';
import { renderCard, renderPayload } from '../src/render';
import { loadFixture } from './fixtures';

beforeEach(() => {
  vi.spyOn(HTMLCanvasElement.prototype, 'getContext').mockReturnValue(null);
});

function flush(): Promise<void> {
  return new Promise(resolve => setTimeout(resolve, 0));
}

function render(name: string, insertFix: any = null) {
  const raw = loadFixture(name);
  return { raw, root: renderPayload(readPayload(raw), { insertFix, trusted: true }) };
}

/** The first finding card of the real audit that has a fix with cell code. */
function fixedCard(raw: ReturnType<typeof loadFixture>) {
  const findings = raw.view.sections.find(s => s.kind === 'findings')!;
  const card = findings.cards.find(c => c.fixes.some(f => f.code))!;
  return { card, fix: card.fixes.find(f => f.code)!, palette: raw.view.palette };
}

describe('finding cards of a real audit', () => {
  it('show badge, title, rule, detail, folded evidence and one box per fix, from the view', () => {
    const { raw, root } = render('audit');
    const findings = raw.view.sections.find(s => s.kind === 'findings')!;
    const cards = [...root.querySelectorAll('.nbg-section-findings .nbg-card')] as HTMLElement[];
    expect(cards.map(c => c.dataset.rule)).toEqual(findings.cards.map(c => c.tag));
    expect(cards[0].querySelector('.nbg-badge')!.textContent).toBe('ERROR'); // the worst first
    expect(cards[0].style.borderLeftColor).not.toBe('');
    findings.cards.forEach((card, i) => {
      expect(cards[i].querySelector('.nbg-card-title')!.textContent).toBe(card.title);
      const folds = [...cards[i].querySelectorAll('details.nbg-fold:not(.nbg-fix-cell):not(.nbg-fix-others)')] as HTMLDetailsElement[];
      expect(folds.map(f => f.querySelector('summary')!.textContent)).toEqual(card.folds.map(f => f.label));
      expect(folds.every(f => !f.open)).toBe(true);
      expect([...cards[i].querySelectorAll('.nbg-fix')].map(f => (f as HTMLElement).dataset.fix)).toEqual(card.fixes.map(f => f.id));
      // each fix's cell a click away (issue 41: the audit drew 45-line cells open), its buttons in sight
      for (const box of cards[i].querySelectorAll('.nbg-fix')) {
        const fixCard = card.fixes.find(f => f.id === (box as HTMLElement).dataset.fix)!;
        if (!fixCard.code) {
          continue;
        }
        const cell = box.querySelector('details.nbg-fix-cell') as HTMLDetailsElement;
        expect(cell.open).toBe(false);
        expect(cell.querySelector('summary')!.textContent).toMatch(/^the cell \(\d+ lines?\)$/);
        expect(cell.querySelector('pre.nbg-code')).not.toBeNull();
        expect(box.querySelector(':scope > .nbg-fix-actions button.nbg-insert')).not.toBeNull();
      }
    });
  });

  it('disable the buttons outside a notebook', () => {
    const { raw } = render('audit');
    const { card, palette } = fixedCard(raw);
    const node = renderCard(card, 'findings', palette, { insertFix: null, trusted: true });
    const buttons = [...node.querySelectorAll('.nbg-fix')][0].querySelectorAll('button') as NodeListOf<HTMLButtonElement>;
    expect([...buttons].map(b => b.textContent)).toEqual(['Insert fix cell', 'Insert and run']);
    expect([...buttons].every(b => b.disabled)).toBe(true);
  });

  it('insert the fix cell code, with run=false and run=true', async () => {
    const { raw } = render('audit');
    const { card, fix, palette } = fixedCard(raw);
    const insertFix = vi.fn().mockResolvedValue(undefined);
    const node = renderCard(card, 'findings', palette, { insertFix, trusted: true });
    const box = node.querySelector(`.nbg-fix[data-fix="${fix.id}"]`)!;
    const [insert, insertRun] = [...box.querySelectorAll('button')] as HTMLButtonElement[];
    insert.click();
    await flush();
    expect(insertFix).toHaveBeenLastCalledWith(fix.code, false);
    expect(box.querySelector('.nbg-fix-status')!.textContent).toBe('Inserted below.');
    insertRun.click();
    await flush();
    expect(insertFix).toHaveBeenLastCalledWith(fix.code, true);
    expect(box.querySelector('.nbg-fix-status')!.textContent).toBe('Inserted below and ran.');
    expect(insert.disabled).toBe(false);
  });

  it('report a failed insertion on the card', async () => {
    const { raw } = render('audit');
    const { card, fix, palette } = fixedCard(raw);
    const node = renderCard(card, 'findings', palette, { insertFix: vi.fn().mockRejectedValue(new Error('the notebook is read-only')), trusted: true });
    const box = node.querySelector(`.nbg-fix[data-fix="${fix.id}"]`)!;
    (box.querySelector('button') as HTMLButtonElement).click();
    await flush();
    const status = box.querySelector('.nbg-fix-status')!;
    expect(status.textContent).toBe('Could not insert: the notebook is read-only');
    expect(status.classList.contains('nbg-error-text')).toBe(true);
  });

  it('show a fix without cell code without buttons, and a verdict beside a fix', () => {
    const { raw } = render('audit');
    const { card, fix, palette } = fixedCard(raw);
    const verified = { ...card, fixes: [{ ...fix, verdict: { status: 'verified' as const, label: 'verified', detail: 'step 3 finite' } }, { id: 'no-cell', title: '', code: '', verdict: null }] };
    const node = renderCard(verified, 'findings', palette, { insertFix: vi.fn(), trusted: true });
    const [withCode, without] = [...node.querySelectorAll('.nbg-fix')];
    expect(withCode.querySelector('.nbg-verdict-verified')!.textContent).toBe('verified');
    expect(withCode.querySelector('.nbg-verdict-detail')!.textContent).toBe('step 3 finite');
    expect(without.querySelector('button')).toBeNull();
  });

  it('show the recommended fix open and fold every other fix under one click (issue 41)', () => {
    const { raw } = render('audit');
    const { card, fix, palette } = fixedCard(raw);
    const verdict = (status: 'verified' | 'not-enough') => ({ status, label: status, detail: '' });
    const three = (first: ReturnType<typeof verdict> | null, rest: ReturnType<typeof verdict> | null) => ({
      ...card,
      fixes: [{ ...fix, verdict: first }, { ...fix, id: 'second', verdict: rest }, { ...fix, id: 'third', verdict: rest }]
    });
    const open = (node: HTMLElement) => [...node.querySelectorAll('.nbg-fix')].filter(f => !f.closest('details'));
    const folded = (node: HTMLElement) => [...node.querySelectorAll('details.nbg-fix-others .nbg-fix')];
    const summary = (node: HTMLElement) => node.querySelector('details.nbg-fix-others > summary')!.textContent;

    const verified = renderCard(three(verdict('verified'), verdict('not-enough')), 'findings', palette, { insertFix: vi.fn(), trusted: true });
    expect(open(verified).map(f => (f as HTMLElement).dataset.fix)).toEqual([fix.id]);
    expect(folded(verified).map(f => (f as HTMLElement).dataset.fix)).toEqual(['second', 'third']);
    expect(summary(verified)).toBe('2 other fixes');
    expect((verified.querySelector('details.nbg-fix-others') as HTMLDetailsElement).open).toBe(false);
    expect(open(verified)[0].querySelectorAll('button.nbg-insert')).toHaveLength(1); // one insert button in sight

    const noneVerified = renderCard(three(verdict('not-enough'), verdict('not-enough')), 'findings', palette, { insertFix: vi.fn(), trusted: true });
    expect(open(noneVerified)).toHaveLength(0);
    expect(folded(noneVerified)).toHaveLength(3);
    expect(summary(noneVerified)).toBe('3 fixes, none verified');

    const nothingRun = renderCard(three(null, null), 'findings', palette, { insertFix: vi.fn(), trusted: true });
    expect(open(nothingRun)).toHaveLength(1);
    expect(summary(nothingRun)).toBe('2 other fixes');
  });
});

describe('renderPayload', () => {
  it('draws a passing audit with the view\'s empty text', () => {
    const { raw, root } = render('healthy');
    expect(root.querySelector('.nbg-section-findings .nbg-empty')!.textContent).toBe(raw.view.sections.find(s => s.kind === 'findings')!.empty);
    expect(root.querySelector('.nbg-card')).toBeNull();
  });

  it('draws the probe table with its over-limit rows marked', () => {
    const { raw, root } = render('probe');
    const table = raw.view.sections.find(s => s.kind === 'probe')!.table!;
    expect(table.bad_rows.length).toBeGreaterThan(0);
    const rows = [...root.querySelectorAll('.nbg-section-probe tbody tr')];
    expect(rows).toHaveLength(table.rows.length);
    expect(rows.map((r, i) => r.classList.contains('nbg-bad-row') === table.bad_rows.includes(i))).not.toContain(false);
    expect(rows[0].querySelector('code')!.textContent).toBe(table.rows[0][0]);
  });

  it('draws a watch: facts with tones, the origin table, heatmaps in the palette, and the series', () => {
    const { raw, root } = render('watch');
    // every section's bad facts (the story section first, then the watch's), in order
    expect([...root.querySelectorAll('.nbg-fact-bad')].map(n => n.textContent)).toEqual(
      raw.view.sections.flatMap(s => s.facts).filter(f => f.tone === 'bad').map(f => f.text)
    );
    const event = root.querySelector('.nbg-card[data-event="nonfinite-loss"]')!;
    expect(event.querySelector('td code')!.textContent).toContain('<script>'); // the hostile name, as text
    expect(root.querySelector('script')).toBeNull();
    expect(root.querySelector('.nbg-history canvas')).not.toBeNull();
    expect(root.querySelector('.nbg-chart-activations canvas')).not.toBeNull();
    expect(root.querySelector('.nbg-chart-activations .nbg-swatch-over')!.textContent).toContain(`over the limit ${raw.activations!.limit}`);
    expect(root.querySelector('.nbg-history .nbg-swatch-over')).toBeNull(); // gradient norms have no limit
    const nan = root.querySelector('.nbg-history .nbg-swatch-nan .nbg-legend-swatch') as HTMLElement;
    expect(nan.style.background).toBe(rgb(raw.view.palette.nan));
    const series = root.querySelector('.nbg-chart-series svg')!;
    expect(series.querySelectorAll('.nbg-series-panel').length).toBeGreaterThanOrEqual(2); // loss, total grad norm
    const badSteps = raw.history!.loss!.flatMap((v, i) => (typeof v === 'string' ? [raw.history!.steps[i]] : []));
    expect(badSteps.length).toBeGreaterThan(0);
    expect(series.querySelectorAll('.nbg-series-loss .nbg-series-bad')).toHaveLength(badSteps.length);
    // every panel marks the skipped steps, after (over) its NaN lines
    const panels = series.querySelectorAll('.nbg-series-panel');
    panels.forEach(panel => {
      const marks = [...panel.children].filter(el => el.classList.contains('nbg-series-skip'));
      expect(marks).toHaveLength(raw.history!.skipped_steps!.length);
      const lastBad = [...panel.children].map(el => el.classList.contains('nbg-series-bad')).lastIndexOf(true);
      expect([...panel.children].indexOf(marks[0])).toBeGreaterThan(lastBad);
    });
    // one chart in sight per section, the rest one click away (issue 41: a watch drew three screens)
    for (const section of raw.view.sections.filter(s => s.charts.length > 1)) {
      const box = root.querySelector(`.nbg-section[data-section="${section.kind}"]`)!;
      const more = box.querySelector(':scope > details.nbg-more-charts') as HTMLDetailsElement;
      expect(more.open).toBe(false);
      expect(more.querySelector('summary')!.textContent).toContain(`${section.charts.length - 1} more chart`);
      expect(more.querySelectorAll(':scope > *:not(summary)')).toHaveLength(section.charts.length - 1);
    }
    expect(raw.view.sections.some(s => s.charts.length > 1)).toBe(true);
  });

  it('says why a chart is empty instead of drawing an empty canvas', () => {
    const raw = loadFixture('watch');
    const chart = raw.view.sections.find((s: { kind: string }) => s.kind === 'watch')!.charts.find(c => c.kind === 'heatmap')!;
    chart.empty = 'every gradient norm recorded is non-finite (NaN/Inf): nothing to draw on a scale';
    const root = renderPayload(readPayload(raw), { insertFix: null, trusted: true });
    expect(root.querySelector('.nbg-section-watch .nbg-history canvas')).toBeNull();
    expect(root.querySelector('.nbg-section-watch .nbg-history .nbg-chart-empty')!.textContent).toBe(`${chart.alt}: ${chart.empty}`);
  });

  it('draws a report as its story: entry headings, then each entry\'s sections', () => {
    const { raw, root } = render('report');
    const entries = [...root.querySelectorAll('.nbg-entry')].map(n => n.textContent);
    expect(entries).toEqual(raw.view.sections.filter(s => s.kind === 'entry').map(s => s.title));
    expect(root.querySelector('.nbg-section-watch .nbg-history canvas')).not.toBeNull(); // drawn from ["entries", i, "history"]
    expect(root.querySelector('.nbg-section-diagnoses .nbg-quote')!.textContent).toBe(
      raw.view.sections.find(s => s.kind === 'diagnoses')!.cards[0].quote
    );
    const env = root.querySelector('.nbg-section-environment')!;
    expect((env.querySelector('details.nbg-fold') as HTMLDetailsElement).open).toBe(false);
    expect(env.querySelector('.nbg-facts')!.textContent).toContain('Python');
  });

  it('shows an output saved before views existed as its title and a note to re-run', () => {
    const { view, ...old } = loadFixture('audit');
    expect(view).toBeDefined();
    const root = renderPayload(readPayload(old), { insertFix: null, trusted: true });
    expect(root.querySelector('.nbg-title')!.textContent).toBe(old.title);
    expect(root.querySelector('.nbg-note')!.textContent).toContain('re-run the cell');
    expect(root.querySelector('.nbg-card')).toBeNull();
  });

  it('never turns document text into markup', () => {
    const raw = loadFixture('audit');
    raw.view.title = '<img src=x onerror="window.pwned=1">';
    raw.view.sections.find(s => s.kind === 'findings')!.cards[0].lines = ['<script>window.pwned=1</script>'];
    const root = renderPayload(readPayload(raw), { insertFix: null, trusted: true });
    expect(root.querySelector('img')).toBeNull();
    expect(root.querySelector('script')).toBeNull();
    expect(root.querySelector('.nbg-title')!.textContent).toBe('<img src=x onerror="window.pwned=1">');
  });
});

function rgb(hex: string): string {
  const [r, g, b] = [1, 3, 5].map(i => parseInt(hex.slice(i, i + 2), 16));
  return `rgb(${r}, ${g}, ${b})`;
}
