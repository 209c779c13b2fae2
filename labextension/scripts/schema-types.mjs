#!/usr/bin/env node
/**
 * Writes the extension's TypeScript types from nbguard's JSON Schemas (Node only, no dependency):
 *
 *   nbguard/document/schema.json      -> src/schema.ts      (the v1 document and its view)
 *   nbguard/document/comm.schema.json -> src/commSchema.ts  (the "nbguard" comm messages)
 *   nbguard/document/schema.json      -> src/documentSchema.ts (the schema itself, as data: what
 *                                        src/validate.ts checks every saved payload against)
 *
 *   node scripts/schema-types.mjs          write both files
 *   node scripts/schema-types.mjs --check  regenerate in memory; exit 1 if a file differs
 *
 * It covers the subset of draft 2020-12 the schemas use: $ref to $defs or to a root property,
 * const, enum, oneOf, type (one or a list), properties/required/additionalProperties, items.
 * Anything else is an error, so a schema change the generator cannot express fails loudly
 * instead of typing it wrongly.
 */
import { readFileSync, writeFileSync } from 'node:fs';
import { dirname, join, relative } from 'node:path';
import { fileURLToPath } from 'node:url';

const HERE = dirname(fileURLToPath(import.meta.url));
const EXTENSION = join(HERE, '..');
const ROOT = join(EXTENSION, '..');

const TARGETS = [
  { schema: 'nbguard/document/schema.json', out: 'labextension/src/schema.ts', root: 'NbguardDocument' },
  { schema: 'nbguard/document/comm.schema.json', out: 'labextension/src/commSchema.ts', root: 'CommMessage' },
  { schema: 'nbguard/document/schema.json', out: 'labextension/src/documentSchema.ts', data: 'DOCUMENT_SCHEMA' }
];

// $defs whose plain PascalCase name would shadow a global (Number, Event, Error) or mislead.
const RENAMES = {
  number: 'EncodedNumber',
  numberOrNull: 'EncodedNumberOrNull',
  event: 'NbEvent',
  error: 'ErrorReply'
};

const KNOWN_KEYS = new Set([
  '$schema', '$id', '$ref', '$defs', 'title', 'description', 'type', 'const', 'enum', 'oneOf',
  'properties', 'required', 'additionalProperties', 'items', 'minItems', 'maxItems', 'minimum', 'pattern'
]);

export function typeName(def) {
  return RENAMES[def] ?? def.charAt(0).toUpperCase() + def.slice(1);
}

// The root type's name while a schema is being generated (for #/properties/<name> references).
let rootName = '';

function fail(path, message) {
  throw new Error(`schema-types: ${path}: ${message}`);
}

function literal(value) {
  return JSON.stringify(value);
}

function union(parts) {
  const unique = [...new Set(parts)];
  return unique.join(' | ');
}

function wrap(type) {
  return /[|&]/.test(type) ? `(${type})` : type;
}

