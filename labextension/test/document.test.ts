import { describe, expect, it } from 'vitest';

import { DocumentError, InvalidDocumentError, decodeNumber, documentHeading, formatNumber, lookup, readPayload } from '../src/document';
import { loadFixture, numberSpellings } from './fixtures';

describe('decodeNumber', () => {
  it('decodes the strings nbguard writes for non-finite floats', () => {
    expect(decodeNumber('nan')).toBeNaN();
    expect(decodeNumber('inf')).toBe(Infinity);
    expect(decodeNumber('-inf')).toBe(-Infinity);
  });

  it('passes numbers through and maps missing values to null', () => {
    expect(decodeNumber(1.5)).toBe(1.5);
    expect(decodeNumber(0)).toBe(0);
    expect(decodeNumber(null)).toBeNull();
    expect(decodeNumber(undefined)).toBeNull();
    expect(decodeNumber('not a number')).toBeNull();
    expect(decodeNumber({})).toBeNull();
  });
});

describe('formatNumber', () => {
  it('spells every number of a real watch as view.py spells it', () => {
    const pairs = numberSpellings();
    expect(pairs.length).toBeGreaterThan(20);
    expect(pairs.some(([, spelled]) => spelled === 'NaN')).toBe(true);
    for (const [encoded, spelled] of pairs) {
      expect([encoded, formatNumber(decodeNumber(encoded))]).toEqual([encoded, spelled]);
    }
  });

  it('spells a missing value as the view does', () => {
    expect(formatNumber(null)).toBe('—');
    expect(formatNumber(-Infinity)).toBe('-Inf');
  });
});

describe('readPayload', () => {
  it('reads a real payload: the document and its view', () => {
    const raw = loadFixture('watch');
    const { doc, view } = readPayload(raw);
    expect(doc.kind).toBe('watch');
    expect(view!.sections.map(s => s.kind)).toContain('watch');
    expect(view!.palette.scale.length).toBeGreaterThan(1);
  });

  it('treats an output saved before views existed as one without a view', () => {
    const { view, ...old } = loadFixture('audit');
    expect(view).toBeDefined();
    expect(readPayload(old).view).toBeNull();
    // a view that is not a whole view is not guessed at: the payload fails the schema
    expect(() => readPayload({ ...old, view: { title: 'x' } })).toThrow(InvalidDocumentError);
    expect(() => readPayload({ ...old, view: { title: 'x' } })).toThrow(/\(view: missing "meta"\)/);
    expect(documentHeading(readPayload(old).doc)).toBe(old.title);
    expect(documentHeading({ schema_version: 1, kind: 'watch' })).toBe('nbguard watch');
  });

  it('rejects other schema versions with a message naming the version', () => {
    expect(() => readPayload({ schema_version: 2, kind: 'audit' })).toThrow(DocumentError);
    expect(() => readPayload({ schema_version: 2 })).toThrow(/schema_version 2/);
    expect(() => readPayload('text')).toThrow(/not a JSON object/);
    expect(() => readPayload(null)).toThrow(DocumentError);
  });
});

describe('lookup', () => {
  it('finds the part of the document a chart source names', () => {
    const raw = loadFixture('report');
    const watch = raw.view.sections.find(s => s.kind === 'watch')!;
    const heatmap = watch.charts.find(c => c.kind === 'heatmap')!;
    expect(heatmap.source[0]).toBe('entries');
    const history = lookup(raw, heatmap.source) as { groups: string[] };
    expect(history.groups.length).toBeGreaterThan(1);
  });

  it('answers undefined for a path that is not there', () => {
    const raw = loadFixture('watch');
    expect(lookup(raw, ['watches', 0, 'history'])).toBeUndefined();
    expect(lookup(raw, ['history', 'groups', 'x'])).toBeUndefined();
    expect(lookup(null, ['history'])).toBeUndefined();
  });
});
