/**
 * Every saved payload is checked against nbguard/document/schema.json before anything renders it:
 * the same schema the types of src/schema.ts are generated from (src/documentSchema.ts is that
 * file as data). A notebook from someone else can hold any JSON under nbguard's MIME type; the
 * types say what the renderer expects, this module makes the data match them. Strings are strings,
 * enumerations are enumerations, colours match their pattern, objects the view defines closed hold
 * nothing else; a payload that fails is not rendered (widget.ts shows an inert notice).
 *
 * It walks the subset of draft 2020-12 that scripts/schema-types.mjs accepts (the generator fails
 * on anything else, and so does this walker): $ref to $defs or a root property, const, enum, oneOf,
 * type, properties/required/additionalProperties, items, minItems, maxItems, minimum, pattern.
 *
 * Beyond the schema, two rules the Python side keeps in code:
 * - an event's kind (the $def eventKind) is any registered kind: schema.json lists nbguard's own,
 *   generated from the registry, and a user's detector registers more at run time
 *   (nbguard/document/schema.py adds them to its enum), so here it is any short lower-case name;
 * - a fix id is a plain word (text.ts isPlainId): it is quoted in the confirmation's warning and
 *   selected by, so no bidirectional, invisible or control character may hide in it.
 */
import { DOCUMENT_SCHEMA } from './documentSchema';
import { isPlainId } from './text';

/** Where a payload first differs from the schema, and how; never quotes the offending value. */
export interface Invalid {
  path: string;
  message: string;
}

type Node = Record<string, unknown>;

const SUPPORTED = new Set([
  '$schema', '$id', '$ref', '$defs', 'title', 'description', 'type', 'const', 'enum', 'oneOf',
  'properties', 'required', 'additionalProperties', 'items', 'minItems', 'maxItems', 'minimum', 'pattern'
]);

// Checks of one $def's property beyond what the schema says (see the module comment).
const EXTRA: Record<string, Record<string, (value: unknown) => string | null>> = {
  fixView: {
    id: value =>
      typeof value === 'string' && !isPlainId(value)
        ? 'a fix id must be one plain word (no control, bidirectional, invisible or space character)'
        : null
  }
};

const has = (object: object, key: string) => Object.prototype.hasOwnProperty.call(object, key);

function isObject(value: unknown): value is Node {
  return typeof value === 'object' && value !== null && !Array.isArray(value);
}

/** The $def of the event kinds (nbguard/document/schema.py's EVENT_KIND_DEF). */
const EVENT_KIND_DEF = 'eventKind';

function isEventKind(value: unknown): boolean {
  // as register_event_kind requires: non-empty, lower-case, no space; and a plain word
  return typeof value === 'string' && value === value.trim().toLowerCase() && isPlainId(value);
}

function describe(value: unknown): string {
  return JSON.stringify(value);
}

function typeMatches(type: unknown, value: unknown): boolean {
  switch (type) {
    case 'string':
      return typeof value === 'string';
    case 'number':
      return typeof value === 'number' && Number.isFinite(value);
    case 'integer':
      return typeof value === 'number' && Number.isInteger(value);
    case 'boolean':
      return typeof value === 'boolean';
    case 'null':
      return value === null;
    case 'array':
      return Array.isArray(value);
    case 'object':
      return isObject(value);
    default:
      throw new Error(`validate: unsupported type ${describe(type)}`);
  }
}

/** A path as a reader would write it: view.sections[0].cards[2].tone; odd keys quoted and escaped. */
function join(path: string, key: string | number): string {
  if (typeof key === 'number') {
    return `${path}[${key}]`;
  }
  if (/^[A-Za-z_][A-Za-z0-9_]*$/.test(key)) {
    return path ? `${path}.${key}` : key;
  }
  // JSON-quoted, and every character outside printable ASCII escaped: a key cannot garble the notice
  const quoted = JSON.stringify(key.length > 40 ? `${key.slice(0, 40)}...` : key);
  return `${path}[${quoted.replace(/[^\x20-\x7E]/g, c => `\\u${c.charCodeAt(0).toString(16).padStart(4, '0')}`)}]`;
}

export class SchemaValidator {
  private readonly patterns = new Map<string, RegExp>();

  constructor(private readonly root: Node) {}

  /** The first place `value` breaks the schema, or null when it follows it. */
  validate(value: unknown): Invalid | null {
    return this.check(this.root, value, '', null);
  }

  private resolve(ref: string): { node: Node; def: string | null } {
    const def = /^#\/\$defs\/([^/]+)$/.exec(ref);
    const defs = this.root.$defs as Node | undefined;
    if (def && defs && has(defs, def[1]) && isObject(defs[def[1]])) {
      return { node: defs[def[1]] as Node, def: def[1] };
    }
    const property = /^#\/properties\/([^/]+)$/.exec(ref);
    const properties = this.root.properties as Node | undefined;
    if (property && properties && has(properties, property[1]) && isObject(properties[property[1]])) {
      return { node: properties[property[1]] as Node, def: null };
    }
    throw new Error(`validate: cannot resolve ${ref}`);
  }

