/**
 * Hosting nbguard's live ipywidgets view inside nbguard's own renderer.
 *
 * nbguard's kernel side displays ONE output carrying both the nbguard document and a widget view
 * (application/vnd.jupyter.widget-view+json). In a notebook nbguard's renderer is preferred over
 * ipywidgets' (see HOSTING_RANK in widget.ts) and shows the widget in its place only while the
 * widget's model is alive; otherwise (saved notebook, restarted kernel, no ipywidgets) it shows
 * its static view of the document, never ipywidgets' "Error displaying widget: model not found".
 */
import { IRenderMime } from '@jupyterlab/rendermime-interfaces';
import { Kernel } from '@jupyterlab/services';
import { Panel, Widget } from '@lumino/widgets';

export const WIDGET_VIEW_MIME = 'application/vnd.jupyter.widget-view+json';
// ipywidgets' comm target: a widget model's comm id is its model id.
const WIDGET_COMM_TARGET = 'jupyter.widget';

/** The model id of a bundle's widget view, or null when it has none. */
export function widgetModelId(data: IRenderMime.IMimeModel['data']): string | null {
  const view = data[WIDGET_VIEW_MIME] as { model_id?: unknown } | null | undefined;
  const id = view && typeof view === 'object' ? view.model_id : undefined;
  return typeof id === 'string' && id !== '' ? id : null;
}

/**
 * Whether ipywidgets' renderer node shows a live view. That renderer writes its states
 * ("Loading widget...", "Error displaying widget: model not found") as text straight into its
 * node, mounts a live view as a child element, and is left empty when the view is closed.
 */
export function showsLiveWidget(node: Element): boolean {
  let element = false;
  for (const child of Array.from(node.childNodes)) {
    if (child.nodeType === Node.TEXT_NODE && (child.textContent ?? '').trim() !== '') {
      return false;
    }
    element = element || child.nodeType === Node.ELEMENT_NODE;
  }
  return element;
}

/** A widget renderer for a live model, and when the model is gone (its kernel restarted, changed or died). */
export interface HostedWidget {
  readonly renderer: IRenderMime.IRenderer;
  readonly gone: Promise<void>;
}

/** The hosted widget for a model id while that model is alive, else null. */
export type WidgetRendererSource = (modelId: string) => Promise<HostedWidget | null>;

type WidgetKernel = Pick<Kernel.IKernelConnection, 'hasComm' | 'requestCommInfo' | 'statusChanged' | 'disposed'>;

/** What a source needs from a notebook: its rendermime registry and its session context. */
export interface WidgetRegistry {
  readonly mimeTypes: ReadonlyArray<string>;
  createRenderer(mimeType: string): IRenderMime.IRenderer;
}
export interface WidgetSession {
  readonly ready: Promise<void>;
  readonly session: { readonly kernel: WidgetKernel | null } | null;
}

/** Widget renderers from a notebook's registry, where jupyterlab-manager binds them to its widget manager. */
export function notebookWidgetSource(registry: WidgetRegistry, session: WidgetSession): WidgetRendererSource {
  return async modelId => {
    await session.ready;
    // jupyterlab-manager replaces the notebook's widget-view factory (by one bound to the
    // notebook's widget manager) in promise callbacks after `ready`: one task later it is there.
    await new Promise(resolve => setTimeout(resolve, 0));
    const kernel = session.session?.kernel;
    if (!kernel || !registry.mimeTypes.includes(WIDGET_VIEW_MIME) || !(await modelAlive(kernel, modelId))) {
      return null;
    }
    return { renderer: registry.createRenderer(WIDGET_VIEW_MIME), gone: kernelGone(kernel) };
  };
}

/** Resolves when the kernel's widget models are gone: comms do not survive a restart. */
function kernelGone(kernel: WidgetKernel): Promise<void> {
  return new Promise(resolve => {
    const done = () => {
      kernel.statusChanged.disconnect(onStatus);
      kernel.disposed.disconnect(done);
      resolve();
    };
    const onStatus = (_: unknown, status: Kernel.Status) => {
      if (status === 'restarting' || status === 'autorestarting' || status === 'dead') {
        done();
      }
    };
    kernel.statusChanged.connect(onStatus);
    kernel.disposed.connect(done);
  });
}

/**
 * Whether the kernel still holds the widget model. Asked before rendering, so ipywidgets' renderer
 * never meets a dead model (its "model not found" text and console error).
 */
async function modelAlive(kernel: WidgetKernel, modelId: string): Promise<boolean> {
  if (kernel.hasComm(modelId)) {
    return true; // opened while this page listened: the live case, no round trip
  }
  try {
    const reply = await kernel.requestCommInfo({ target_name: WIDGET_COMM_TARGET });
    return reply.content.status === 'ok' && modelId in reply.content.comms;
  } catch {
    return false; // no answer (kernel gone): nothing to host
  }
}

/** The static view, plus the widget renderer once hosted: exactly one of them is shown. */
export class WidgetHost extends Panel {
  private widgetView: Widget | null = null;
  private widgetGone = false;
  private observer: MutationObserver | null = null;

  constructor(readonly modelId: string, private staticView: Widget) {
    super();
    this.addClass('nbg-widget-host');
    this.addWidget(staticView);
  }

  /** Replace the static view (an updated display of the same widget), keeping the hosted widget. */
  setStaticView(view: Widget): void {
    const old = this.staticView;
    this.staticView = view;
    this.insertWidget(0, view);
    old.dispose();
    this.sync();
  }

  /** Ask `source` for the widget renderer; mount it, hidden until it shows a live view, and render `model`. */
  async hostWidget(source: WidgetRendererSource, model: IRenderMime.IMimeModel): Promise<void> {
    const hosted = await source(this.modelId);
    if (!hosted || this.isDisposed) {
      hosted?.renderer.dispose();
      return;
    }
    const renderer = hosted.renderer;
    renderer.hide();
    this.addWidget(renderer);
    this.widgetView = renderer;
    // A view that appears later (widget manager restored) replaces the static view; a closed view
    // or an error text brings the static view back.
    this.observer = new MutationObserver(() => this.sync());
    this.observer.observe(renderer.node, { childList: true });
    renderer.renderModel(model).catch(reason => console.warn('nbguard: the widget view did not render', reason));
    // ipywidgets keeps showing a view whose model died with its kernel: the static view replaces it.
    void hosted.gone.then(() => {
      this.widgetGone = true;
      this.sync();
    });
  }

  get showsWidget(): boolean {
    return this.widgetView !== null && !this.widgetView.isHidden;
  }

  dispose(): void {
    this.observer?.disconnect();
    super.dispose();
  }

  private sync(): void {
    if (this.isDisposed || !this.widgetView) {
      return;
    }
    const live = !this.widgetGone && showsLiveWidget(this.widgetView.node);
    this.staticView.setHidden(live); // both in one synchronous step: never both shown
    this.widgetView.setHidden(!live);
  }
}
