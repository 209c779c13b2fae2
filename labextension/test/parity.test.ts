/**
 * "Same sections and values": every string of a real payload's view appears in the Lab DOM, as
 * tests/test_document_view.py checks for the static HTML on the same documents.
 */
import { beforeEach, describe, expect, it, vi } from 'vitest';

import { readPayload } from '../src/document';
import { renderPayload } from '../src/render';
import { fixtureNames, loadFixture, viewStrings } from './fixtures';

beforeEach(() => {
  vi.spyOn(HTMLCanvasElement.prototype, 'getContext').mockReturnValue(null);
});

describe('the Lab view shows everything the view says', () => {
  it('has the real fixtures to check', () => {
    expect(fixtureNames()).toEqual(expect.arrayContaining(['audit', 'diagnosis', 'healthy', 'probe', 'report', 'watch']));
  });

  for (const name of fixtureNames()) {
    it(`${name}: every view string is in the DOM, and every section is drawn in order`, () => {
      const raw = loadFixture(name);
      const root = renderPayload(readPayload(raw), { insertFix: null, trusted: true });
      const text = root.textContent ?? '';
      const strings = viewStrings(raw.view);
      expect(strings.length).toBeGreaterThan(3);
      expect(strings.filter(s => !text.includes(s))).toEqual([]);
      const drawn = [...root.querySelectorAll('[data-section], .nbg-entry')].map(node =>
        node.classList.contains('nbg-entry') ? 'entry' : (node as HTMLElement).dataset.section
      );
      expect(drawn).toEqual(raw.view.sections.map(s => s.kind));
    });
  }

  it('would notice a view string the renderer leaves out', () => {
    const raw = loadFixture('watch');
    const root = renderPayload(readPayload(raw), { insertFix: null, trusted: true });
    raw.view.sections.find((s: { kind: string }) => s.kind === 'watch')!.facts.push({ text: 'a fact no renderer was given', tone: '' });
    const missing = viewStrings(raw.view).filter(s => !(root.textContent ?? '').includes(s));
    expect(missing).toEqual(['a fact no renderer was given']);
  });
});
