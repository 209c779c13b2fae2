import { describe, expect, it } from 'vitest';

import { DocumentError, decodeNumber, formatNumber, parseDocument } from '../src/document';
import { sampleDocument } from './fixtures';

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
  it('spells non-finite values the way the kernel does', () => {
    expect(formatNumber(NaN)).toBe('nan');
    expect(formatNumber(Infinity)).toBe('inf');
    expect(formatNumber(-Infinity)).toBe('-inf');
    expect(formatNumber(null)).toBe('—');
  });

  it('keeps integers and shortens long floats', () => {
    expect(formatNumber(65504)).toBe('65504');
    expect(formatNumber(0.123456)).toBe('0.1235');
    expect(formatNumber(1e-6)).toBe('1.000e-6');
  });
});

describe('parseDocument', () => {
  it('decodes every numeric section of a v1 document', () => {
    const doc = parseDocument(sampleDocument());
    expect(doc.kind).toBe('audit');
    expect(doc.output_id).toBe('out-123');
    expect(doc.findings.map(f => f.rule)).toEqual(['trainable-low-precision', 'fp16-on-gemma3']);
    expect(doc.probe?.limit).toBe(65504);
    expect(doc.probe?.modules[0].absmax).toBe(Infinity);
    expect(doc.probe?.modules[0].input_absmax).toBeNull();
    expect(doc.probe?.modules[2].input_absmax).toBe(Infinity);
    expect(doc.events[0].origins[0].output_absmax).toBe(Infinity);
    expect(doc.events[0].origins[0].input_absmax).toBe(60000);
    const grad = doc.history!.grad_norm;
    expect(grad[0][2]).toBeNull();
    expect(grad[1][2]).toBe(Infinity);
    expect(grad[1][3]).toBeNaN();
    expect(grad[2][3]).toBe(-Infinity);
    expect(doc.history!.loss[3]).toBeNaN();
    expect(doc.history!.skipped_steps).toEqual([3]);
    expect(doc.fix_cells['use-bf16'].code).toContain('args.bf16 = True');
  });

  it('fills absent sections with empty values', () => {
    const doc = parseDocument({ schema_version: 1, kind: 'fix' });
    expect(doc.findings).toEqual([]);
    expect(doc.events).toEqual([]);
    expect(doc.history).toBeNull();
    expect(doc.watches).toEqual([]);
    expect(doc.fix_cells).toEqual({});
    expect(doc.output_id).toBeNull();
  });

  it('parses the reporting engineer\'s watches list', () => {
    const raw = sampleDocument();
    raw.watches = [{ title: 'run 1', events: raw.events, history: raw.history }];
    const doc = parseDocument(raw);
    expect(doc.watches).toHaveLength(1);
    expect(doc.watches[0].history!.grad_norm[1][3]).toBeNaN();
  });

  it('rejects other schema versions with a message naming the version', () => {
    expect(() => parseDocument({ schema_version: 2, kind: 'audit' })).toThrow(DocumentError);
    expect(() => parseDocument({ schema_version: 2 })).toThrow(/schema_version 2/);
    expect(() => parseDocument('text')).toThrow(/not a JSON object/);
    expect(() => parseDocument(null)).toThrow(DocumentError);
  });

  it('drops fix cells without code instead of rendering an empty cell', () => {
    const doc = parseDocument({ schema_version: 1, kind: 'audit', fix_cells: { a: { title: 'A' }, b: { code: 'x = 1' } } });
    expect(Object.keys(doc.fix_cells)).toEqual(['b']);
    expect(doc.fix_cells.b.title).toBe('b');
  });
});
