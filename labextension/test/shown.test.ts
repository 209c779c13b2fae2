/**
 * The confirmation shows exactly what is inserted (issue 31, part 2): a saved fix's cell is one
 * string, its line endings normalised, that the card shows, the confirmation shows and the notebook
 * receives; control characters are refused, bidirectional and zero-width ones marked and isolated;
 * no class name comes from data; code boxes wrap by the stylesheet too.
 */
import { readFileSync } from 'fs';
import { join } from 'path';
import { beforeEach, describe, expect, it, vi } from 'vitest';

import { confirmSavedFix } from '../src/confirm';
import { readPayload } from '../src/document';
import { createHeatmap } from '../src/heatmap';
import { renderCard, renderChart, renderFix, renderSection } from '../src/render';
import type { Card, FixView, Palette } from '../src/schema';
import { cellSource, escapeMarked, isPlainId, markedText } from '../src/text';
import { loadFixture } from './fixtures';

beforeEach(() => {
  vi.spyOn(HTMLCanvasElement.prototype, 'getContext').mockReturnValue(null);
  document.body.innerHTML = '';
});

function flush(): Promise<void> {
  return new Promise(resolve => setTimeout(resolve, 0));
}

const RLO = '\u202E';
const LRI = '\u2066';
const PDI = '\u2069';
const ZWSP = '\u200B';
// 10. a bare carriage return: one comment line in a browser, two lines in Python and CodeMirror
const CR_CODE = '# fixed: pad right\rimport os; os.system("echo pwned")';
// 11. the Trojan-source line: drawn as `access = "user" # admin only`, the comment is in the string
const BIDI_CODE = `access = "user${RLO} ${LRI}# admin only${PDI} ${LRI}"\nif access != "user":\n    grant()`;

/** The real audit's first fix card with its fix's code (and id) replaced: as a saved file may have it. */
function savedFix(code: string, id?: string) {
  const { view } = readPayload(loadFixture('audit'));
  const card = view!.sections.flatMap(s => s.cards).find(c => c.fixes.some(f => f.code))!;
  const fix = card.fixes.find(f => f.code)!;
  fix.code = code;
  if (id !== undefined) {
    fix.id = id;
  }
  return { card, fix, palette: view!.palette };
}

/** Click "Insert fix cell" of an untrusted card, confirm, and return [card's box, dialog's box, inserted]. */
async function insertThroughTheDialog(card: Card, fix: FixView, palette: Palette) {
  const insertFix = vi.fn().mockResolvedValue(undefined);
  const node = renderCard(card, 'findings', palette, { insertFix, trusted: false });
  document.body.appendChild(node);
  const box = node.querySelector(`.nbg-fix[data-fix="${fix.id}"]`)!;
  (box.querySelector('button.nbg-insert') as HTMLButtonElement).click();
  await flush();
  const dialog = document.querySelector('.nbg-confirm')!;
  const shown = dialog.querySelector('pre')! as HTMLElement;
  const shownText = shown.textContent;
  const marks = [...shown.querySelectorAll('.nbg-mark')] as HTMLElement[];
  (dialog.querySelector('.nbg-confirm-insert') as HTMLButtonElement).click();
  await flush();
  expect(insertFix).toHaveBeenCalledTimes(1);
  const [inserted, run] = insertFix.mock.calls[0];
  expect(run).toBe(false);
  return { cardText: box.querySelector('pre.nbg-code')!.textContent, shownText, marks, inserted: inserted as string };
}

