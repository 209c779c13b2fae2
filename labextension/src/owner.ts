/**
 * Which notebook cell owns an nbguard output: a pure search over cells and their outputs, so
 * the rule is testable without JupyterLab.
 *
 * A fix cell must land directly below the cell whose output shows the finding, not below
 * whichever cell happens to be active, so the lookup tries, in order: the output model
 * object itself (what a renderer was given), the document's "output_id" (what the kernel
 * sends over the comm), and DOM containment (the renderer's node inside the cell's node).
 */
import { MIME_TYPE, isObject } from './document';

export interface OutputLike {
  data?: unknown;
}

export interface CellLike {
  /** The cell's output models; empty for markdown and raw cells. */
  outputs: ArrayLike<OutputLike>;
  /** The cell's DOM node, when it has one. */
  node?: { contains(other: Node | null): boolean } | null;
}

export interface OwnerTarget {
  output?: unknown;
  outputId?: string | null;
  node?: Node | null;
}

export type MatchedBy = 'output' | 'output_id' | 'dom';

export interface OwnerMatch {
  index: number;
  by: MatchedBy;
}

/** The "output_id" of the nbguard document inside an output, if it carries one. */
export function outputIdOf(output: OutputLike | null | undefined): string | null {
  const data = output?.data;
  if (!isObject(data)) {
    return null;
  }
  const doc = data[MIME_TYPE];
  return isObject(doc) && typeof doc.output_id === 'string' ? doc.output_id : null;
}

export function findOwningCell(cells: ArrayLike<CellLike>, target: OwnerTarget): OwnerMatch | null {
  const n = cells.length;
  if (target.output) {
    for (let i = 0; i < n; i++) {
      const outputs = cells[i].outputs;
      for (let j = 0; j < outputs.length; j++) {
        if (outputs[j] === target.output) {
          return { index: i, by: 'output' };
        }
      }
    }
  }
  if (target.outputId) {
    for (let i = 0; i < n; i++) {
      const outputs = cells[i].outputs;
      for (let j = 0; j < outputs.length; j++) {
        if (outputIdOf(outputs[j]) === target.outputId) {
          return { index: i, by: 'output_id' };
        }
      }
    }
  }
  if (target.node) {
    for (let i = 0; i < n; i++) {
      const node = cells[i].node;
      if (node && node.contains(target.node)) {
        return { index: i, by: 'dom' };
      }
    }
  }
  return null;
}
