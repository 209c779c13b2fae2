import { describe, expect, it } from 'vitest';

import { MIME_TYPE } from '../src/document';
import { CellLike, findOwningCell, outputIdOf } from '../src/owner';

function nbguardOutput(outputId: string) {
  return { data: { 'text/plain': 'AuditResult', [MIME_TYPE]: { schema_version: 1, kind: 'audit', output_id: outputId } } };
}

describe('findOwningCell', () => {
  const stream = { data: { 'text/plain': 'hello' } };
  const audit = nbguardOutput('audit-1');
  const watch = nbguardOutput('watch-2');
  const cells: CellLike[] = [
    { outputs: [] }, // markdown
    { outputs: [stream] },
    { outputs: [stream, audit] },
    { outputs: [] }, // a later, possibly active, cell
    { outputs: [watch] }
  ];

  it('finds the cell holding the very output model a renderer was given', () => {
    expect(findOwningCell(cells, { output: audit })).toEqual({ index: 2, by: 'output' });
    expect(findOwningCell(cells, { output: watch })).toEqual({ index: 4, by: 'output' });
  });

  it('finds the cell by the document output_id the kernel sends', () => {
    expect(findOwningCell(cells, { outputId: 'watch-2' })).toEqual({ index: 4, by: 'output_id' });
    expect(findOwningCell(cells, { outputId: 'nope' })).toBeNull();
  });

  it('prefers the model identity over an output_id shared by an older copy', () => {
    const stale = nbguardOutput('audit-1');
    const withCopy: CellLike[] = [{ outputs: [stale] }, { outputs: [audit] }];
    expect(findOwningCell(withCopy, { output: audit, outputId: 'audit-1' })).toEqual({ index: 1, by: 'output' });
  });

  it('falls back to DOM containment when the model was replaced', () => {
    const inner = document.createElement('div');
    const cellNode = document.createElement('div');
    cellNode.appendChild(inner);
    const withNodes: CellLike[] = [
      { outputs: [], node: document.createElement('div') },
      { outputs: [], node: cellNode }
    ];
    expect(findOwningCell(withNodes, { output: {}, node: inner })).toEqual({ index: 1, by: 'dom' });
  });

  it('returns null rather than guessing', () => {
    expect(findOwningCell(cells, {})).toBeNull();
    expect(findOwningCell([], { output: audit, outputId: 'audit-1' })).toBeNull();
  });
});

describe('outputIdOf', () => {
  it('reads the output_id of an nbguard document only', () => {
    expect(outputIdOf(nbguardOutput('x'))).toBe('x');
    expect(outputIdOf({ data: { 'text/plain': 'x' } })).toBeNull();
    expect(outputIdOf({ data: { [MIME_TYPE]: { output_id: 3 } } })).toBeNull();
    expect(outputIdOf(null)).toBeNull();
  });
});
