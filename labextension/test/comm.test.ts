import { readFileSync } from 'fs';
import { join } from 'path';
import { describe, expect, it, vi } from 'vitest';

import { COMM_TARGET, CommLike, InsertHost, handleCommMessage, registerCommTarget } from '../src/comm';
import { EXTENSION_VERSION } from '../src/version';

const packageVersion = JSON.parse(readFileSync(join(__dirname, '..', 'package.json'), 'utf8')).version;

function host(fallback: 'executing-cell' | 'active-cell' | null = null): InsertHost & { insert: ReturnType<typeof vi.fn> } {
  return { insert: vi.fn().mockResolvedValue({ fallback }) };
}

describe('handleCommMessage', () => {
  it('answers hello with the extension version from package.json', async () => {
    expect(EXTENSION_VERSION).toBe(packageVersion);
    expect(await handleCommMessage({ action: 'hello', nbguard_version: '0.1.0' }, host())).toEqual({
      action: 'hello',
      extension_version: packageVersion
    });
  });

  it('inserts below the output with that output_id and says where', async () => {
    const h = host();
    const reply = await handleCommMessage({ action: 'insert-cell', code: 'x = 1', output_id: 'o1', run: true }, h);
    expect(h.insert).toHaveBeenCalledWith('x = 1', 'o1', true);
    expect(reply).toEqual({ action: 'inserted', output_id: 'o1', fallback: null });
  });

  it('reports a fallback to the active cell', async () => {
    const reply = await handleCommMessage({ action: 'insert-cell', code: 'x = 1', output_id: 'gone' }, host('active-cell'));
    expect(reply).toMatchObject({ action: 'inserted', output_id: 'gone', fallback: 'active-cell' });
    expect((reply as { message: string }).message).toContain('inserted below the active cell instead');
  });

  it('runs only when asked', async () => {
    const h = host();
    await handleCommMessage({ action: 'insert-cell', code: 'y = 2', output_id: 'o1' }, h);
    expect(h.insert).toHaveBeenCalledWith('y = 2', 'o1', false);
  });

  it('answers bad messages with an error naming the problem', async () => {
    const h = host();
    expect(await handleCommMessage({ action: 'insert-cell', output_id: 'o1' }, h)).toEqual({
      action: 'error',
      message: 'nbguard comm: insert-cell needs a string "code"'
    });
    expect(await handleCommMessage({ action: 'insert-cell', code: 'x', run: 'yes' }, h)).toMatchObject({ action: 'error' });
    expect(await handleCommMessage({ action: 'explode' }, h)).toEqual({
      action: 'error',
      message: 'nbguard comm: unknown action "explode"'
    });
    expect(await handleCommMessage('hello', h)).toMatchObject({ action: 'error' });
    expect(h.insert).not.toHaveBeenCalled();
  });

  it('turns a failed insertion into an error reply', async () => {
    const h: InsertHost = { insert: vi.fn().mockRejectedValue(new Error('the notebook is read-only')) };
    expect(await handleCommMessage({ action: 'insert-cell', code: 'x', output_id: 'o1' }, h)).toEqual({
      action: 'error',
      output_id: 'o1',
      message: 'the notebook is read-only'
    });
  });
});

