/**
 * The "nbguard" comm between the kernel and this extension.
 *
 * The protocol is defined once, in nbguard/document/comm.schema.json; its messages are typed in
 * src/commSchema.ts, generated from that file (npm run schema), and the kernel side
 * (nbguard/notebook/comm.py) is tested against the same schema (tests/test_document_schema.py).
 * In short: the kernel opens the comm with a KernelHello and we answer a FrontendHello; it sends
 * InsertCell, and we insert the code below the cell whose outputs hold the document with that
 * output_id (else below the executing, else the active, cell, saying so), run it when asked, and
 * reply Inserted or ErrorReply.
 */
import type { Fallback, FrontendMessage } from './commSchema';
import { isObject } from './document';
import { EXTENSION_VERSION } from './version';

export type { Fallback } from './commSchema';

export const COMM_TARGET = 'nbguard';

/** What the extension sends back on the comm: one of the schema's front-end messages. */
export type CommReply = FrontendMessage;

/** What the comm needs from the notebook it serves. */
export interface InsertHost {
  insert(code: string, outputId: string | null, run: boolean): Promise<{ fallback: Fallback }>;
}

export async function handleCommMessage(data: unknown, host: InsertHost): Promise<CommReply> {
  if (!isObject(data) || typeof data.action !== 'string') {
    return { action: 'error', message: 'nbguard comm: a message needs a string "action"' };
  }
  switch (data.action) {
    case 'hello':
      return { action: 'hello', extension_version: EXTENSION_VERSION };
    case 'insert-cell': {
      if (typeof data.code !== 'string') {
        return { action: 'error', message: 'nbguard comm: insert-cell needs a string "code"' };
      }
      if (data.run !== undefined && typeof data.run !== 'boolean') {
        return { action: 'error', message: 'nbguard comm: insert-cell "run" must be true or false' };
      }
      const outputId = typeof data.output_id === 'string' ? data.output_id : null;
      try {
        const { fallback } = await host.insert(data.code, outputId, data.run === true);
        const reply: CommReply = { action: 'inserted', output_id: outputId, fallback };
        if (fallback) {
          reply.message =
            `no output with output_id ${JSON.stringify(outputId)} in this notebook; ` +
            `inserted below the ${fallback === 'executing-cell' ? 'executing' : 'active'} cell instead`;
        }
        return reply;
      } catch (error) {
        const message = error instanceof Error ? error.message : String(error);
        return { action: 'error', output_id: outputId, message };
      }
    }
    default:
      return { action: 'error', message: `nbguard comm: unknown action ${JSON.stringify(data.action)}` };
  }
}

/** The parts of a kernel connection and comm this module uses (structural, for tests). */
export interface CommLike {
  send(data: any): unknown;
  onMsg: ((msg: { content: { data: unknown } }) => void | PromiseLike<void>) | null;
}

export interface KernelLike {
  registerCommTarget(
    target: string,
    callback: (comm: any, msg: { content: { data: unknown } }) => void | PromiseLike<void>
  ): void;
}

const registered = new WeakSet<object>();

/**
 * Register the "nbguard" target on a kernel connection once; replies go back on the same comm.
 *
 * The handlers return at once and answer later: the kernel connection processes incoming
 * messages one after another and awaits each comm handler, so a handler that waited for the
 * inserted cell to run would wait for messages queued behind itself (a deadlock: the kernel's
 * own idle status and outputs would never be handled).
 */
export function registerCommTarget(kernel: KernelLike, host: InsertHost): boolean {
  if (registered.has(kernel)) {
    return false;
  }
  registered.add(kernel);
  kernel.registerCommTarget(COMM_TARGET, (comm: CommLike, msg) => {
    const answer = (data: unknown) => {
      void handleCommMessage(data, host).then(reply => comm.send(reply));
    };
    comm.onMsg = message => answer(message.content.data);
    answer(msg.content.data);
  });
  return true;
}
