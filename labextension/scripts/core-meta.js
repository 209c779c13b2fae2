// Lay out JupyterLab's core package metadata (shared singletons and their versions, from the
// @jupyterlab/core-meta devDependency) as build/core/package.json, the "core path" that
// @jupyterlab/builder's build-labextension reads. This keeps the build to Node and npm alone:
// no Python JupyterLab is needed to build the extension.
const fs = require('fs');
const path = require('path');

const source = require.resolve('@jupyterlab/core-meta/core.package.json');
const target = path.join(__dirname, '..', 'build', 'core', 'package.json');
fs.mkdirSync(path.dirname(target), { recursive: true });
fs.copyFileSync(source, target);