describe('registerCommTarget', () => {
  function fakeKernel() {
    const targets = new Map<string, (comm: CommLike, msg: { content: { data: unknown } }) => unknown>();
    return { targets, registerCommTarget: vi.fn((name: string, cb: any) => targets.set(name, cb)) };
  }

  it('replies to hello on the opening comm, then serves insert-cell on the same comm', async () => {
    const kernel = fakeKernel();
    const h = host();
    expect(registerCommTarget(kernel, h)).toBe(true);
    const open = kernel.targets.get(COMM_TARGET)!;
    const comm: CommLike = { send: vi.fn(), onMsg: null };
    await open(comm, { content: { data: { action: 'hello', nbguard_version: '0.1.0' } } });
    await vi.waitFor(() => expect(comm.send).toHaveBeenCalledWith({ action: 'hello', extension_version: packageVersion }));
    await comm.onMsg!({ content: { data: { action: 'insert-cell', code: 'z = 3', output_id: 'o9', run: false } } });
    expect(h.insert).toHaveBeenCalledWith('z = 3', 'o9', false);
    await vi.waitFor(() =>
      expect(comm.send).toHaveBeenLastCalledWith({ action: 'inserted', output_id: 'o9', fallback: null })
    );
  });

  it('never makes the kernel connection wait for an insertion to finish', async () => {
    // The connection awaits each comm handler before handling the next kernel message; an
    // insertion waits for that kernel (its cell must run), so the handler must not wait for it.
    const kernel = fakeKernel();
    let finish: (v: { fallback: null }) => void = () => undefined;
    const slow: InsertHost = { insert: vi.fn(() => new Promise<{ fallback: null }>(resolve => { finish = resolve; })) };
    registerCommTarget(kernel, slow);
    const comm: CommLike = { send: vi.fn(), onMsg: null };
    kernel.targets.get(COMM_TARGET)!(comm, { content: { data: { action: 'hello' } } });
    const handled = comm.onMsg!({ content: { data: { action: 'insert-cell', code: 'x', output_id: 'o1', run: true } } });
    expect(handled).toBeUndefined(); // returned at once, nothing for the connection to await
    expect(comm.send).not.toHaveBeenCalledWith(expect.objectContaining({ action: 'inserted' }));
    finish({ fallback: null });
    await vi.waitFor(() => expect(comm.send).toHaveBeenLastCalledWith({ action: 'inserted', output_id: 'o1', fallback: null }));
  });

  it('registers once per kernel connection', () => {
    const kernel = fakeKernel();
    registerCommTarget(kernel, host());
    expect(registerCommTarget(kernel, host())).toBe(false);
    expect(kernel.registerCommTarget).toHaveBeenCalledTimes(1);
  });
});

describe('the replies follow nbguard/document/comm.schema.json', () => {
  const schema = JSON.parse(readFileSync(join(__dirname, '..', '..', 'nbguard', 'document', 'comm.schema.json'), 'utf8'));
  const defs: Record<string, any> = schema.$defs;
  const resolve = (node: any): any => (node.$ref ? defs[node.$ref.split('/').pop()] : node);

  /** The schema's judgement of one value, for the subset comm.schema.json uses. */
  function fits(node: any, value: unknown): boolean {
    node = resolve(node);
    if (node.oneOf) {
      return node.oneOf.filter((option: any) => fits(option, value)).length === 1;
    }
    if ('const' in node) {
      return value === node.const;
    }
    if (node.enum) {
      return node.enum.includes(value);
    }
    const types: string[] = Array.isArray(node.type) ? node.type : [node.type];
    const type = value === null ? 'null' : typeof value === 'object' ? 'object' : typeof value;
    if (!types.includes(type)) {
      return false;
    }
    if (type !== 'object') {
      return true;
    }
    const record = value as Record<string, unknown>;
    const keys = Object.keys(record);
    return (
      (node.required ?? []).every((k: string) => k in record) &&
      keys.every(k => k in (node.properties ?? {}) && fits(node.properties[k], record[k]))
    );
  }

  it('accepts what the schema says and refuses what it does not (the checker itself)', () => {
    expect(fits(defs.frontendMessage, { action: 'inserted', output_id: 'o', fallback: null })).toBe(true);
    expect(fits(defs.frontendMessage, { action: 'inserted', output_id: 'o', fallback: 'elsewhere' })).toBe(false);
    expect(fits(defs.frontendMessage, { action: 'inserted', output_id: 'o' })).toBe(false);
    expect(fits(defs.frontendMessage, { action: 'error', message: 'x', extra: 1 })).toBe(false);
  });

  it('every reply handleCommMessage makes is a front-end message of the schema', async () => {
    const kernelSays = [
      { action: 'hello', nbguard_version: '0.1.0' },
      { action: 'insert-cell', code: 'x = 1', output_id: 'o1', run: true },
      { action: 'insert-cell', code: 'x = 1', output_id: 'o1', run: false }
    ];
    for (const message of kernelSays) {
      expect(fits(defs.kernelMessage, message)).toBe(true);
    }
    const replies = [
      ...(await Promise.all(kernelSays.map(m => handleCommMessage(m, host())))),
      await handleCommMessage(kernelSays[1], host('executing-cell')),
      await handleCommMessage(kernelSays[1], host('active-cell')),
      await handleCommMessage(kernelSays[1], { insert: vi.fn().mockRejectedValue(new Error('read-only')) }),
      await handleCommMessage({ action: 'explode' }, host()),
      await handleCommMessage({ action: 'insert-cell', output_id: 'o1' }, host())
    ];
    for (const reply of replies) {
      expect([reply, fits(defs.frontendMessage, reply)]).toEqual([reply, true]);
    }
  });
});
