/**
 * nbguard's JupyterLab 4 / Notebook 7 extension: a renderer for
 * application/vnd.nbguard.v1+json whose buttons insert fix cells below the owning cell,
 * and the "nbguard" comm target through which kernel-side widgets do the same.
 */
import { JupyterFrontEnd, JupyterFrontEndPlugin } from '@jupyterlab/application';
import { INotebookTracker, NotebookPanel } from '@jupyterlab/notebook';
import { IRenderMimeRegistry } from '@jupyterlab/rendermime';
import { Kernel } from '@jupyterlab/services';

import { registerCommTarget } from './comm';
import { MIME_TYPE } from './document';
import { insertBelowOwner, notebookHost, panelContaining } from './notebook';
import { InserterFactory, rendererFactory } from './widget';

// Preferred over text/html (rank 50) so JupyterLab shows this view, not the static fallback.
export const RENDERER_RANK = 0;

const plugin: JupyterFrontEndPlugin<void> = {
  id: 'nbguard:plugin',
  description: 'Renders nbguard reports and inserts fix cells below the cell that owns them.',
  autoStart: true,
  requires: [IRenderMimeRegistry, INotebookTracker],
  activate: (app: JupyterFrontEnd, rendermime: IRenderMimeRegistry, tracker: INotebookTracker) => {
    const inserterFor: InserterFactory = (renderer, model, outputId) => {
      return async (code, run) => {
        const panel = panelContaining(tracker, renderer.node);
        if (!panel) {
          throw new Error('this output is not inside a notebook');
        }
        await insertBelowOwner(panel, { output: model, outputId, node: renderer.node }, code, run);
      };
    };
    const factory = rendererFactory(inserterFor);
    rendermime.addFactory(factory, RENDERER_RANK);

    tracker.widgetAdded.connect((_, panel: NotebookPanel) => {
      // A panel cloned its registry before this plugin ran would lack the renderer.
      if (!panel.content.rendermime.mimeTypes.includes(MIME_TYPE)) {
        panel.content.rendermime.addFactory(factory, RENDERER_RANK);
      }
      const host = notebookHost(panel);
      const attach = (kernel: Kernel.IKernelConnection | null | undefined) => {
        if (kernel) {
          registerCommTarget(kernel, host);
        }
      };
      attach(panel.sessionContext.session?.kernel);
      panel.sessionContext.kernelChanged.connect((_, change) => attach(change.newValue));
    });
    console.debug(`nbguard extension activated (${app.name})`);
  }
};

export default plugin;
