/**
 * The limits of an nbguard document, mirrored from nbguard/document/codec.py (the one definition;
 * tests/test_document_limits.py compares the two). A saved payload over one of them is refused
 * before the schema walk or any renderer sees it: a few kilobytes of group and step names must not
 * ask the heatmap for billions of cells, and nesting must not exhaust the stack of a recursive walk.
 *
 * `checkLimits` is one iterative pass over the payload, linear in its size.
 */
export const MAX_DEPTH = 64;
export const MAX_LIST = 100_000;
export const MAX_GRID_CELLS = 8_388_608;
export const MAX_DOCUMENT_BYTES = 67_108_864;

/** What limit a payload breaks, and where; the message names the limit as codec.py does. */
export interface OverLimit {
  path: string;
  message: string;
}

function where(path: Array<string | number>): string {
  return (
    path
      .slice(0, 12)
      .map(p => (typeof p === 'number' ? `[${p}]` : `.${p}`))
      .join('') || 'the document'
  );
}

/** The first limit `value` (parsed JSON) breaks, or null. Bytes are estimated from the data itself:
 * string lengths plus a few bytes per number, key and bracket (the JSON text is at least that long). */
export function checkLimits(value: unknown): OverLimit | null {
  const stack: Array<[unknown, number, Array<string | number>]> = [[value, 1, []]];
  let bytes = 0;
  while (stack.length) {
    const [node, depth, path] = stack.pop()!;
    if (typeof node === 'string') {
      bytes += node.length + 2;
    } else if (node === null || typeof node !== 'object') {
      bytes += 4;
    } else {
      if (depth > MAX_DEPTH) {
        return {
          path: where(path),
          message: `the nbguard document is nested deeper than the limit of ${MAX_DEPTH} levels (MAX_DEPTH)`
        };
      }
      if (Array.isArray(node)) {
        if (node.length > MAX_LIST) {
          return {
            path: where(path),
            message: `a list of the nbguard document holds ${node.length} items, over the limit of ${MAX_LIST} (MAX_LIST)`
          };
        }
        bytes += 2 + node.length;
        for (let i = 0; i < node.length; i++) {
          stack.push([node[i], depth + 1, [...path, i]]);
        }
      } else {
        const obj = node as Record<string, unknown>;
        const { groups, steps } = obj;
        if (Array.isArray(groups) && Array.isArray(steps) && groups.length * steps.length > MAX_GRID_CELLS) {
          return {
            path: where(path),
            message:
              `a history of the nbguard document is ${groups.length} groups x ${steps.length} steps = ` +
              `${groups.length * steps.length} cells, over the limit of ${MAX_GRID_CELLS} cells (MAX_GRID_CELLS)`
          };
        }
        bytes += 2;
        for (const key of Object.keys(obj)) {
          bytes += key.length + 4;
          stack.push([obj[key], depth + 1, [...path, key]]);
        }
      }
    }
    if (bytes > MAX_DOCUMENT_BYTES) {
      return {
        path: where(path),
        message: `the nbguard document is over the limit of ${MAX_DOCUMENT_BYTES} bytes (MAX_DOCUMENT_BYTES)`
      };
    }
  }
  return null;
}
