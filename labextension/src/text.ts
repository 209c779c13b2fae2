/**
 * Text from a saved output is shown as what it is. Three kinds of characters make a string read
 * differently from what it does, and each gets one rule here:
 *
 * - line endings: Python and CodeMirror break a line at "\r" and "\r\n", a browser's `pre` draws a
 *   lone "\r" as a space (so `# comment\rimport os` reads as one comment). Cell code is normalised
 *   to "\n" once (cellSource), and that one string is both shown and inserted;
 * - other control characters (C0 but tab and newline, DEL, C1, U+2028/U+2029): invisible or drawn
 *   differently by every reader; a cell holding one is refused (cellSource), and wherever text is
 *   shown they are marked (markedText);
 * - bidirectional controls and zero-width characters: they reorder or hide what is drawn around
 *   them (`access = "user‮ ⁦// admin⁩ ⁦"`). Marked visibly and isolated where text is shown, refused
 *   in ids (isPlainId).
 *
 * A mark keeps the character itself (so an element's textContent is exactly the string it was built
 * from, and exactly what is inserted) in a span isolated from the text around it (`unicode-bidi:
 * isolate`, inline, so an override cannot reach past it) and labelled with its code point
 * (`data-mark`, drawn by style/index.css).
 */

// Bidirectional formatting characters: ALM, LRM, RLM, LRE..RLO, LRI..PDI.
const BIDI = '\\u061C\\u200E\\u200F\\u202A-\\u202E\\u2066-\\u2069';
// Characters that draw nothing: soft hyphen, CGJ, Hangul fillers, Khmer vowels, MVS, zero-width
// space/joiners, word joiner and invisible operators, deprecated format characters, BOM, interlinear
// annotation controls, and the tag characters of plane 14.
const INVISIBLE =
  '\\u00AD\\u034F\\u115F\\u1160\\u17B4\\u17B5\\u180E\\u200B-\\u200D\\u2060-\\u2064\\u206A-\\u206F' +
  '\\u3164\\uFEFF\\uFFA0\\uFFF9-\\uFFFB\\u{E0000}-\\u{E007F}';
// Controls a cell may not hold once its line endings are normalised (tab and newline are fine).
const CONTROL = '\\u0000-\\u0008\\u000B-\\u001F\\u007F-\\u009F\\u2028\\u2029';

/** Every character markedText marks: controls (all but tab and newline), bidi and invisible ones. */
const MARKED = new RegExp(`[${CONTROL}${BIDI}${INVISIBLE}]`, 'u');
const MARKED_ALL = new RegExp(`[${CONTROL}${BIDI}${INVISIBLE}]`, 'gu');
const REFUSED_IN_CELL = new RegExp(`[${CONTROL}]`, 'gu');
const REFUSED_IN_ID = new RegExp(`[${CONTROL}${BIDI}${INVISIBLE}\\s]`, 'u');

const NAMES: Record<string, string> = {
  '\u061C': 'ARABIC LETTER MARK',
  '\u200E': 'LEFT-TO-RIGHT MARK',
  '\u200F': 'RIGHT-TO-LEFT MARK',
  '\u202A': 'LEFT-TO-RIGHT EMBEDDING',
  '\u202B': 'RIGHT-TO-LEFT EMBEDDING',
  '\u202C': 'POP DIRECTIONAL FORMATTING',
  '\u202D': 'LEFT-TO-RIGHT OVERRIDE',
  '\u202E': 'RIGHT-TO-LEFT OVERRIDE',
  '\u2066': 'LEFT-TO-RIGHT ISOLATE',
  '\u2067': 'RIGHT-TO-LEFT ISOLATE',
  '\u2068': 'FIRST STRONG ISOLATE',
  '\u2069': 'POP DIRECTIONAL ISOLATE',
  '\u200B': 'ZERO WIDTH SPACE',
  '\u200C': 'ZERO WIDTH NON-JOINER',
  '\u200D': 'ZERO WIDTH JOINER',
  '\u2060': 'WORD JOINER',
  '\uFEFF': 'ZERO WIDTH NO-BREAK SPACE',
  '\r': 'CARRIAGE RETURN',
  '\u2028': 'LINE SEPARATOR',
  '\u2029': 'PARAGRAPH SEPARATOR'
};

/** "U+202E" for a character. */
export function codePoint(char: string): string {
  return `U+${char.codePointAt(0)!.toString(16).toUpperCase().padStart(4, '0')}`;
}

/** Whether `text` holds a character markedText would mark. */
export function hasMarked(text: string): boolean {
  return MARKED.test(text);
}

/** The text with every marked character written as its code point: for messages that must stay plain. */
export function escapeMarked(text: string): string {
  return text.replace(MARKED_ALL, char => `<${codePoint(char)}>`);
}

/** An id (a fix id) is one plain word: no control, bidirectional, invisible or space character. */
export function isPlainId(text: string): boolean {
  return text !== '' && !REFUSED_IN_ID.test(text);
}

/** The cell a saved fix becomes: one string, shown and inserted as is, or why it is refused. */
export type CellSource = { ok: true; source: string } | { ok: false; source: string; refused: string[] };

/**
 * The code of a cell as it will be shown and inserted: line endings normalised to "\n"; refused
 * (`ok: false`, with the code points) when it still holds a control character other than tab.
 */
export function cellSource(code: string): CellSource {
  const source = code.replace(/\r\n?/g, '\n');
  const refused = [...new Set(source.match(REFUSED_IN_CELL) ?? [])].map(codePoint);
  return refused.length ? { ok: false, source, refused } : { ok: true, source };
}

/**
 * `text` as DOM nodes: plain text, with each marked character in its own isolated, labelled span.
 * The fragment's textContent is `text`, character for character.
 */
export function markedText(text: string): DocumentFragment {
  const fragment = document.createDocumentFragment();
  let last = 0;
  for (const match of text.matchAll(MARKED_ALL)) {
    const at = match.index!;
    if (at > last) {
      fragment.appendChild(document.createTextNode(text.slice(last, at)));
    }
    fragment.appendChild(markSpan(match[0]));
    last = at + match[0].length;
  }
  if (last < text.length) {
    fragment.appendChild(document.createTextNode(text.slice(last)));
  }
  return fragment;
}

function markSpan(char: string): HTMLElement {
  const span = document.createElement('span');
  span.className = 'nbg-mark';
  const point = codePoint(char);
  span.dataset.mark = point;
  span.title = NAMES[char] ? `${point} ${NAMES[char]}` : point;
  // inline, not only in the stylesheet: the override or isolate the character opens ends here
  span.style.unicodeBidi = 'isolate';
  span.appendChild(document.createTextNode(char));
  return span;
}

/** Set an element's text to `text`, marked (markedText); returns the element. */
export function setText<T extends HTMLElement>(node: T, text: string): T {
  node.textContent = '';
  node.appendChild(markedText(text));
  return node;
}
