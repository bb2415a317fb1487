// Parse Mermaid files with the real Mermaid parser: `node mermaid_parse.mjs FILE...`; exit 1 if any fails.
// Needs the npm packages `mermaid` (11) and `jsdom` on NODE_PATH (see test_export.py::test_mermaid_parses).
import fs from "fs";
import { createRequire } from "module";
import path from "path";

const require = createRequire(path.join(process.env.FLOWRL_MERMAID_NODE_MODULES, "x.js"));
const { JSDOM } = require("jsdom");
const dom = new JSDOM("<!doctype html><html><body></body></html>");
globalThis.window = dom.window;
globalThis.document = dom.window.document;
globalThis.DOMParser = dom.window.DOMParser;
const mermaid = (await import(require.resolve("mermaid"))).default;
mermaid.initialize({ startOnLoad: false });
let failed = 0;
for (const file of process.argv.slice(2)) {
  try {
    const result = await mermaid.parse(fs.readFileSync(file, "utf8"));
    console.log(`ok ${file} ${result.diagramType}`);
  } catch (error) {
    failed += 1;
    console.log(`FAIL ${file}: ${String(error.message || error).slice(0, 500)}`);
  }
}
process.exit(failed ? 1 : 0);
