/**
 * The confirmation an untrusted notebook's "Insert cell" goes through: the whole cell, wrapped (a
 * harmless first statement cannot hide `; open(...)` 400 spaces to the right), and the fix id
 * marked as read from a saved file, not produced by this kernel. Plain DOM, no markup from data.
 *
 * `code` is the exact string that is inserted if the user says yes (render.ts passes the one string
 * cellSource made): the box's textContent is that string, its bidirectional and invisible characters
 * marked and isolated (text.ts), so nothing in it can reorder or hide what is drawn. The id sits in
 * its own isolated element, marked the same way (the schema check already refuses such an id).
 */
import { setText } from './text';

export interface SavedFix {
  id: string;
  code: string;
}

/** Resolves true when the user chose to insert the cell (it is never run from here). */
export function confirmSavedFix(fix: SavedFix): Promise<boolean> {
  return new Promise(resolve => {
    const overlay = document.createElement('div');
    overlay.className = 'nbg-confirm-overlay';
    const dialog = document.createElement('div');
    dialog.className = 'nbg-confirm';
    dialog.setAttribute('role', 'dialog');
    dialog.setAttribute('aria-modal', 'true');
    const title = document.createElement('h3');
    title.textContent = 'Insert a cell from a saved, untrusted output?';
    const note = document.createElement('p');
    note.className = 'nbg-confirm-note';
    const id = setText(document.createElement('code'), fix.id);
    id.className = 'nbg-confirm-id';
    id.dir = 'ltr';
    id.style.unicodeBidi = 'isolate'; // whatever the id holds, the sentence around it reads in order
    note.append(
      'The fix "',
      id,
      '" and its code come from a saved file, not from your kernel: anyone who edited the notebook could have ' +
        'written them. Read the whole cell below before inserting it. It will not be run.'
    );
    const code = document.createElement('pre');
    code.className = 'nbg-code nbg-confirm-code';
    wrapCode(code);
    setText(code, fix.code);
    const actions = document.createElement('div');
    actions.className = 'nbg-confirm-actions';
    const insert = document.createElement('button');
    insert.className = 'nbg-confirm-insert';
    insert.textContent = 'Insert cell (not run)';
    const cancel = document.createElement('button');
    cancel.className = 'nbg-confirm-cancel';
    cancel.textContent = 'Cancel';
    const close = (answer: boolean) => () => {
      overlay.remove();
      resolve(answer);
    };
    insert.addEventListener('click', close(true));
    cancel.addEventListener('click', close(false));
    actions.append(insert, cancel);
    dialog.append(title, note, code, actions);
    overlay.appendChild(dialog);
    document.body.appendChild(overlay);
    cancel.focus();
  });
}

/** Code boxes wrap: no sideways scroll can hide the end of a line. */
export function wrapCode(pre: HTMLElement): void {
  pre.style.whiteSpace = 'pre-wrap';
  pre.style.overflowWrap = 'anywhere';
  pre.style.overflowX = 'hidden';
}