function comment(text, indent) {
  if (!text) {
    return '';
  }
  const lines = text.split('\n');
  if (lines.length === 1 && text.length < 100) {
    return `${indent}/** ${text.replace(/\*\//g, '*\\/')} */\n`;
  }
  const body = wrapWords(text.replace(/\*\//g, '*\\/'), 96 - indent.length)
    .map(line => `${indent} * ${line}`.trimEnd())
    .join('\n');
  return `${indent}/**\n${body}\n${indent} */\n`;
}

function wrapWords(text, width) {
  const out = [];
  for (const paragraph of text.split('\n')) {
    let line = '';
    for (const word of paragraph.split(/\s+/).filter(Boolean)) {
      if (line && line.length + 1 + word.length > width) {
        out.push(line);
        line = word;
      } else {
        line = line ? `${line} ${word}` : word;
      }
    }
    out.push(line);
  }
  return out;
}

function propertyKey(name) {
  return /^[A-Za-z_$][A-Za-z0-9_$]*$/.test(name) ? name : literal(name);
}

/** The TypeScript type of one schema node (`indent` is the indentation of the line it starts on). */
function tsType(node, path, indent) {
  if (typeof node !== 'object' || node === null) {
    fail(path, 'expected a schema object');
  }
  for (const key of Object.keys(node)) {
    if (!KNOWN_KEYS.has(key)) {
      fail(path, `unsupported keyword "${key}": teach scripts/schema-types.mjs about it`);
    }
  }
  if (node.$ref) {
    const def = /^#\/\$defs\/([^/]+)$/.exec(node.$ref);
    if (def) {
      return typeName(def[1]);
    }
    // A property of the root (an entry of a report reuses the document's sections): the same
    // type, by indexed access, so the two cannot differ.
    const property = /^#\/properties\/([^/]+)$/.exec(node.$ref);
    if (property) {
      return `${rootName}[${literal(property[1])}]`;
    }
    fail(path, `only #/$defs/<name> and #/properties/<name> references are supported, got ${node.$ref}`);
  }
  if ('const' in node) {
    return literal(node.const);
  }
  if (node.enum) {
    return union(node.enum.map(literal));
  }
  if (node.oneOf) {
    return union(node.oneOf.map((option, i) => tsType(option, `${path}/oneOf/${i}`, indent)));
  }
  if (Array.isArray(node.type)) {
    return union(node.type.map(type => tsType({ ...node, type }, path, indent)));
  }
  switch (node.type) {
    case undefined:
      return 'unknown'; // "any JSON" (e.g. what a fix changed)
    case 'string':
      return 'string';
    case 'number':
    case 'integer':
      return 'number';
    case 'boolean':
      return 'boolean';
    case 'null':
      return 'null';
    case 'array':
      return node.items ? `${wrap(tsType(node.items, `${path}/items`, indent))}[]` : 'unknown[]';
    case 'object':
      return objectType(node, path, indent);
    default:
      return fail(path, `unsupported type ${literal(node.type)}`);
  }
}

function objectType(node, path, indent) {
  const properties = node.properties ?? {};
  const required = new Set(node.required ?? []);
  const inner = `${indent}  `;
  const lines = Object.entries(properties).map(([name, prop]) => {
    const optional = required.has(name) ? '' : '?';
    const type = tsType(prop, `${path}/properties/${name}`, inner);
    return `${comment(prop.description, inner)}${inner}${propertyKey(name)}${optional}: ${type};\n`;
  });
  const extra = node.additionalProperties;
  if (typeof extra === 'object') {
    lines.push(`${inner}[key: string]: ${tsType(extra, `${path}/additionalProperties`, inner)};\n`);
  } else if (extra === undefined && lines.length === 0) {
    lines.push(`${inner}[key: string]: unknown;\n`); // a free-form object
  }
  return lines.length ? `{\n${lines.join('')}${indent}}` : '{}';
}

function declaration(name, node, path) {
  const doc = comment(node.description ?? node.title, '');
  if (node.type === 'object' && !node.oneOf) {
    return `${doc}export interface ${name} ${objectType(node, path, '')}\n`;
  }
  return `${doc}export type ${name} = ${tsType(node, path, '')};\n`;
}

/** The TypeScript module for one schema file. */
export function generate(schemaText, schemaPath, rootTypeName) {
  const schema = JSON.parse(schemaText);
  rootName = rootTypeName;
  const parts = [
    `// Generated by labextension/scripts/schema-types.mjs from ${schemaPath}: do not edit.\n` +
      '// Regenerate with `npm run schema`; `npm run check:schema` fails when this file is stale.\n'
  ];
  const { $defs = {}, ...root } = schema;
  parts.push(declaration(rootTypeName, root, '#'));
  for (const [def, node] of Object.entries($defs)) {
    parts.push(declaration(typeName(def), node, `#/$defs/${def}`));
  }
  return parts.join('\n');
}

/** The schema as a TypeScript constant: the validator walks the same file the types come from. */
export function generateData(schemaText, schemaPath, constName) {
  const schema = JSON.parse(schemaText);
  return (
    `// Generated by labextension/scripts/schema-types.mjs from ${schemaPath}: do not edit.\n` +
    '// Regenerate with `npm run schema`; `npm run check:schema` fails when this file is stale.\n' +
    '// The JSON Schema every saved payload is validated against before it is rendered (src/validate.ts).\n\n' +
    `export const ${constName}: unknown = ${JSON.stringify(schema, null, 2)};\n`
  );
}

function main(argv) {
  const check = argv.includes('--check');
  let stale = 0;
  for (const target of TARGETS) {
    const source = readFileSync(join(ROOT, target.schema), 'utf8');
    const text = target.data
      ? generateData(source, target.schema, target.data)
      : generate(source, target.schema, target.root);
    const out = join(ROOT, target.out);
    let current = null;
    try {
      current = readFileSync(out, 'utf8');
    } catch {
      current = null;
    }
    if (check) {
      if (current !== text) {
        stale++;
        console.error(`${relative(process.cwd(), out)} is not what ${target.schema} generates: run \`npm run schema\` and commit it`);
      }
    } else if (current !== text) {
      writeFileSync(out, text);
      console.log(`wrote ${relative(process.cwd(), out)}`);
    }
  }
  if (stale) {
    process.exit(1);
  }
  if (check) {
    console.log('schema types are current');
  }
}

if (process.argv[1] && fileURLToPath(import.meta.url) === process.argv[1]) {
  main(process.argv.slice(2));
}
