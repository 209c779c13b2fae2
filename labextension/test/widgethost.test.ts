import { afterEach, describe, expect, it, vi } from 'vitest';
import { IRenderMime } from '@jupyterlab/rendermime-interfaces';
import { Signal } from '@lumino/signaling';
import { Widget } from '@lumino/widgets';

import {
  WIDGET_VIEW_MIME,
  WidgetHost,
  WidgetSession,
  notebookWidgetSource,
  showsLiveWidget,
  widgetModelId
} from '../src/widgethost';

/** Stands in for ipywidgets' WidgetRenderer: it writes its states into its own node, as that one does. */
class FakeWidgetRenderer extends Widget implements IRenderMime.IRenderer {
  renderModel = vi.fn(async (_model: IRenderMime.IMimeModel) => {
    this.node.textContent = 'Loading widget...';
  });

  mountView(): void {
    const view = document.createElement('div');
    view.className = 'widget-vbox';
    view.textContent = 'live view';
    this.node.textContent = '';
    this.node.append(view);
  }
}

function node(html: string): HTMLElement {
  const div = document.createElement('div');
  div.innerHTML = html;
  return div;
}

const model = { data: { [WIDGET_VIEW_MIME]: { model_id: 'm1' } }, metadata: {}, trusted: true } as any;
const mutationsDelivered = () => new Promise(resolve => setTimeout(resolve, 0));

const attached: Widget[] = [];
function attach<T extends Widget>(widget: T): T {
  Widget.attach(widget, document.body);
  attached.push(widget);
  return widget;
}
afterEach(() => {
  attached.splice(0).forEach(w => w.dispose());
});

describe('showsLiveWidget', () => {
  it('is true only for a mounted view element', () => {
    expect(showsLiveWidget(node('<div class="lm-Widget">view</div>'))).toBe(true);
    expect(showsLiveWidget(node('\n<div class="lm-Widget"></div>'))).toBe(true);
  });

  it('is false for an empty node and for the renderer status texts', () => {
    expect(showsLiveWidget(node(''))).toBe(false);
    expect(showsLiveWidget(node('Loading widget...'))).toBe(false);
    expect(showsLiveWidget(node('Error displaying widget: model not found'))).toBe(false);
    expect(showsLiveWidget(node('Error displaying widget'))).toBe(false);
    expect(showsLiveWidget(node('Error displaying widget<div>stale</div>'))).toBe(false);
  });
});

describe('widgetModelId', () => {
  it('reads the widget view model id, or null', () => {
    expect(widgetModelId({ [WIDGET_VIEW_MIME]: { version_major: 2, model_id: 'abc' } })).toBe('abc');
    expect(widgetModelId({ [WIDGET_VIEW_MIME]: { model_id: '' } })).toBeNull(); // ipywidgets: a closed view
    expect(widgetModelId({ [WIDGET_VIEW_MIME]: { model_id: null } })).toBeNull();
    expect(widgetModelId({ [WIDGET_VIEW_MIME]: null })).toBeNull();
    expect(widgetModelId({ 'text/plain': 'x' })).toBeNull();
  });
});

describe('WidgetHost', () => {
  function staticView(): Widget {
    const view = new Widget();
    view.node.textContent = 'static report';
    return view;
  }

  function shown(host: WidgetHost): string[] {
    return host.widgets.filter(w => !w.isHidden).map(w => (w instanceof FakeWidgetRenderer ? 'widget' : 'static'));
  }

  it('shows the static view until the hosted renderer mounts a live view, and again after an error', async () => {
    const host = attach(new WidgetHost('m1', staticView()));
    const renderer = new FakeWidgetRenderer();
    const source = vi.fn().mockResolvedValue({ renderer, gone: new Promise(() => undefined) });
    await host.hostWidget(source, model);

    expect(source).toHaveBeenCalledWith('m1');
    expect(renderer.renderModel).toHaveBeenCalledWith(model);
    expect(renderer.parent).toBe(host);
    await mutationsDelivered();
    expect(shown(host)).toEqual(['static']); // "Loading widget..." is not a view

    renderer.mountView(); // the widget manager restored the model: the view appears later
    await mutationsDelivered();
    expect(shown(host)).toEqual(['widget']);
    expect(host.showsWidget).toBe(true);

    renderer.node.textContent = 'Error displaying widget: model not found';
    await mutationsDelivered();
    expect(shown(host)).toEqual(['static']);

    renderer.mountView();
    await mutationsDelivered();
    renderer.node.replaceChildren(); // the view was closed (kernel restarted)
    await mutationsDelivered();
    expect(shown(host)).toEqual(['static']);
    expect(host.showsWidget).toBe(false);
  });

  it('keeps only the static view when the model is not alive', async () => {
    const host = attach(new WidgetHost('m1', staticView()));
    await host.hostWidget(vi.fn().mockResolvedValue(null), model);
    expect(host.widgets).toHaveLength(1);
    expect(shown(host)).toEqual(['static']);
  });

  it('disposes a renderer that arrives after the host is gone', async () => {
    const host = new WidgetHost('m1', staticView());
    const renderer = new FakeWidgetRenderer();
    let resolve: (r: FakeWidgetRenderer) => void = () => undefined;
    const pending = host.hostWidget(() => new Promise<FakeWidgetRenderer>(r => (resolve = r)).then(renderer => ({ renderer, gone: Promise.resolve() })), model);
    host.dispose();
    resolve(renderer);
    await pending;
    expect(renderer.isDisposed).toBe(true);
    expect(renderer.renderModel).not.toHaveBeenCalled();
  });

  it('swaps in a new static view without touching the live widget', async () => {
    const host = attach(new WidgetHost('m1', staticView()));
    const renderer = new FakeWidgetRenderer();
    await host.hostWidget(vi.fn().mockResolvedValue({ renderer, gone: new Promise(() => undefined) }), model);
    renderer.mountView();
    await mutationsDelivered();
    const updated = staticView();
    host.setStaticView(updated);
    expect(host.widgets).toEqual([updated, renderer]);
    expect(updated.isHidden).toBe(true);
    expect(shown(host)).toEqual(['widget']);
  });

  it('shows the static view once the model is gone, though ipywidgets still shows the dead view', async () => {
    const host = attach(new WidgetHost('m1', staticView()));
    const renderer = new FakeWidgetRenderer();
    let gone: () => void = () => undefined;
    await host.hostWidget(vi.fn().mockResolvedValue({ renderer, gone: new Promise<void>(r => (gone = r)) }), model);
    renderer.mountView();
    await mutationsDelivered();
    expect(shown(host)).toEqual(['widget']);
    gone(); // the kernel restarted
    await mutationsDelivered();
    expect(renderer.node.querySelector('.widget-vbox')).not.toBeNull();
    expect(shown(host)).toEqual(['static']);
  });
});

