/**
 * What a saved output may make the page do: nothing but draw. A notebook received from someone
 * else carries outputs written by anyone; every colour taken from it is checked here (colours
 * only, never a url() or another CSS function the browser would fetch), and the palette is rebuilt
 * from known keys, so a hostile value falls back to a neutral grey instead of reaching `style`.
 */
import type { Palette } from './schema';

export const FALLBACK_COLOR = '#7F7F7F';

const HEX = /^#(?:[0-9a-fA-F]{3,4}|[0-9a-fA-F]{6}|[0-9a-fA-F]{8})$/;
const BYTE = String.raw`\s*(?:\d{1,3}(?:\.\d+)?%?)\s*`;
const ALPHA = String.raw`\s*(?:0|1|0?\.\d+|\d{1,3}%)\s*`;
const RGB = new RegExp(String.raw`^rgba?\(${BYTE},${BYTE},${BYTE}(?:,${ALPHA})?\)$`);
// The named colours nbguard's palette and matplotlib's defaults use; nothing else is needed.
const NAMED = new Set(['black', 'white', 'gray', 'grey', 'red', 'green', 'blue', 'orange', 'purple', 'transparent']);

/** `value` when it is a plain colour (#hex, rgb()/rgba(), a few names), else FALLBACK_COLOR. */
export function safeColor(value: unknown): string {
  if (typeof value !== 'string') {
    return FALLBACK_COLOR;
  }
  const color = value.trim();
  return HEX.test(color) || RGB.test(color) || NAMED.has(color.toLowerCase()) ? color : FALLBACK_COLOR;
}

/** The palette rebuilt from its known keys, every value a checked colour. */
export function safePalette(raw: unknown): Palette {
  const source = (typeof raw === 'object' && raw !== null ? raw : {}) as Record<string, unknown>;
  const severity = (typeof source.severity === 'object' && source.severity !== null ? source.severity : {}) as Record<
    string,
    unknown
  >;
  const scale = Array.isArray(source.scale) ? source.scale.map(safeColor) : [];
  return {
    nan: safeColor(source.nan),
    inf: safeColor(source.inf),
    over: safeColor(source.over),
    missing: safeColor(source.missing),
    skipped: safeColor(source.skipped),
    line: safeColor(source.line),
    good: safeColor(source.good),
    ...(source.rewind === undefined ? {} : { rewind: safeColor(source.rewind) }),
    severity: { error: safeColor(severity.error), warning: safeColor(severity.warning), info: safeColor(severity.info) },
    scale: scale.length > 0 ? scale : [FALLBACK_COLOR]
  };
}

/** A severity's colour; `tone` comes from the data too, so an unknown one (or "__proto__") is info's. */
export function severityColor(palette: Palette, tone: unknown): string {
  const known = tone === 'error' || tone === 'warning' || tone === 'info' ? tone : 'info';
  return safeColor(palette.severity[known]);
}