describe('10. line endings: what is inserted is what is shown', () => {
  it('a bare \\r is a line break in the card, the dialog and the inserted cell alike', async () => {
    const { card, fix, palette } = savedFix(CR_CODE);
    const { cardText, shownText, inserted } = await insertThroughTheDialog(card, fix, palette);
    const expected = '# fixed: pad right\nimport os; os.system("echo pwned")';
    expect(inserted).toBe(expected);
    expect(shownText).toBe(inserted); // the inserted cell's source is the shown string
    expect(cardText).toBe(inserted);
    expect(shownText!.split('\n')).toHaveLength(2); // the hidden statement is a line of its own
    expect(inserted).not.toContain('\r');
  });

  it('\\r\\n becomes one \\n, not two lines', () => {
    expect(cellSource('a = 1\r\nb = 2\rc = 3\n')).toEqual({ ok: true, source: 'a = 1\nb = 2\nc = 3\n' });
  });

  it('a cell holding another control character is refused: shown marked, no button, never inserted', () => {
    for (const [code, point] of [
      ['x = 1\u000Bimport os', 'U+000B'],
      ['x = 1\u000Cimport os', 'U+000C'],
      ['x = 1\u2028import os', 'U+2028'],
      ['x = "\u0000"', 'U+0000'],
      ['x = 1\u0085import os', 'U+0085']
    ]) {
      const { card, fix, palette } = savedFix(code);
      const insertFix = vi.fn();
      const node = renderCard(card, 'findings', palette, { insertFix, trusted: true });
      const box = node.querySelector(`.nbg-fix[data-fix="${fix.id}"]`)!;
      expect(box.querySelectorAll('button')).toHaveLength(0);
      expect(box.querySelector('.nbg-fix-refused')!.textContent).toContain(point);
      const pre = box.querySelector('pre.nbg-code')!;
      expect(pre.textContent).toBe(code);
      expect((pre.querySelector('.nbg-mark') as HTMLElement).dataset.mark).toBe(point);
    }
    expect(cellSource('a\tb\n')).toEqual({ ok: true, source: 'a\tb\n' }); // tab and newline are code
  });
});

describe('11. bidirectional and zero-width characters', () => {
  it('are marked and isolated in the code the dialog shows, and the shown string is what is inserted', async () => {
    const code = `${BIDI_CODE}\nos${ZWSP}.system("x")`;
    const { card, fix, palette } = savedFix(code);
    const { shownText, marks, inserted } = await insertThroughTheDialog(card, fix, palette);
    expect(inserted).toBe(code);
    expect(shownText).toBe(inserted);
    expect(marks.map(m => m.dataset.mark)).toEqual(['U+202E', 'U+2066', 'U+2069', 'U+2066', 'U+200B']);
    expect(marks.map(m => m.textContent)).toEqual([RLO, LRI, PDI, LRI, ZWSP]);
    expect(marks[0].title).toBe('U+202E RIGHT-TO-LEFT OVERRIDE');
    for (const mark of marks) {
      expect(mark.style.unicodeBidi).toBe('isolate'); // inline: the override ends with its span
    }
  });

  it('are marked wherever a saved string is shown: titles, lines, tables', () => {
    const { card, palette } = savedFix('x = 1');
    card.title = `safe${RLO}txt.exe`;
    card.lines = [`line${ZWSP}`];
    const node = renderCard(card, 'findings', palette, { insertFix: null, trusted: false });
    const title = node.querySelector('.nbg-card-title')!;
    expect(title.textContent).toBe(`safe${RLO}txt.exe`);
    expect((title.querySelector('.nbg-mark') as HTMLElement).dataset.mark).toBe('U+202E');
    expect((node.querySelector('.nbg-detail .nbg-mark') as HTMLElement).dataset.mark).toBe('U+200B');
  });

  it('are marked in a heatmap\'s title too', () => {
    const { view } = readPayload(loadFixture('audit'));
    const map = createHeatmap(`grad${RLO} norm`, { groups: ['a'], steps: [0], values: [[1]], skippedSteps: [], limit: null },
      'grad norm', view!.palette);
    const title = map.querySelector('.nbg-heatmap-title')!;
    expect(title.textContent!.startsWith(`grad${RLO} norm`)).toBe(true);
    expect((title.querySelector('.nbg-mark') as HTMLElement).dataset.mark).toBe('U+202E');
  });

  it('the warning sentence keeps its order whatever the id holds: the id is its own isolated element', async () => {
    const answer = confirmSavedFix({ id: `evil${RLO}fix`, code: 'x = 1' });
    const note = document.querySelector('.nbg-confirm-note')!;
    const id = note.querySelector('code.nbg-confirm-id') as HTMLElement;
    expect(id.textContent).toBe(`evil${RLO}fix`);
    expect(id.style.unicodeBidi).toBe('isolate');
    expect(id.dir).toBe('ltr');
    expect((id.querySelector('.nbg-mark') as HTMLElement).dataset.mark).toBe('U+202E');
    // no text node of the sentence holds the override: it cannot reorder the words after it
    const texts: string[] = [];
    const walker = document.createTreeWalker(note, NodeFilter.SHOW_TEXT);
    for (let n = walker.nextNode(); n; n = walker.nextNode()) {
      if (!(n.parentElement as HTMLElement).classList.contains('nbg-mark')) {
        texts.push(n.textContent!);
      }
    }
    expect(texts.join('')).not.toMatch(/[\u202A-\u202E\u2066-\u2069]/);
    (document.querySelector('.nbg-confirm-cancel') as HTMLButtonElement).click();
    expect(await answer).toBe(false);
  });

  it('ids are plain words; messages can spell marked characters', () => {
    expect(isPlainId('switch-precision')).toBe(true);
    for (const id of [`a${RLO}b`, `a${ZWSP}b`, 'a b', 'a\rb', '', `a${LRI}`, 'a\u{E0041}']) {
      expect(isPlainId(id)).toBe(false);
    }
    expect(escapeMarked(`a${RLO}b`)).toBe('a<U+202E>b');
    expect(markedText(`a${RLO}b\rc`).textContent).toBe(`a${RLO}b\rc`);
  });
});

