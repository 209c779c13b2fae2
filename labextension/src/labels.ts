/**
 * Row labels of a heatmap that fit a width and still tell the rows apart: the rule of
 * nbguard/render/labels.py, so the canvas and the static PNG name rows alike.
 *
 * A module path is read from the right: the leaf (`input_layernorm`) and the layer index
 * (`layers.0`) tell rows apart, the head before them (`model.language_model.`) does not. A label
 * too long loses its head (`…layers.0.input_layernorm`), with every label sharing that head, so
 * siblings read alike; never the index or the leaf. Two rows never get the same label: colliding
 * labels get more room until they differ, at worst their full names.
 */
export const ELLIPSIS = '…';

export function fitLabels(labels: string[], maxChars: number): string[] {
  let budget = Math.max(8, maxChars);
  const longest = labels.reduce((n, label) => Math.max(n, label.length), 0);
  const distinct = new Set(labels).size;
  let fitted = fitAll(labels, budget);
  while (new Set(fitted).size !== distinct && budget < longest) {
    budget += 4;
    fitted = fitAll(labels, budget);
  }
  return new Set(fitted).size === distinct ? fitted : [...labels];
}

function fitAll(labels: string[], budget: number): string[] {
  const split = labels.map(headAndTail);
  const cut = new Set(split.filter(([head], i) => head !== '' && labels[i].length > budget).map(([head]) => head));
  // a row too long is cut; so is each layer row beside it (same head); a short one-off like model.norm is not
  return labels.map((label, i) => {
    const [head, tail] = split[i];
    const cutHere = head !== '' && (label.length > budget || (cut.has(head) && tail.split('.').some(isIndex)));
    return cutHere ? ELLIPSIS + tail : label;
  });
}

/** [what a short label may drop, what it always keeps]: from the container of the last layer index, else the leaf. */
export function headAndTail(label: string): [string, string] {
  const parts = label.split('.');
  let keep = parts.length - 1;
  for (let i = parts.length - 1; i >= 0; i--) {
    if (isIndex(parts[i])) {
      keep = Math.max(0, i - 1); // "layers.0": an index needs its container's name to be read
      break;
    }
  }
  return [parts.slice(0, keep).join('.'), parts.slice(keep).join('.')];
}

function isIndex(part: string): boolean {
  const head = part.split(' ', 1)[0].replace(/–/g, '');
  return /^[0-9]+$/.test(head);
}
