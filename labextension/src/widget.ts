/** The MIME renderer widget: parse the document, draw it, wire the fix buttons. */
import { IRenderMime } from '@jupyterlab/rendermime-interfaces';
import { Widget } from '@lumino/widgets';

import { DocumentError, MIME_TYPE, parseDocument } from './document';
import { FixInserter, renderDocument } from './render';

/** Given the renderer and the model it shows, an inserter for its fix buttons (or null). */
export type InserterFactory = (renderer: Widget, model: IRenderMime.IMimeModel, outputId: string | null) => FixInserter | null;

export class NbguardRenderer extends Widget implements IRenderMime.IRenderer {
  constructor(private readonly inserterFor: InserterFactory) {
    super();
    this.addClass('nbg-renderer');
  }

  async renderModel(model: IRenderMime.IMimeModel): Promise<void> {
    let content: HTMLElement;
    try {
      const doc = parseDocument(model.data[MIME_TYPE]);
      content = renderDocument(doc, { insertFix: this.inserterFor(this, model, doc.output_id) });
    } catch (error) {
      content = document.createElement('div');
      content.className = 'nbg-render-error';
      content.textContent =
        error instanceof DocumentError ? error.message : `nbguard: could not render this output (${String(error)})`;
    }
    this.node.replaceChildren(content);
  }
}

export function rendererFactory(inserterFor: InserterFactory): IRenderMime.IRendererFactory {
  return {
    safe: true, // built from text nodes only: fine for untrusted notebooks
    mimeTypes: [MIME_TYPE],
    defaultRank: 0,
    createRenderer: () => new NbguardRenderer(inserterFor)
  };
}
