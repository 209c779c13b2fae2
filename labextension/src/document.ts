/**
 * The nbguard payload document (schema v1), as the kernel writes it under
 * `application/vnd.nbguard.v1+json`, parsed into typed data.
 *
 * JSON has no NaN or Infinity, so the kernel writes non-finite floats as the strings
 * "nan", "inf" and "-inf"; every numeric field is decoded back to a JS number here, so the
 * rest of the extension only ever sees numbers (or null for "no value").
 */

export const MIME_TYPE = 'application/vnd.nbguard.v1+json';
export const SCHEMA_VERSION = 1;

/** A decoded number: finite, NaN, +/-Infinity, or null when the kernel had no value. */
export type Num = number | null;

export interface Finding {
  rule: string;
  severity: string;
  title: string;
  detail: string;
  evidence: Record<string, unknown>;
  fixes: string[];
}

export interface Origin {
  module: string;
  phase: string;
  dtype: string | null;
  input_absmax: Num;
  output_absmax: Num;
  tensor: string | null;
  micro_batch: number | null;
  evidence: Record<string, unknown>;
}

export interface NbEvent {
  kind: string;
  step: number;
  message: string;
  cause: string | null;
  origins: Origin[];
  evidence: Record<string, unknown>;
}

export interface History {
  groups: string[];
  steps: number[];
  grad_norm: Num[][];
  skipped_steps: number[];
  loss: Num[];
  total_grad_norm: Num[];
  loss_scale: Num[];
}

export interface Activations {
  groups: string[];
  steps: number[];
  absmax: Num[][];
  limit: Num;
}

export interface ProbeModule {
  module: string;
  dtype: string | null;
  absmax: Num;
  /** Abs-max of the module's positional inputs: a value born in the parent between two children. */
  input_absmax: Num;
  headroom: Num;
}

export interface Probe {
  limit: Num;
  modules: ProbeModule[];
}

export interface Diagnosis {
  signature: string;
  title: string;
  detail: string;
  exception: string;
  fixes: string[];
}

export interface FixApplied {
  fix: string;
  changed: unknown;
  code: string;
  time: Num;
}

export interface FixCell {
  title: string;
  code: string;
}

export interface Watch {
  title: string;
  events: NbEvent[];
  history: History | null;
}

export interface NbguardDocument {
  schema_version: number;
  kind: string;
  nbguard_version: string;
  output_id: string | null;
  title: string | null;
  environment: Record<string, unknown> | null;
  hardware: Record<string, unknown> | null;
  findings: Finding[];
  probe: Probe | null;
  events: NbEvent[];
  history: History | null;
  activations: Activations | null;
  diagnoses: Diagnosis[];
  fixes_applied: FixApplied[];
  fix_cells: Record<string, FixCell>;
  watches: Watch[];
}

/** Raised for a payload this extension cannot read; the renderer shows its message. */
export class DocumentError extends Error {}

