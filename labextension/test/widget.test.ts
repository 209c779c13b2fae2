import { beforeEach, describe, expect, it, vi } from 'vitest';

import { MIME_TYPE } from '../src/document';
import { HOSTING_RANK, NbguardRenderer, RENDERER_RANK, rendererFactory } from '../src/widget';
import { WIDGET_VIEW_MIME, WidgetHost } from '../src/widgethost';
import { loadFixture } from './fixtures';

/** The real audit payload as the notebook displays it: with the output_id the front end adds. */
function sampleDocument() {
  return { ...loadFixture('audit'), output_id: 'out-123' };
}

beforeEach(() => {
  vi.spyOn(HTMLCanvasElement.prototype, 'getContext').mockReturnValue(null);
});

function model(data: unknown, widget: Record<string, unknown> = {}, trusted = false): any {
  return { data: { [MIME_TYPE]: data, ...widget }, metadata: {}, trusted, setData: () => undefined };
}

function widgetView(modelId: string) {
  return { [WIDGET_VIEW_MIME]: { version_major: 2, version_minor: 0, model_id: modelId } };
}

describe('NbguardRenderer', () => {
  it('is a safe, top-ranked factory for the nbguard MIME type', () => {
    const factory = rendererFactory(() => null);
    expect(factory.mimeTypes).toEqual([MIME_TYPE]);
    expect(factory.safe).toBe(true);
    expect(factory.defaultRank).toBe(RENDERER_RANK);
    expect(RENDERER_RANK).toBeLessThan(50); // text/html's rank
    expect(RENDERER_RANK).toBeGreaterThan(-10); // outside notebooks ipywidgets' renderer still wins
  });

  it('outranks ipywidgets (-10) where it can host the widget view', () => {
    const factory = rendererFactory(() => null, async () => null);
    expect(factory.defaultRank).toBe(HOSTING_RANK);
    expect(HOSTING_RANK).toBeLessThan(-10);
  });

  it('renders the document and hands its model and output_id to the inserter factory', async () => {
    const inserterFor = vi.fn().mockReturnValue(vi.fn());
    const renderer = new NbguardRenderer(inserterFor);
    const m = model(sampleDocument());
    await renderer.renderModel(m);
    expect(inserterFor).toHaveBeenCalledWith(renderer, m, 'out-123');
    expect(renderer.node.querySelectorAll('.nbg-card')).toHaveLength(sampleDocument().view.sections.flatMap(s => s.cards).length);
    expect(renderer.node.querySelectorAll(':scope > .nbg-static > .nbg-report')).toHaveLength(1);
    expect((renderer.node.querySelector('button.nbg-insert') as HTMLButtonElement).disabled).toBe(false);
  });

  it('shows why a payload cannot be read instead of failing', async () => {
    const renderer = new NbguardRenderer(() => null);
    await renderer.renderModel(model({ schema_version: 9 }));
    expect(renderer.node.querySelector('.nbg-render-error')!.textContent).toContain('unsupported schema_version 9');
  });
});

describe('NbguardRenderer hosting a widget view', () => {
  it('hosts the widget of a trusted bundle with a widget view, beside its static view', async () => {
    const source = vi.fn().mockResolvedValue(null);
    const renderer = new NbguardRenderer(() => null, source);
    await renderer.renderModel(model(sampleDocument(), widgetView('w1'), true));
    expect(source).toHaveBeenCalledWith('w1');
    const host = renderer.widgets[0] as WidgetHost;
    expect(host).toBeInstanceOf(WidgetHost);
    expect(host.node.querySelectorAll(':scope > .nbg-static .nbg-card')).toHaveLength(sampleDocument().view.sections.flatMap(s => s.cards).length); // the static view meanwhile
  });

  it('never hosts for an untrusted output, a bundle without a widget view, or without a source', async () => {
    const source = vi.fn().mockResolvedValue(null);
    for (const m of [model(sampleDocument(), widgetView('w1'), false), model(sampleDocument(), {}, true)]) {
      const renderer = new NbguardRenderer(() => null, source);
      await renderer.renderModel(m);
      expect(renderer.widgets[0]).not.toBeInstanceOf(WidgetHost);
    }
    const plain = new NbguardRenderer(() => null);
    await plain.renderModel(model(sampleDocument(), widgetView('w1'), true));
    expect(plain.widgets[0]).not.toBeInstanceOf(WidgetHost);
    expect(source).not.toHaveBeenCalled();
  });

  it('keeps the hosted widget when the same widget is displayed again, and replaces it for another', async () => {
    const source = vi.fn().mockResolvedValue(null);
    const renderer = new NbguardRenderer(() => null, source);
    await renderer.renderModel(model(sampleDocument(), widgetView('w1'), true));
    const host = renderer.widgets[0];
    const updated = loadFixture('healthy'); // the same widget, now showing a passing audit
    await renderer.renderModel(model(updated, widgetView('w1'), true));
    expect(renderer.widgets).toEqual([host]);
    expect(host.node.querySelectorAll('.nbg-card')).toHaveLength(0); // the updated static view
    expect(source).toHaveBeenCalledTimes(1);

    await renderer.renderModel(model(updated, widgetView('w2'), true));
    expect(host.isDisposed).toBe(true);
    expect(renderer.widgets).toHaveLength(1);
    expect(source).toHaveBeenLastCalledWith('w2');
  });
});
