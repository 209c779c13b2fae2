/**
 * A saved payload is checked against nbguard/document/schema.json before anything renders it
 * (issue 31: a saved output picked its own CSS classes, saved code as a JSON array, put a
 * right-to-left override in a fix id). Each hostile payload below is a real fixture with one field
 * changed; each must fail with the path of that field, and draw only an inert notice.
 */
import { readFileSync } from 'fs';
import { join } from 'path';
import { beforeEach, describe, expect, it, vi } from 'vitest';

import { InvalidDocumentError, MIME_TYPE, readPayload } from '../src/document';
import { DOCUMENT_SCHEMA } from '../src/documentSchema';
import { SchemaValidator, validateDocument } from '../src/validate';
import { NbguardRenderer } from '../src/widget';
import { FixturePayload, fixtureNames, loadFixture } from './fixtures';

beforeEach(() => {
  vi.spyOn(HTMLCanvasElement.prototype, 'getContext').mockReturnValue(null);
  document.body.innerHTML = '';
});

/** [section index, card index, fix index] of the first fix with code in a fixture's view. */
function firstFix(raw: FixturePayload): [number, number, number] {
  for (const [s, section] of raw.view.sections.entries()) {
    for (const [c, card] of section.cards.entries()) {
      const f = card.fixes.findIndex(fix => fix.code);
      if (f >= 0) {
        return [s, c, f];
      }
    }
  }
  throw new Error('no fix with code');
}

function firstIndex<T>(items: T[], test: (item: T) => boolean): number {
  const i = items.findIndex(test);
  expect(i).toBeGreaterThanOrEqual(0);
  return i;
}

const OVERLAY = 'error nbg-confirm-overlay';

