import { beforeEach, describe, expect, it, vi } from 'vitest';

import { MIME_TYPE } from '../src/document';
import { NbguardRenderer, rendererFactory } from '../src/widget';
import { sampleDocument } from './fixtures';

beforeEach(() => {
  vi.spyOn(HTMLCanvasElement.prototype, 'getContext').mockReturnValue(null);
});

function model(data: unknown): any {
  return { data: { [MIME_TYPE]: data }, metadata: {}, trusted: false, setData: () => undefined };
}

describe('NbguardRenderer', () => {
  it('is a safe, top-ranked factory for the nbguard MIME type', () => {
    const factory = rendererFactory(() => null);
    expect(factory.mimeTypes).toEqual([MIME_TYPE]);
    expect(factory.safe).toBe(true);
    expect(factory.defaultRank).toBeLessThan(50); // text/html's rank
  });

  it('renders the document and hands its model and output_id to the inserter factory', async () => {
    const inserterFor = vi.fn().mockReturnValue(vi.fn());
    const renderer = new NbguardRenderer(inserterFor);
    const m = model(sampleDocument());
    await renderer.renderModel(m);
    expect(inserterFor).toHaveBeenCalledWith(renderer, m, 'out-123');
    expect(renderer.node.querySelectorAll('.nbg-card')).toHaveLength(2);
    expect((renderer.node.querySelector('button.nbg-insert') as HTMLButtonElement).disabled).toBe(false);
  });

  it('shows why a payload cannot be read instead of failing', async () => {
    const renderer = new NbguardRenderer(() => null);
    await renderer.renderModel(model({ schema_version: 9 }));
    expect(renderer.node.querySelector('.nbg-render-error')!.textContent).toContain('unsupported schema_version 9');
  });
});
