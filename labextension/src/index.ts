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
import { insertBelowOwner, notebookHost, panelContaining } from './notebook';
import { InserterFactory, RENDERER_RANK, rendererFactory } from './widget';
import { notebookWidgetSource } from './widgethost';

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
        // an untrusted output never runs a cell, whatever the button asked (render.ts offers no such button)
        await insertBelowOwner(panel, { output: model, outputId, node: renderer.node }, code, run && model.trusted);
      };
    };
    // Outside notebooks (consoles, output views): below ipywidgets' renderer, as before.
    rendermime.addFactory(rendererFactory(inserterFor), RENDERER_RANK);

    const setUp = (panel: NotebookPanel) => {
      // Each notebook's registry gets a renderer that hosts the notebook's live widget views
      // (replacing the one cloned from the application's registry, if any).
      const registry = panel.content.rendermime;
      const factory = rendererFactory(inserterFor, notebookWidgetSource(registry, panel.sessionContext));
      registry.addFactory(factory, factory.defaultRank);
      const host = notebookHost(panel);
      const attach = (kernel: Kernel.IKernelConnection | null | undefined) => {
        if (kernel) {
          registerCommTarget(kernel, host);
        }
      };
      attach(panel.sessionContext.session?.kernel);
      panel.sessionContext.kernelChanged.connect((_, change) => attach(change.newValue));
    };
    tracker.forEach(setUp);
    tracker.widgetAdded.connect((_, panel) => setUp(panel));
    console.debug(`nbguard extension activated (${app.name})`);
  }
};

export default plugin;