describe('notebookWidgetSource', () => {
  function session(kernel: any, ready: Promise<void> = Promise.resolve()): WidgetSession {
    return { ready, session: kernel ? { kernel } : null };
  }
  function registry(withWidgets = true) {
    const renderer = new FakeWidgetRenderer();
    return {
      renderer,
      mimeTypes: withWidgets ? ['application/vnd.nbguard.v1+json', WIDGET_VIEW_MIME, 'text/plain'] : ['text/plain'],
      createRenderer: vi.fn(() => renderer)
    };
  }
  function kernel(hasComm: boolean, comms: Record<string, unknown> | Error = {}) {
    return {
      statusChanged: new Signal<any, string>({}),
      disposed: new Signal<any, void>({}),
      hasComm: vi.fn(() => hasComm),
      requestCommInfo: vi.fn(async () => {
        if (comms instanceof Error) {
          throw comms;
        }
        return { content: { status: 'ok', comms } };
      })
    };
  }

  it('creates the widget renderer right away for a comm this page holds', async () => {
    const reg = registry();
    const k = kernel(true);
    expect((await notebookWidgetSource(reg, session(k))('m1'))?.renderer).toBe(reg.renderer);
    expect(reg.createRenderer).toHaveBeenCalledWith(WIDGET_VIEW_MIME);
    expect(k.hasComm).toHaveBeenCalledWith('m1');
    expect(k.requestCommInfo).not.toHaveBeenCalled();
  });

  it('asks the kernel for its widget comms otherwise (a reloaded page)', async () => {
    const reg = registry();
    const alive = kernel(false, { m1: { target_name: 'jupyter.widget' } });
    expect((await notebookWidgetSource(reg, session(alive))('m1'))?.renderer).toBe(reg.renderer);
    expect(alive.requestCommInfo).toHaveBeenCalledWith({ target_name: 'jupyter.widget' });

    const restarted = kernel(false, { other: { target_name: 'jupyter.widget' } });
    const reg2 = registry();
    expect(await notebookWidgetSource(reg2, session(restarted))('m1')).toBeNull();
    expect(reg2.createRenderer).not.toHaveBeenCalled();
  });

  it('gives nothing without ipywidgets, without a kernel, or when the kernel does not answer', async () => {
    expect(await notebookWidgetSource(registry(false), session(kernel(true)))('m1')).toBeNull();
    expect(await notebookWidgetSource(registry(), session(null))('m1')).toBeNull();
    expect(await notebookWidgetSource(registry(), session(kernel(false, new Error('kernel died'))))('m1')).toBeNull();
  });

  it('waits for the session to be ready (ipywidgets binds its renderer to the widget manager then)', async () => {
    const reg = registry();
    let ready: () => void = () => undefined;
    const result = notebookWidgetSource(reg, session(kernel(true), new Promise<void>(r => (ready = r))))('m1');
    await mutationsDelivered();
    expect(reg.createRenderer).not.toHaveBeenCalled();
    ready();
    expect((await result)?.renderer).toBe(reg.renderer);
  });

  it('says the model is gone when the kernel restarts, dies or is replaced', async () => {
    for (const [event, status] of [['statusChanged', 'restarting'], ['statusChanged', 'autorestarting'], ['statusChanged', 'dead'], ['disposed', undefined]] as const) {
      const k = kernel(true);
      const hosted = (await notebookWidgetSource(registry(), session(k))('m1'))!;
      let gone = false;
      void hosted.gone.then(() => (gone = true));
      k.statusChanged.emit('busy');
      await mutationsDelivered();
      expect(gone).toBe(false);
      (k[event] as Signal<any, any>).emit(status);
      await mutationsDelivered();
      expect(gone, `${event} ${status}`).toBe(true);
    }
  });
});