  private pattern(source: string): RegExp {
    let re = this.patterns.get(source);
    if (!re) {
      re = new RegExp(source, 'u');
      this.patterns.set(source, re);
    }
    return re;
  }

  private check(node: Node, value: unknown, path: string, def: string | null): Invalid | null {
    for (const key of Object.keys(node)) {
      if (!SUPPORTED.has(key)) {
        throw new Error(`validate: unsupported keyword ${describe(key)} at schema node for ${path || 'the payload'}`);
      }
    }
    const at = (message: string): Invalid => ({ path: path || '(the payload)', message });
    if (typeof node.$ref === 'string') {
      const target = this.resolve(node.$ref);
      return this.check(target.node, value, path, target.def);
    }
    if (has(node, 'const') && value !== node.const) {
      return at(`expected ${describe(node.const)}`);
    }
    if (Array.isArray(node.enum)) {
      if (def === EVENT_KIND_DEF) {
        if (!isEventKind(value)) {
          return at('expected an event kind (a short lower-case name)');
        }
      } else if (!node.enum.some(option => option === value)) {
        return at(`expected one of ${node.enum.map(describe).join(', ')}`);
      }
    }
    if (Array.isArray(node.oneOf)) {
      const matched = node.oneOf.filter(option => this.check(option as Node, value, path, def) === null).length;
      if (matched !== 1) {
        // the reason of the option whose type fits, when one does; else a summary
        const fitting = node.oneOf.find(option => isObject(option) && this.fitsType(option as Node, value));
        const reason = fitting ? this.check(fitting as Node, value, path, def) : null;
        return reason ?? at(matched ? 'matches more than one of the allowed forms' : 'is none of the allowed forms');
      }
    }
    if (node.type !== undefined) {
      const types = Array.isArray(node.type) ? node.type : [node.type];
      if (!types.some(type => typeMatches(type, value))) {
        return at(`expected ${types.map(t => (t === 'null' ? 'null' : `a${/^[aeiou]/.test(String(t)) ? 'n' : ''} ${t}`)).join(' or ')}`);
      }
    }
    if (typeof value === 'string' && typeof node.pattern === 'string' && !this.pattern(node.pattern).test(value)) {
      return at(`does not match ${node.pattern}`);
    }
    if (typeof value === 'number' && typeof node.minimum === 'number' && value < node.minimum) {
      return at(`expected at least ${node.minimum}`);
    }
    if (Array.isArray(value)) {
      if (typeof node.minItems === 'number' && value.length < node.minItems) {
        return at(`expected at least ${node.minItems} items`);
      }
      if (typeof node.maxItems === 'number' && value.length > node.maxItems) {
        return at(`expected at most ${node.maxItems} items`);
      }
      if (isObject(node.items)) {
        for (let i = 0; i < value.length; i++) {
          const invalid = this.check(node.items, value[i], join(path, i), null);
          if (invalid) {
            return invalid;
          }
        }
      }
    }
    if (isObject(value)) {
      const invalid = this.checkObject(node, value, path, def);
      if (invalid) {
        return invalid;
      }
    }
    return null;
  }

  /** Whether `value` has a type `option` allows (to pick which oneOf option's reason to report). */
  private fitsType(option: Node, value: unknown): boolean {
    const target = typeof option.$ref === 'string' ? this.resolve(option.$ref).node : option;
    if (target.type === undefined) {
      return Array.isArray(target.enum) && target.enum.some(v => typeof v === typeof value);
    }
    const types = Array.isArray(target.type) ? target.type : [target.type];
    return types.some(type => typeMatches(type, value));
  }

  private checkObject(node: Node, value: Node, path: string, def: string | null): Invalid | null {
    const properties = isObject(node.properties) ? node.properties : {};
    for (const name of Array.isArray(node.required) ? node.required : []) {
      if (!has(value, String(name))) {
        return { path: path || '(the payload)', message: `missing ${describe(name)}` };
      }
    }
    const extra = node.additionalProperties;
    for (const key of Object.keys(value)) {
      const where = join(path, key);
      if (has(properties, key)) {
        const invalid = this.check(properties[key] as Node, value[key], where, null);
        if (invalid) {
          return invalid;
        }
        const rule = def && has(EXTRA, def) && has(EXTRA[def], key) ? EXTRA[def][key] : null;
        const message = rule ? rule(value[key]) : null;
        if (message) {
          return { path: where, message };
        }
      } else if (extra === false) {
        return { path: where, message: 'is not a field of this object' };
      } else if (isObject(extra)) {
        const invalid = this.check(extra, value[key], where, null);
        if (invalid) {
          return invalid;
        }
      }
    }
    return null;
  }
}

let documentValidator: SchemaValidator | null = null;

/** Where a payload breaks nbguard's document schema v1, or null when it follows it. */
export function validateDocument(value: unknown): Invalid | null {
  documentValidator ??= new SchemaValidator(DOCUMENT_SCHEMA as Node);
  return documentValidator.validate(value);
}