/** [what, fixture, change it, the path the failure must name]: one hostile field each. */
const HOSTILE: Array<[string, string, (raw: any) => void, RegExp]> = [
  // 13. classes chosen by the data
  ['card.tone', 'audit', raw => (raw.view.sections[firstFix(raw)[0]].cards[firstFix(raw)[1]].tone = OVERLAY),
    /^view\.sections\[\d+\]\.cards\[\d+\]\.tone$/],
  ['fold.kind', 'audit', raw => {
    const [s, c] = firstFix(raw);
    raw.view.sections[s].cards[c].folds[0].kind = 'json nbg-confirm-overlay';
  }, /^view\.sections\[\d+\]\.cards\[\d+\]\.folds\[0\]\.kind$/],
  ['verdict.status', 'audit', raw => {
    const [s, c, f] = firstFix(raw);
    raw.view.sections[s].cards[c].fixes[f].verdict = { status: 'verified nbg-confirm-overlay', label: 'verified', detail: '' };
  }, /^view\.sections\[\d+\]\.cards\[\d+\]\.fixes\[\d+\]\.verdict\.status$/],
  ['section.kind', 'audit', raw => (raw.view.sections[0].kind = 'findings nbg-confirm-overlay'), /^view\.sections\[0\]\.kind$/],
  ['fact.tone', 'watch', raw => {
    const s = firstIndex(raw.view.sections, (x: any) => x.facts.length > 0);
    raw.view.sections[s].facts[0].tone = 'bad nbg-confirm-overlay';
  }, /^view\.sections\[\d+\]\.facts\[0\]\.tone$/],
  ['chart.kind', 'watch', raw => {
    const s = firstIndex(raw.view.sections, (x: any) => x.charts.length > 0);
    raw.view.sections[s].charts[0].kind = 'heatmap nbg-confirm-overlay';
  }, /^view\.sections\[\d+\]\.charts\[0\]\.kind$/],
  // 12. code saved as a JSON array (shown joined with commas, inserted joined with nothing)
  ['fix code as an array', 'audit', raw => {
    const [s, c, f] = firstFix(raw);
    raw.view.sections[s].cards[c].fixes[f].code = ['# fixed', 'import os; os.system("x")'];
  }, /^view\.sections\[\d+\]\.cards\[\d+\]\.fixes\[\d+\]\.code$/],
  ['fix_cells code as an array', 'audit', raw => {
    const id = Object.keys(raw.fix_cells)[0];
    raw.fix_cells[id].code = ['import os', 'os.system("x")'];
  }, /^fix_cells(\.\w+|\["[^"]+"\])\.code$/],
  // 11. a right-to-left override in a fix id garbles the confirmation's sentence
  ['a bidi control in a fix id', 'audit', raw => {
    const [s, c, f] = firstFix(raw);
    raw.view.sections[s].cards[c].fixes[f].id = 'switch\u202Eprecision';
  }, /^view\.sections\[\d+\]\.cards\[\d+\]\.fixes\[\d+\]\.id$/],
  ['a zero-width space in a fix id', 'audit', raw => {
    const [s, c, f] = firstFix(raw);
    raw.view.sections[s].cards[c].fixes[f].id = 'switch\u200Bprecision';
  }, /\.fixes\[\d+\]\.id$/],
  // strings are strings, closed objects are closed, required fields are there
  ['a number for a title', 'audit', raw => (raw.view.title = 42), /^view\.title$/],
  ['an object for a note', 'report', raw => (raw.notes = [{ toString: 'x' }]), /^notes\[0\]$/],
  ['a field the card does not define', 'audit', raw => (raw.view.sections[firstFix(raw)[0]].cards[0].className = 'x'),
    /^view\.sections\[\d+\]\.cards\[0\]\.className$/],
  ['"__proto__" in a card', 'audit', raw => {
    const [s] = firstFix(raw);
    raw.view.sections[s].cards[0] = JSON.parse(JSON.stringify(raw.view.sections[s].cards[0]).replace('{', '{"__proto__":{"tone":"x"},'));
  }, /\.cards\[0\]\.__proto__$/],
  ['"constructor" in a card', 'audit', raw => (raw.view.sections[firstFix(raw)[0]].cards[0].constructor = 'x'),
    /\.cards\[0\]\.constructor$/],
  ['a missing card title', 'audit', raw => delete raw.view.sections[firstFix(raw)[0]].cards[0].title,
    /^view\.sections\[\d+\]\.cards\[0\]$/],
  ['a palette colour that is not #rrggbb', 'audit', raw => (raw.view.palette.severity.error = 'red; background: url(x)'),
    /^view\.palette\.severity\.error$/],
  ['a string step in the history', 'watch', raw => (raw.history.steps[0] = '0'), /^history\.steps\[0\]$/],
  ['a document kind outside the enumeration', 'audit', raw => (raw.kind = 'audit nbg-confirm-overlay'), /^kind$/]
];

describe('every real payload follows the schema', () => {
  it.each(fixtureNames())('%s', name => {
    expect(validateDocument(loadFixture(name))).toBeNull();
  });

  it('the validator walks the very schema file the types are generated from', () => {
    const file = JSON.parse(readFileSync(join(__dirname, '..', '..', 'nbguard', 'document', 'schema.json'), 'utf8'));
    expect(DOCUMENT_SCHEMA).toEqual(file);
  });

  it('unknown top-level keys are ignored, as the schema says', () => {
    expect(validateDocument({ ...loadFixture('audit'), added_later: { anything: [1, 'x'] } })).toBeNull();
  });

  it('an event kind is any registered kind (detectors add their own), but a plain lower-case name', () => {
    const raw: any = loadFixture('watch');
    expect(raw.events.length).toBeGreaterThan(0);
    raw.events[0].kind = 'my-detector-kind';
    expect(validateDocument(raw)).toBeNull();
    raw.events[0].kind = 'Not A Kind';
    expect(validateDocument(raw)!.path).toBe('events[0].kind');
    raw.events[0].kind = 'grad\u202Espike';
    expect(validateDocument(raw)!.path).toBe('events[0].kind');
  });
});

describe('a hostile saved payload is refused, field by field', () => {
  it.each(HOSTILE)('%s', async (_what, fixture, change, path) => {
    const raw = loadFixture(fixture);
    change(raw);
    const invalid = validateDocument(raw);
    expect(invalid).not.toBeNull();
    expect(invalid!.path).toMatch(path);
    expect(() => readPayload(raw)).toThrow(InvalidDocumentError);

    // what the Lab draws: one inert notice naming the field, nothing of the payload
    const inserter = vi.fn();
    const renderer = new NbguardRenderer(() => inserter);
    await renderer.renderModel({ data: { [MIME_TYPE]: raw }, metadata: {}, trusted: false, setData: () => undefined } as any);
    const notice = renderer.node.querySelector('.nbg-invalid') as HTMLElement;
    expect(notice).not.toBeNull();
    expect(notice.textContent).toContain(`(${invalid!.path}: ${invalid!.message})`);
    expect(renderer.node.querySelectorAll('button, pre, .nbg-report, .nbg-card, [style]').length).toBe(0);
    expect(renderer.node.querySelector('.nbg-confirm-overlay')).toBeNull();
    expect(renderer.node.textContent).not.toContain('nbg-confirm-overlay'); // the value is never quoted
    expect(document.querySelector('.nbg-confirm-overlay')).toBeNull();
    expect(inserter).not.toHaveBeenCalled();
  });

  it('a hostile key is escaped in the notice: it cannot garble the sentence', () => {
    const raw: any = loadFixture('audit');
    raw.view['x\u202Ey'] = 1;
    const invalid = validateDocument(raw)!;
    expect(invalid.path).toBe('view["x\\u202ey"]');
    expect(invalid.message).toBe('is not a field of this object');
  });
});

describe('the schema walker', () => {
  it('fails loudly on a keyword it does not know, rather than letting data through', () => {
    expect(() => new SchemaValidator({ type: 'string', format: 'email' }).validate('x')).toThrow(/unsupported keyword "format"/);
  });

  it('checks const, enum, oneOf, type lists, pattern, minimum, minItems, maxItems and closed objects', () => {
    const v = new SchemaValidator({
      type: 'object',
      required: ['a'],
      additionalProperties: false,
      properties: {
        a: { const: 1 },
        b: { enum: ['x', 'y'] },
        c: { oneOf: [{ type: 'null' }, { type: 'array', items: { type: 'integer', minimum: 0 }, minItems: 2, maxItems: 2 }] },
        d: { type: ['string', 'null'], pattern: '^#[0-9a-f]{6}$' }
      }
    });
    expect(v.validate({ a: 1, b: 'x', c: [0, 3], d: '#00ff00' })).toBeNull();
    expect(v.validate({ a: 1, c: null, d: null })).toBeNull();
    expect(v.validate({ a: 2 })!.message).toBe('expected 1');
    expect(v.validate({ a: 1, b: 'z' })!.message).toBe('expected one of "x", "y"');
    expect(v.validate({ a: 1, c: [0] })!.path).toBe('c');
    expect(v.validate({ a: 1, c: [0, -1] })!.path).toBe('c[1]');
    expect(v.validate({ a: 1, c: [0, 1.5] })!.message).toBe('expected an integer');
    expect(v.validate({ a: 1, d: '#00FF00;x' })!.path).toBe('d');
    expect(v.validate({ a: 1, d: 3 })!.message).toBe('expected a string or null');
    expect(v.validate({ a: 1, e: 1 })!.path).toBe('e');
    expect(v.validate({})!.message).toBe('missing "a"');
    expect(v.validate([])!.message).toBe('expected an object');
  });
});
