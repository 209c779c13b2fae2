/**
 * The payloads real nbguard runs display (document + view), written to test/fixtures/*.json by
 * labextension/scripts/make_fixtures.py from planted faults on tiny models (`make
 * test-labextension` runs it first). Hand-made inputs live in the tests that need malformed data.
 */
import { existsSync, readFileSync, readdirSync } from 'fs';
import { join } from 'path';

import type { NbguardDocument, View } from '../src/schema';

const DIR = join(__dirname, 'fixtures');
const HOW = 'generate them with `PYTHONPATH=$PWD python labextension/scripts/make_fixtures.py` from the repository root (make test-labextension does)';

export type FixturePayload = NbguardDocument & { view: View };

/** The names of the generated document fixtures (audit, probe, watch, diagnosis, healthy, report). */
export function fixtureNames(): string[] {
  if (!existsSync(DIR)) {
    throw new Error(`no fixtures in ${DIR}: ${HOW}`);
  }
  return readdirSync(DIR)
    .filter(name => name.endsWith('.json') && name !== 'numbers.json')
    .map(name => name.slice(0, -'.json'.length))
    .sort();
}

/** A fresh copy of one generated payload (tests may change it). */
export function loadFixture(name: string): FixturePayload {
  return readJson(`${name}.json`) as FixturePayload;
}

/** [encoded number, how nbguard's view.py spells it] pairs from the real watch. */
export function numberSpellings(): Array<[unknown, string]> {
  return readJson('numbers.json') as Array<[unknown, string]>;
}

function readJson(file: string): unknown {
  const path = join(DIR, file);
  if (!existsSync(path)) {
    throw new Error(`missing fixture ${path}: ${HOW}`);
  }
  return JSON.parse(readFileSync(path, 'utf8'));
}

/** Every string a reader is shown from a view: the TypeScript twin of tests/view_helpers.py's view_strings. */
export function viewStrings(view: View): string[] {
  const out: string[] = [view.title, view.meta, view.summary];
  const table = (t: View['sections'][number]['table']) => {
    if (t) {
      out.push(...t.columns, ...t.rows.flat(), t.note);
    }
  };
  for (const section of view.sections) {
    out.push(section.title, section.empty, section.cards_title, ...section.notes);
    out.push(...section.facts.map(f => f.text));
    table(section.table);
    for (const chart of section.charts) {
      out.push(chart.alt, chart.empty);
    }
    for (const card of section.cards) {
      out.push(card.title, card.badge, card.tag, card.quote, card.code, ...card.lines);
      table(card.table);
      for (const fold of card.folds) {
        out.push(fold.label, fold.text);
      }
      for (const fix of card.fixes) {
        out.push(fix.id, fix.title, fix.code);
        if (fix.verdict) {
          out.push(fix.verdict.label, fix.verdict.detail);
        }
      }
    }
  }
  return out.filter(s => s);
}
