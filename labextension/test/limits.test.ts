import { describe, expect, it } from 'vitest';

import { DocumentLimitError, readPayload } from '../src/document';
import { buildHeatmapModel } from '../src/heatmap';
import { MAX_DEPTH, MAX_GRID_CELLS, MAX_LIST, checkLimits } from '../src/limits';

/** The 94 KB saved watch of issue 40: 8000 groups x 8000 steps and no values. */
function bigWatch(groups = 8000, steps = 8000): Record<string, unknown> {
  return {
    schema_version: 1,
    kind: 'watch',
    history: {
      groups: Array.from({ length: groups }, (_, i) => `m.l${i}`),
      steps: Array.from({ length: steps }, (_, i) => i),
      grad_norm: []
    }
  };
}

function nested(depth: number): unknown {
  let node: unknown = 'x';
  for (let i = 0; i < depth; i++) {
    node = { a: node };
  }
  return node;
}

describe('document limits', () => {
  it('refuses a grid of more cells than MAX_GRID_CELLS, naming the limit', () => {
    const over = checkLimits(bigWatch());
    expect(over?.message).toContain('MAX_GRID_CELLS');
    expect(over?.message).toContain('8000 groups x 8000 steps');
    expect(() => readPayload(bigWatch())).toThrow(DocumentLimitError);
    expect(() => readPayload(bigWatch())).toThrow(/over nbguard's document limits.*MAX_GRID_CELLS/);
  });

  it('refuses nesting past MAX_DEPTH without exhausting the stack (100000 deep)', () => {
    expect(checkLimits({ evidence: nested(600) })?.message).toContain(`limit of ${MAX_DEPTH} levels`);
    expect(checkLimits({ evidence: nested(100_000) })?.message).toContain('MAX_DEPTH');
    expect(checkLimits({ evidence: nested(MAX_DEPTH - 2) })).toBeNull();
  });

  it('refuses a list longer than MAX_LIST', () => {
    expect(checkLimits({ files: new Array(MAX_LIST + 1).fill('f') })?.message).toContain('MAX_LIST');
  });

  it('passes a document within every limit', () => {
    expect(checkLimits(bigWatch(4096, 2048))).toBeNull();
    expect(4096 * 2048).toBeLessThanOrEqual(MAX_GRID_CELLS);
  });
});

describe('buildHeatmapModel is linear in the values it is given', () => {
  it('reads each row once, not once per cell (groups x steps of names, no values)', () => {
    const groups = Array.from({ length: 4000 }, (_, i) => `g${i}`);
    const steps = Array.from({ length: 2000 }, (_, i) => i);
    let reads = 0;
    const values = new Proxy([] as Array<Array<number | null>>, {
      get(target, key, receiver) {
        if (typeof key === 'string' && /^\d+$/.test(key)) {
          reads++;
        }
        return Reflect.get(target, key, receiver);
      }
    });
    const model = buildHeatmapModel({ groups, steps, values });
    expect(reads).toBeLessThanOrEqual(groups.length);
    expect(model.cells.length).toBe(96);
    expect(model.cells[0].length).toBe(400);
    expect(model.cells.every(row => row.every(c => c.kind === 'missing'))).toBe(true);
  });

  it('bins ragged rows as before: a NaN anywhere in a bin makes it a NaN bin, past a row is missing', () => {
    const values = [[1, 2, NaN, 4, 5, 6], [1, 2], [Infinity, 3, 3, 3, 3, 3, 3, 3]];
    const model = buildHeatmapModel(
      { groups: ['a', 'b', 'c'], steps: [0, 1, 2, 3, 4, 5, 6, 7], values },
      { maxColumns: 4, maxRows: 3 }
    );
    expect(model.cells.map(r => r.map(c => c.kind))).toEqual([
      ['finite', 'nan', 'finite', 'missing'],
      ['finite', 'missing', 'missing', 'missing'],
      ['inf', 'finite', 'finite', 'finite']
    ]);
    expect(model.cells[0][2].value).toBe(6);
    expect(model.nanCount).toBe(1);
    expect(model.infCount).toBe(1);
  });
});