describe('13. classes come from fixed tables, never from data', () => {
  // Past the schema check (a caller that skipped it): the renderer still draws no class of the data's.
  const OVERLAY = 'error nbg-confirm-overlay';

  function classesIn(node: Element): string[] {
    return [node, ...node.querySelectorAll('*')].flatMap(e => [...e.classList]);
  }

  it('card tone, fold kind, verdict status, section kind, fact tone and chart kind', () => {
    const { view, doc } = readPayload(loadFixture('audit'));
    const section = view!.sections.find(s => s.cards.some(c => c.fixes.some(f => f.code) && c.folds.length))!;
    const card = section.cards.find(c => c.fixes.some(f => f.code) && c.folds.length)!;
    const context = { insertFix: null, trusted: false };
    Object.assign(card, { tone: OVERLAY });
    Object.assign(card.folds[0], { kind: OVERLAY });
    Object.assign(card.fixes[0], { verdict: { status: OVERLAY, label: 'verified', detail: '' } });
    Object.assign(section, { kind: OVERLAY, facts: [{ text: 'a fact', tone: OVERLAY }] });
    const drawn = [
      renderCard(card, 'findings', view!.palette, context),
      renderFix(card.fixes[0], view!.palette, context),
      renderSection(section, doc, view!.palette, context),
      renderChart({ kind: OVERLAY as any, alt: 'chart', source: [], empty: 'nothing' }, doc, view!.palette)
    ];
    for (const node of drawn) {
      const names = classesIn(node);
      expect(names).not.toContain('nbg-confirm-overlay');
      expect(names.filter(n => n.includes(OVERLAY.split(' ')[0]) && n !== 'nbg-error-text')).toEqual([]);
    }
    expect(drawn[0].className).toBe('nbg-card');
    expect(drawn[2].className).toBe('nbg-section');
    expect(drawn[3].className).toBe('nbg-chart');
  });

  it('the known values still get their classes', () => {
    const { card, palette } = savedFix('x = 1');
    card.tone = 'warning';
    const node = renderCard(card, 'findings', palette, { insertFix: null, trusted: true });
    expect(node.className).toBe('nbg-card nbg-tone-warning');
  });
});

describe('the stylesheet wraps code boxes', () => {
  const css = readFileSync(join(__dirname, '..', 'style', 'index.css'), 'utf8').replace(/\/\*[\s\S]*?\*\//g, '');
  const rules = [...css.matchAll(/([^{}]+)\{([^}]*)\}/g)].map(m => ({ selector: m[1].trim(), body: m[2] }));

  it('every rule for .nbg-code ends with white-space: pre-wrap, and scrolls nothing sideways', () => {
    const code = rules.filter(r => /\.nbg-code\b/.test(r.selector));
    expect(code.length).toBeGreaterThan(0);
    for (const rule of code) {
      const spaces = [...rule.body.matchAll(/white-space\s*:\s*([\w-]+)/g)].map(m => m[1]);
      if (spaces.length) {
        expect([rule.selector, spaces[spaces.length - 1]]).toEqual([rule.selector, 'pre-wrap']);
      }
      expect(rule.body).not.toMatch(/overflow-x\s*:\s*(auto|scroll)/);
    }
    expect(code.some(r => /white-space\s*:\s*pre-wrap/.test(r.body))).toBe(true);
  });

  it('a mark is isolated and drawn as its code point', () => {
    const mark = rules.find(r => r.selector === '.nbg-mark')!;
    expect(mark.body).toMatch(/unicode-bidi\s*:\s*isolate/);
    expect(rules.find(r => r.selector === '.nbg-mark::before')!.body).toMatch(/content\s*:\s*attr\(data-mark\)/);
  });
});
