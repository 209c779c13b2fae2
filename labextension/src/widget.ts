/** The MIME renderer widget: read the payload, lay out its view, wire the fix buttons, host a live widget view. */
import { IRenderMime } from '@jupyterlab/rendermime-interfaces';
import { Panel, Widget } from '@lumino/widgets';

import { DocumentError, InvalidDocumentError, MIME_TYPE, readPayload } from './document';
import { FixInserter, renderPayload } from './render';
import { WidgetHost, WidgetRendererSource, widgetModelId } from './widgethost';

// Ahead of text/html (50): JupyterLab shows this view, not the bundle's static HTML fallback.
export const RENDERER_RANK = 0;
// In notebooks also ahead of ipywidgets' renderer (-10): this renderer hosts the bundle's widget
// view itself, and only while the widget's model is alive (widgethost.ts).
export const HOSTING_RANK = -20;

/** Given the renderer and the model it shows, an inserter for its fix buttons (or null). */
export type InserterFactory = (renderer: Widget, model: IRenderMime.IMimeModel, outputId: string | null) => FixInserter | null;

export class NbguardRenderer extends Panel implements IRenderMime.IRenderer {
  constructor(
    private readonly inserterFor: InserterFactory,
    private readonly widgetSource: WidgetRendererSource | null = null
  ) {
    super();
    this.addClass('nbg-renderer');
  }

  async renderModel(model: IRenderMime.IMimeModel): Promise<void> {
    const view = new Widget();
    view.addClass('nbg-static');
    view.node.append(this.draw(model));
    // Only trusted outputs may host a widget: ipywidgets' renderer is not a safe one.
    const modelId = this.widgetSource && model.trusted ? widgetModelId(model.data) : null;
    const current = this.widgets[0];
    if (modelId && current instanceof WidgetHost && current.modelId === modelId) {
      current.setStaticView(view); // an updated display of the same widget: keep its live view
      return;
    }
    for (const child of [...this.widgets]) {
      child.dispose();
    }
    if (!modelId) {
      this.addWidget(view);
      return;
    }
    const host = new WidgetHost(modelId, view);
    this.addWidget(host);
    host.hostWidget(this.widgetSource!, model).catch(reason => console.warn('nbguard: cannot host the widget view', reason));
  }

  private draw(model: IRenderMime.IMimeModel): HTMLElement {
    try {
      const payload = readPayload(model.data[MIME_TYPE]);
      const outputId = typeof payload.doc.output_id === 'string' ? payload.doc.output_id : null;
      return renderPayload(payload, { insertFix: this.inserterFor(this, model, outputId), trusted: model.trusted });
    } catch (error) {
      // inert: one line of text, no button, no style from the payload
      const content = document.createElement('div');
      content.className = error instanceof InvalidDocumentError ? 'nbg-render-error nbg-invalid' : 'nbg-render-error';
      content.textContent =
        error instanceof DocumentError ? error.message : `nbguard: could not render this output (${String(error)})`;
      return content;
    }
  }
}

/** The renderer factory; with a widget source (a notebook's), it hosts widget views and outranks ipywidgets. */
export function rendererFactory(inserterFor: InserterFactory, widgetSource: WidgetRendererSource | null = null): IRenderMime.IRendererFactory {
  return {
    safe: true, // built from text nodes only: fine for untrusted notebooks
    mimeTypes: [MIME_TYPE],
    defaultRank: widgetSource ? HOSTING_RANK : RENDERER_RANK,
    createRenderer: () => new NbguardRenderer(inserterFor, widgetSource)
  };
}
