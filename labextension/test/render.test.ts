import { beforeEach, describe, expect, it, vi } from 'vitest';

import { parseDocument } from '../src/document';
import { renderDocument, renderFinding } from '../src/render';
import { sampleDocument } from './fixtures';

beforeEach(() => {
  vi.spyOn(HTMLCanvasElement.prototype, 'getContext').mockReturnValue(null);
});

function flush(): Promise<void> {
  return new Promise(resolve => setTimeout(resolve, 0));
}

describe('finding cards', () => {
  it('show severity, title, detail, collapsible evidence and one box per fix', () => {
    const doc = parseDocument(sampleDocument());
    const card = renderFinding(doc.findings[0], doc, { insertFix: null });
    expect(card.classList.contains('nbg-severity-warning')).toBe(true);
    expect(card.dataset.rule).toBe('trainable-low-precision');
    expect(card.querySelector('.nbg-badge')!.textContent).toBe('warning');
    expect(card.querySelector('.nbg-card-title')!.textContent).toBe('Trainable parameters are stored in bfloat16');
    expect(card.querySelector('.nbg-detail')!.textContent).toContain('AdamW');
    const evidence = card.querySelector('details.nbg-evidence') as HTMLDetailsElement;
    expect(evidence.open).toBe(false);
    expect(evidence.textContent).toContain('trainable_bf16');
    expect(evidence.textContent).toContain('18');
    const fix = card.querySelector('.nbg-fix') as HTMLElement;
    expect(fix.dataset.fix).toBe('upcast-trainable-fp32');
    expect(fix.querySelector('.nbg-code')!.textContent).toBe('nbguard.fixes.apply("upcast-trainable-fp32", model)');
    expect(fix.querySelector('.nbg-fix-title')!.textContent).toBe('Keep trainable parameters in float32');
  });

  it('disable the buttons outside a notebook', () => {
    const doc = parseDocument(sampleDocument());
    const card = renderFinding(doc.findings[0], doc, { insertFix: null });
    const buttons = [...card.querySelectorAll('button')] as HTMLButtonElement[];
    expect(buttons.map(b => b.textContent)).toEqual(['Insert fix cell', 'Insert and run']);
    expect(buttons.every(b => b.disabled)).toBe(true);
  });

  it('insert the fix cell code, with run=false and run=true', async () => {
    const doc = parseDocument(sampleDocument());
    const insertFix = vi.fn().mockResolvedValue(undefined);
    const card = renderFinding(doc.findings[0], doc, { insertFix });
    const [insert, insertRun] = [...card.querySelectorAll('button')] as HTMLButtonElement[];
    insert.click();
    await flush();
    expect(insertFix).toHaveBeenLastCalledWith('nbguard.fixes.apply("upcast-trainable-fp32", model)', false);
    expect(card.querySelector('.nbg-fix-status')!.textContent).toBe('Inserted below.');
    insertRun.click();
    await flush();
    expect(insertFix).toHaveBeenLastCalledWith('nbguard.fixes.apply("upcast-trainable-fp32", model)', true);
    expect(card.querySelector('.nbg-fix-status')!.textContent).toBe('Inserted below and ran.');
    expect(insert.disabled).toBe(false);
  });

  it('report a failed insertion on the card', async () => {
    const doc = parseDocument(sampleDocument());
    const insertFix = vi.fn().mockRejectedValue(new Error('the notebook is read-only'));
    const card = renderFinding(doc.findings[0], doc, { insertFix });
    (card.querySelector('button') as HTMLButtonElement).click();
    await flush();
    const status = card.querySelector('.nbg-fix-status')!;
    expect(status.textContent).toBe('Could not insert: the notebook is read-only');
    expect(status.classList.contains('nbg-error-text')).toBe(true);
  });

  it('say so when a fix has no recorded cell code', () => {
    const doc = parseDocument(sampleDocument());
    const card = renderFinding(doc.findings[1], doc, { insertFix: vi.fn() });
    const boxes = card.querySelectorAll('.nbg-fix');
    expect(boxes).toHaveLength(2);
    expect(boxes[1].textContent).toContain('No cell code was recorded');
    expect(boxes[1].querySelector('button')).toBeNull();
  });
});

describe('renderDocument', () => {
  it('orders findings by severity and draws events, origins, probe and heatmap', () => {
    const root = renderDocument(parseDocument(sampleDocument()), { insertFix: null });
    const rules = [...root.querySelectorAll('.nbg-card')].map(c => (c as HTMLElement).dataset.rule);
    expect(rules).toEqual(['fp16-on-gemma3', 'trainable-low-precision']);
    expect(root.querySelector('.nbg-title')!.textContent).toBe('Precision audit');
    expect(root.querySelector('.nbg-summary')!.textContent).toBe('1 error · 1 warning · 1 event');
    expect(root.querySelector('.nbg-meta')!.textContent).toContain('NVIDIA A100');
    const origin = root.querySelector('.nbg-origins tbody tr')!;
    expect([...origin.querySelectorAll('td')].map(td => td.textContent)).toEqual([
      'forward', 'model.layers.1.mlp.down_proj', 'output', 'torch.float16', '60000', 'inf', '0'
    ]);
    expect(root.querySelector('.nbg-cause')!.textContent).toBe('overflow');
    expect(root.querySelector('.nbg-probe-table')!.textContent).toContain('inf');
    expect(root.querySelector('.nbg-probe-table')!.textContent).toContain('input abs-max');
    expect(root.querySelector('.nbg-history canvas')).not.toBeNull();
    expect(root.querySelector('.nbg-history')!.textContent).toContain('Skipped optimizer steps: 3');
  });

  it('shows a passing audit as such', () => {
    const root = renderDocument(parseDocument({ schema_version: 1, kind: 'audit', findings: [] }), { insertFix: null });
    expect(root.querySelector('.nbg-ok')!.textContent).toContain('No findings');
  });

  it('renders each watch of a report', () => {
    const raw = sampleDocument();
    raw.kind = 'report';
    raw.watches = [{ title: 'Training run 1', events: raw.events, history: raw.history }];
    const root = renderDocument(parseDocument(raw), { insertFix: null });
    const watch = root.querySelector('.nbg-watch')!;
    expect(watch.querySelector('.nbg-section-title')!.textContent).toBe('Training run 1');
    expect(watch.querySelector('canvas')).not.toBeNull();
    expect(watch.querySelector('.nbg-event')).not.toBeNull();
  });

  it('never turns document text into markup', () => {
    const raw = sampleDocument();
    raw.title = '<img src=x onerror="window.pwned=1">';
    (raw.findings as any[])[0].detail = '<script>window.pwned=1</script>';
    const root = renderDocument(parseDocument(raw), { insertFix: null });
    expect(root.querySelector('img')).toBeNull();
    expect(root.querySelector('script')).toBeNull();
    expect(root.querySelector('.nbg-title')!.textContent).toBe('<img src=x onerror="window.pwned=1">');
  });
});
