/** Untrusted outputs are data, never actions: a hostile saved output cannot run, fetch or hide code. */
import { beforeEach, describe, expect, it, vi } from 'vitest';

import { InvalidDocumentError, MIME_TYPE, readPayload } from '../src/document';
import { renderCard, renderPayload } from '../src/render';
import { FALLBACK_COLOR, safeColor, safePalette } from '../src/safety';
import { NbguardRenderer } from '../src/widget';
import { loadFixture } from './fixtures';

beforeEach(() => {
  vi.spyOn(HTMLCanvasElement.prototype, 'getContext').mockReturnValue(null);
  document.body.innerHTML = '';
});

function flush(): Promise<void> {
  return new Promise(resolve => setTimeout(resolve, 0));
}

const HIDDEN = "; open('/tmp/nbguard-marker','w').write('x')";

/** The real audit fixture with its first fix made hostile: harmless code, 400 spaces, then a write. */
function hostile() {
  const raw = loadFixture('audit');
  const findings = raw.view.sections.find(s => s.kind === 'findings')!;
  const card = findings.cards.find(c => c.fixes.some(f => f.code))!;
  const fix = card.fixes.find(f => f.code)!;
  fix.code = 'model.config.use_cache = False' + ' '.repeat(400) + HIDDEN;
  fix.verdict = { status: 'verified', label: 'verified', detail: '' };
  return { raw, card, fix, palette: raw.view.palette };
}

describe('a fix card of an untrusted output', () => {
  it('offers no "Insert and run", marks the id as saved and says "verified when saved"', () => {
    const { card, fix, palette } = hostile();
    const node = renderCard(card, 'findings', palette, { insertFix: vi.fn(), trusted: false });
    const box = node.querySelector(`.nbg-fix[data-fix="${fix.id}"]`)!;
    const labels = [...box.querySelectorAll('button')].map(b => b.textContent);
    expect(labels).toEqual(['Insert fix cell']);
    expect(box.querySelector('.nbg-saved-mark')!.textContent).toBe('from a saved file');
    expect(box.querySelector('.nbg-verdict-verified')!.textContent).toBe('verified when saved');
  });

  it('inserts only after a confirmation that shows the whole code wrapped, and never runs it', async () => {
    const { card, fix, palette } = hostile();
    const insertFix = vi.fn().mockResolvedValue(undefined);
    const node = renderCard(card, 'findings', palette, { insertFix, trusted: false });
    const insert = node.querySelector(`.nbg-fix[data-fix="${fix.id}"] button`) as HTMLButtonElement;
    insert.click();
    await flush();
    expect(insertFix).not.toHaveBeenCalled();
    const dialog = document.querySelector('.nbg-confirm')!;
    const code = dialog.querySelector('pre')! as HTMLElement;
    expect(code.textContent).toBe(fix.code);
    expect(code.textContent!.endsWith(HIDDEN)).toBe(true);
    expect(code.style.whiteSpace).toBe('pre-wrap');
    expect(dialog.textContent).toContain(`"${fix.id}" and its code come from a saved file`);
    (dialog.querySelector('.nbg-confirm-cancel') as HTMLButtonElement).click();
    await flush();
    expect(insertFix).not.toHaveBeenCalled();
    expect(document.querySelector('.nbg-confirm')).toBeNull();
    insert.click();
    await flush();
    (document.querySelector('.nbg-confirm-insert') as HTMLButtonElement).click();
    await flush();
    expect(insertFix).toHaveBeenCalledTimes(1);
    expect(insertFix).toHaveBeenLastCalledWith(fix.code, false);
  });

  it('a trusted output keeps both buttons and the plain verdict', () => {
    const { card, fix, palette } = hostile();
    const node = renderCard(card, 'findings', palette, { insertFix: vi.fn(), trusted: true });
    const box = node.querySelector(`.nbg-fix[data-fix="${fix.id}"]`)!;
    expect([...box.querySelectorAll('button')].map(b => b.textContent)).toEqual(['Insert fix cell', 'Insert and run']);
    expect(box.querySelector('.nbg-verdict-verified')!.textContent).toBe('verified');
  });

  it('every code box wraps', () => {
    const { raw } = hostile();
    const root = renderPayload(readPayload(raw), { insertFix: null, trusted: false });
    const boxes = [...root.querySelectorAll('pre.nbg-code')] as HTMLElement[];
    expect(boxes.length).toBeGreaterThan(0);
    for (const box of boxes) {
      expect(box.style.whiteSpace).toBe('pre-wrap');
    }
  });

  it('the Lab renderer passes the model\'s trust: an untrusted model gets no run button', async () => {
    const { raw, fix } = hostile();
    const inserter = vi.fn().mockResolvedValue(undefined);
    const renderer = new NbguardRenderer(() => inserter);
    await renderer.renderModel({ data: { [MIME_TYPE]: raw }, metadata: {}, trusted: false, setData: () => undefined } as any);
    const box = renderer.node.querySelector(`.nbg-fix[data-fix="${fix.id}"]`)!;
    expect([...box.querySelectorAll('button')].map(b => b.textContent)).toEqual(['Insert fix cell']);
  });
});

describe('colours from data', () => {
  it('are colours only: #hex, rgb(), a few names; never url() or another CSS function', () => {
    for (const good of ['#D55E00', '#abc', 'rgb(1, 2, 3)', 'rgba(1,2,3,0.5)', 'black']) {
      expect(safeColor(good)).toBe(good);
    }
    for (const bad of ['url(http://127.0.0.1:9/x)', 'red;background:url(x)', 'image-set("x.png" 1x)', 'var(--x)',
                       'expression(alert(1))', '#12345g', 42, null, '']) {
      expect(safeColor(bad)).toBe(FALLBACK_COLOR);
    }
  });

  it('a hostile palette reaches no style: the payload fails the schema and only an inert notice is drawn', async () => {
    const raw = loadFixture('audit');
    const evil = 'url(http://127.0.0.1:9/x)';
    raw.view.palette = { ...raw.view.palette, nan: evil, good: evil, scale: [evil, '#fff'],
                         severity: { error: evil, warning: evil, info: evil } } as any;
    expect(() => readPayload(raw)).toThrow(InvalidDocumentError);
    const renderer = new NbguardRenderer(() => vi.fn());
    await renderer.renderModel({ data: { [MIME_TYPE]: raw }, metadata: {}, trusted: false, setData: () => undefined } as any);
    expect(renderer.node.querySelector('.nbg-invalid')!.textContent).toContain('view.palette.nan: does not match');
    expect(renderer.node.outerHTML).not.toContain('url(');
    expect(renderer.node.querySelectorAll('button, .nbg-report').length).toBe(0);
  });

  it('the palette is rebuilt from checked colours all the same (a second line of defence)', () => {
    const evil = 'url(http://127.0.0.1:9/x)';
    const palette = safePalette({ nan: evil, good: evil, scale: [evil, '#fff'], severity: { error: evil } });
    expect(JSON.stringify(palette)).not.toContain('url(');
    expect(palette.scale).toEqual([FALLBACK_COLOR, '#fff']);
    expect(safePalette({ scale: [] }).scale).toEqual([FALLBACK_COLOR]);
  });
});
