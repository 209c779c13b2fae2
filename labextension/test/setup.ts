// jsdom lacks DragEvent, which @lumino/dragdrop (imported by @lumino/widgets) subclasses at load.
if (typeof globalThis.DragEvent === 'undefined') {
  (globalThis as any).DragEvent = class DragEvent extends MouseEvent {};
}
