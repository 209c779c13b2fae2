/** The extension's version, sent in the comm hello; a unit test keeps it equal to package.json. */
export const EXTENSION_VERSION = '0.1.0';