/** Decode one JSON number as nbguard writes it ("nan", "inf", "-inf" for non-finite). */
export function decodeNumber(value: unknown): Num {
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

/** A number as a person reads it; non-finite values spelled like the kernel spells them. */
export function formatNumber(value: Num, digits = 4): string {
  if (value === null) {
    return '—';
  }
  if (Number.isNaN(value)) {
    return 'nan';
  }
  if (!Number.isFinite(value)) {
    return value > 0 ? 'inf' : '-inf';
  }
  if (Number.isInteger(value) && Math.abs(value) < 1e6) {
    return String(value);
  }
  const magnitude = Math.abs(value);
  if (magnitude !== 0 && (magnitude >= 1e5 || magnitude < 1e-3)) {
    return value.toExponential(digits - 1);
  }
  return String(Number(value.toPrecision(digits)));
}

/** Parse and decode a raw payload; throws DocumentError when it is not an nbguard v1 document. */
export function parseDocument(raw: unknown): NbguardDocument {
  if (!isObject(raw)) {
    throw new DocumentError('nbguard: the payload is not a JSON object');
  }
  if (raw.schema_version !== SCHEMA_VERSION) {
    throw new DocumentError(
      `nbguard: unsupported schema_version ${JSON.stringify(raw.schema_version)}; ` +
        `this extension reads version ${SCHEMA_VERSION} (update the nbguard package or extension)`
    );
  }
  return {
    schema_version: SCHEMA_VERSION,
    kind: str(raw.kind, 'report'),
    nbguard_version: str(raw.nbguard_version, ''),
    output_id: optStr(raw.output_id),
    title: optStr(raw.title),
    environment: isObject(raw.environment) ? raw.environment : null,
    hardware: isObject(raw.hardware) ? raw.hardware : null,
    findings: list(raw.findings).filter(isObject).map(parseFinding),
    probe: isObject(raw.probe) ? parseProbe(raw.probe) : null,
    events: list(raw.events).filter(isObject).map(parseEvent),
    history: isObject(raw.history) ? parseHistory(raw.history) : null,
    activations: isObject(raw.activations) ? parseActivations(raw.activations) : null,
    diagnoses: list(raw.diagnoses).filter(isObject).map(parseDiagnosis),
    fixes_applied: list(raw.fixes_applied).filter(isObject).map(parseFixApplied),
    fix_cells: parseFixCells(raw.fix_cells),
    watches: list(raw.watches).filter(isObject).map(parseWatch)
  };
}

export function parseFinding(raw: Record<string, unknown>): Finding {
  return {
    rule: str(raw.rule, ''),
    severity: str(raw.severity, 'info'),
    title: str(raw.title, str(raw.rule, 'finding')),
    detail: str(raw.detail, ''),
    evidence: isObject(raw.evidence) ? raw.evidence : {},
    fixes: list(raw.fixes).map(v => String(v))
  };
}

function parseOrigin(raw: Record<string, unknown>): Origin {
  return {
    module: str(raw.module, '?'),
    phase: str(raw.phase, ''),
    dtype: optStr(raw.dtype),
    input_absmax: decodeNumber(raw.input_absmax),
    output_absmax: decodeNumber(raw.output_absmax),
    tensor: optStr(raw.tensor),
    micro_batch: typeof raw.micro_batch === 'number' ? raw.micro_batch : null,
    evidence: isObject(raw.evidence) ? raw.evidence : {}
  };
}

export function parseEvent(raw: Record<string, unknown>): NbEvent {
  return {
    kind: str(raw.kind, 'event'),
    step: typeof raw.step === 'number' ? raw.step : -1,
    message: str(raw.message, ''),
    cause: optStr(raw.cause),
    origins: list(raw.origins).filter(isObject).map(parseOrigin),
    evidence: isObject(raw.evidence) ? raw.evidence : {}
  };
}

export function parseHistory(raw: Record<string, unknown>): History {
  return {
    groups: list(raw.groups).map(v => String(v)),
    steps: list(raw.steps).map(v => Number(v)),
    grad_norm: list(raw.grad_norm).map(row => list(row).map(decodeNumber)),
    skipped_steps: list(raw.skipped_steps).map(v => Number(v)),
    loss: list(raw.loss).map(decodeNumber),
    total_grad_norm: list(raw.total_grad_norm).map(decodeNumber),
    loss_scale: list(raw.loss_scale).map(decodeNumber)
  };
}

function parseActivations(raw: Record<string, unknown>): Activations {
  return {
    groups: list(raw.groups).map(v => String(v)),
    steps: list(raw.steps).map(v => Number(v)),
    absmax: list(raw.absmax).map(row => list(row).map(decodeNumber)),
    limit: decodeNumber(raw.limit)
  };
}

function parseProbe(raw: Record<string, unknown>): Probe {
  return {
    limit: decodeNumber(raw.limit),
    modules: list(raw.modules)
      .filter(isObject)
      .map(m => ({
        module: str(m.module, '?'),
        dtype: optStr(m.dtype),
        absmax: decodeNumber(m.absmax),
        input_absmax: decodeNumber(m.input_absmax),
        headroom: decodeNumber(m.headroom)
      }))
  };
}

function parseDiagnosis(raw: Record<string, unknown>): Diagnosis {
  return {
    signature: str(raw.signature, ''),
    title: str(raw.title, str(raw.signature, 'diagnosis')),
    detail: str(raw.detail, ''),
    exception: str(raw.exception, ''),
    fixes: list(raw.fixes).map(v => String(v))
  };
}

function parseFixApplied(raw: Record<string, unknown>): FixApplied {
  return {
    fix: str(raw.fix, ''),
    changed: raw.changed,
    code: str(raw.code, ''),
    time: decodeNumber(raw.time)
  };
}

function parseFixCells(raw: unknown): Record<string, FixCell> {
  const cells: Record<string, FixCell> = {};
  if (!isObject(raw)) {
    return cells;
  }
  for (const [id, cell] of Object.entries(raw)) {
    if (isObject(cell) && typeof cell.code === 'string') {
      cells[id] = { title: str(cell.title, id), code: cell.code };
    }
  }
  return cells;
}

function parseWatch(raw: Record<string, unknown>): Watch {
  return {
    title: str(raw.title, 'watch'),
    events: list(raw.events).filter(isObject).map(parseEvent),
    history: isObject(raw.history) ? parseHistory(raw.history) : null
  };
}

export function isObject(value: unknown): value is Record<string, unknown> {
  return typeof value === 'object' && value !== null && !Array.isArray(value);
}

function list(value: unknown): unknown[] {
  return Array.isArray(value) ? value : [];
}

function str(value: unknown, fallback: string): string {
  return typeof value === 'string' ? value : fallback;
}

function optStr(value: unknown): string | null {
  return typeof value === 'string' ? value : null;
}
