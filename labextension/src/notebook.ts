/**
 * JupyterLab glue: find the notebook and cell that own an output, insert a code cell
 * directly below it, optionally run it.
 */
import { INotebookTracker, NotebookActions, NotebookPanel } from '@jupyterlab/notebook';

import { Fallback, InsertHost } from './comm';
import { CellLike, OutputLike, OwnerTarget, findOwningCell } from './owner';

/** The notebook's cells as the pure lookup sees them (outputs from the models, DOM nodes). */
export function cellsOf(panel: NotebookPanel): CellLike[] {
  const notebook = panel.content;
  const cells = notebook.model?.cells;
  const out: CellLike[] = [];
  if (!cells) {
    return out;
  }
  for (let i = 0; i < cells.length; i++) {
    const model = cells.get(i) as unknown as {
      type: string;
      outputs?: { length: number; get(j: number): OutputLike };
    };
    const outputs: OutputLike[] = [];
    if (model.type === 'code' && model.outputs) {
      for (let j = 0; j < model.outputs.length; j++) {
        outputs.push(model.outputs.get(j));
      }
    }
    out.push({ outputs, node: notebook.widgets[i]?.node ?? null });
  }
  return out;
}

/**
 * Insert `code` as a new code cell at index + 1 and make it the active cell; run it if asked.
 * With `waitForRun` false the returned promise resolves once the run is queued, not finished.
 */
export async function insertCodeCellBelow(
  panel: NotebookPanel,
  index: number,
  code: string,
  run: boolean,
  waitForRun = true
): Promise<void> {
  const notebook = panel.content;
  const model = notebook.model;
  if (!model) {
    throw new Error('the notebook has no model yet');
  }
  if (model.readOnly) {
    throw new Error('the notebook is read-only');
  }
  model.sharedModel.insertCell(index + 1, { cell_type: 'code', source: code, metadata: {} });
  notebook.activeCellIndex = index + 1;
  notebook.deselectAll();
  if (run) {
    // Runs the active (new) cell only: NotebookActions.run runs the selection or active cell.
    const ran = NotebookActions.run(notebook, panel.sessionContext);
    if (waitForRun) {
      await ran;
    }
  }
}

/** The notebook panel whose DOM contains `node`. */
export function panelContaining(tracker: INotebookTracker, node: Node): NotebookPanel | null {
  return tracker.find(panel => panel.node.contains(node)) ?? null;
}

/** Insert below the cell owning an output shown in `panel`; throws when no cell owns it. */
export async function insertBelowOwner(
  panel: NotebookPanel,
  target: OwnerTarget,
  code: string,
  run: boolean
): Promise<void> {
  const match = findOwningCell(cellsOf(panel), target);
  if (!match) {
    throw new Error('the cell that owns this output is no longer in the notebook');
  }
  await insertCodeCellBelow(panel, match.index, code, run);
}

/** The comm's view of one notebook: insert below the output with an output_id, or fall back. */
export function notebookHost(panel: NotebookPanel): InsertHost {
  return {
    async insert(code, outputId, run) {
      const match = outputId ? findOwningCell(cellsOf(panel), { outputId }) : null;
      let index: number;
      let fallback: Fallback = null;
      if (match) {
        index = match.index;
      } else {
        const executing = runningCellIndex(panel);
        fallback = executing >= 0 ? 'executing-cell' : 'active-cell';
        index = executing >= 0 ? executing : panel.content.activeCellIndex;
      }
      // Not waiting for the run: the reply must not wait on the kernel that asked (see comm.ts).
      await insertCodeCellBelow(panel, index, code, run, false);
      return { fallback };
    }
  };
}

function runningCellIndex(panel: NotebookPanel): number {
  const cells = panel.content.model?.cells;
  if (!cells) {
    return -1;
  }
  for (let i = 0; i < cells.length; i++) {
    const state = (cells.get(i) as unknown as { executionState?: string }).executionState;
    if (state === 'running') {
      return i;
    }
  }
  return -1;
}
