/**
 * The payload the kernel displays under `application/vnd.nbguard.v1+json`: the v1 document plus
 * its `view` (nbguard/document/view.py), the presentation model this extension lays out. Their
 * types are generated from nbguard/document/schema.json (src/schema.ts); this module checks a
 * payload against that same schema before anything renders it (src/validate.ts), finds the part of
 * the document a chart draws, and decodes grid numbers.
 *
 * JSON has no NaN or Infinity, so the kernel writes non-finite floats as "nan", "inf" and "-inf";
 * the view spells every number already, so decoding is needed for the heatmap cells only.
 */
import type { EncodedNumberOrNull, NbguardDocument, View } from './schema';
import { safePalette } from './safety';
import { checkLimits } from './limits';
import { validateDocument } from './validate';

export const MIME_TYPE = 'application/vnd.nbguard.v1+json';
export const SCHEMA_VERSION = 1;

/** A decoded number: finite, NaN, +/-Infinity, or null when the kernel had no value. */
export type Num = number | null;

/** Raised for a payload this extension cannot read; the renderer shows its message. */
export class DocumentError extends Error {}

/** A payload that does not follow the schema: shown as a notice, never rendered in part. */
export class InvalidDocumentError extends DocumentError {
  constructor(
    readonly path: string,
    readonly reason: string
  ) {
    super(
      `nbguard: this output does not follow nbguard's document schema v${SCHEMA_VERSION}, so it is not shown ` +
        `(${path}: ${reason}). A saved output can be edited by anyone; re-run the cell to see this kernel's own.`
    );
  }
}

/** A payload over the document limits (src/limits.ts, mirrored from nbguard/document/codec.py): refused whole. */
export class DocumentLimitError extends DocumentError {
  constructor(
    readonly path: string,
    readonly reason: string
  ) {
    super(`nbguard: this output is over nbguard's document limits, so it is not shown (${path}: ${reason}).`);
  }
}

/** A displayed payload: the document, and its view (null in outputs saved by an older nbguard). */
export interface Payload {
  doc: NbguardDocument;
  view: View | null;
}

/**
 * Check a raw payload against the v1 schema, view included; throws DocumentError when it is not an
 * nbguard v1 document, InvalidDocumentError when any field breaks the schema (a string that is not
 * a string, a tone outside its enumeration, a colour that is not #rrggbb, a key the view does not
 * define...). What it returns has the types of src/schema.ts because it was checked against them.
 */
export function readPayload(raw: unknown): Payload {
  if (!isObject(raw)) {
    throw new DocumentError('nbguard: the payload is not a JSON object');
  }
  if (raw.schema_version !== SCHEMA_VERSION) {
    throw new DocumentError(
      `nbguard: unsupported schema_version ${JSON.stringify(raw.schema_version)}; ` +
        `this extension reads version ${SCHEMA_VERSION} (update the nbguard package or extension)`
    );
  }
  // the limits first (one iterative pass): the schema walk and the heatmap come after, within them
  const over = checkLimits(raw);
  if (over) {
    throw new DocumentLimitError(over.path, over.message);
  }
  const invalid = validateDocument(raw);
  if (invalid) {
    throw new InvalidDocumentError(invalid.path, invalid.message);
  }
  const doc = raw as unknown as NbguardDocument;
  const saved = doc.view;
  // the palette reaches element styles: rebuilt from checked colours once more (safety.ts)
  const view = saved ? { ...saved, palette: safePalette(saved.palette) } : null;
  return { doc, view };
}

/** The heading of a document without a view: its own title, else its kind (as view.py's heading()). */
export function documentHeading(doc: NbguardDocument): string {
  return typeof doc.title === 'string' && doc.title ? doc.title : `nbguard ${String(doc.kind ?? 'document')}`;
}

/** The part of `doc` a chart's `source` path names, or undefined when it is not there. */
export function lookup(doc: unknown, path: Array<string | number>): unknown {
  let node: unknown = doc;
  for (const key of path) {
    if (Array.isArray(node) && typeof key === 'number') {
      node = node[key];
    } else if (isObject(node) && typeof key === 'string') {
      node = node[key];
    } else {
      return undefined;
    }
  }
  return node;
}

/** Decode one JSON number as nbguard writes it ("nan", "inf", "-inf" for non-finite). */
export function decodeNumber(value: EncodedNumberOrNull | unknown): Num {
  if (value === null || value === undefined) {
    return null;
  }
  if (typeof value === 'number') {
    return value;
  }
  if (typeof value === 'string') {
    const text = value.trim().toLowerCase();
    if (text === 'nan') {
      return NaN;
    }
    if (text === 'inf' || text === '+inf' || text === 'infinity') {
      return Infinity;
    }
    if (text === '-inf' || text === '-infinity') {
      return -Infinity;
    }
    const parsed = Number(text);
    return text !== '' && !Number.isNaN(parsed) ? parsed : null;
  }
  return null;
}

/**
 * A number spelled exactly as view.py's fmt_num spells it ("NaN", "Inf", "-Inf", "—" for missing,
 * integers in full, else Python's "%.4g"), for the heatmap's hover text and legend: the only
 * numbers this extension computes rather than reads from the view.
 */
export function formatNumber(value: Num, digits = 4): string {
  if (value === null) {
    return '—';
  }
  if (Number.isNaN(value)) {
    return 'NaN';
  }
  if (!Number.isFinite(value)) {
    return value > 0 ? 'Inf' : '-Inf';
  }
  if (Number.isInteger(value) && Math.abs(value) < 1e15) {
    return String(value);
  }
  return formatG(value, digits);
}

/** C's "%.<digits>g": scientific below 1e-4 or from 10**digits on, trailing zeros dropped. */
function formatG(value: number, digits: number): string {
  const [mantissa, exp] = value.toExponential(digits - 1).split('e');
  const exponent = Number(exp);
  if (exponent < -4 || exponent >= digits) {
    const sign = exponent < 0 ? '-' : '+';
    return `${trimZeros(mantissa)}e${sign}${String(Math.abs(exponent)).padStart(2, '0')}`;
  }
  return trimZeros(value.toFixed(Math.max(0, digits - 1 - exponent)));
}

function trimZeros(text: string): string {
  return text.includes('.') ? text.replace(/\.?0+$/, '') : text;
}

export function isObject(value: unknown): value is Record<string, unknown> {
  return typeof value === 'object' && value !== null && !Array.isArray(value);
}
