"""The way from `render` to a running job, as a new user walks it: the `next:` commands, the
JSON and tag outputs for scripts, where Singularity.def bootstraps from, tables that fit an
80-column terminal, and a README and docs/ whose run examples and references hold up (the
README's path to a running job, docs/running.md's examples, docs/matrix.md's markers)."""

import ast
import json
import re
import shlex
import shutil
import subprocess
from importlib import metadata

import pytest

from conftest import ROOT, suite_files, tree

from envbuild.image import cli as image_cli

README = (ROOT / "README.md").read_text()
RUNNING = (ROOT / "docs" / "running.md").read_text()  # what the README's "Running it" section became
MATRIX_DOC = (ROOT / "docs" / "matrix.md").read_text()
TESTING_DOC = (ROOT / "docs" / "testing.md").read_text()
TAG = "torch2.11.0-cu130-py3.12-ds0.19.8-h20"  # the fixture matrix's default for --gpu h20


def _next_block(stdout: str) -> list[str]:
    lines = stdout.split("\nnext ", 1)[1].splitlines()[1:]
    return [ln[2:] for ln in lines if ln.startswith("  ")]


def _section(title: str, text: str = README) -> str:
    """The `## title` section of a Markdown page (the README unless `text` is another page)."""
    return text.split(f"\n## {title}\n", 1)[1].split("\n## ", 1)[0]


# --- render / build output ------------------------------------------------------------------

def test_render_prints_the_exact_next_commands_for_this_tag(cli, tmp_path):
    out = tmp_path / "o"
    r = cli("render", "--gpu", "H20", "--ds-ops", "cpu_adam", "--env", "FOO=a b", "-o", str(out))
    assert r.returncode == 0, r.stderr
    commands = _next_block(r.stdout)
    assert 3 <= len(commands) <= 5, commands
    tag = json.loads((out / "manifest.json").read_text())["tag"]
    assert all(tag in c for c in commands[1:]), commands
    assert "docker run --gpus all --ipc=host --ulimit memlock=-1 --ulimit stack=67108864" in r.stdout
    for c in commands:  # each line is one shell command line, quoted right
        assert subprocess.run(["bash", "-n", "-c", c]).returncode == 0, c
    # The build line repeats the user's options exactly: the same options resolve the same tag.
    build = shlex.split(commands[0])
    assert build[:2] == ["envbuild", "build"] and "--env" in build and "FOO=a b" in build
    again = cli("render", *build[2:], "--print-tag")
    assert again.returncode == 0 and again.stdout.strip() == tag


def test_after_build_the_next_lines_start_at_the_smoke_test(matrix, tmp_path):
    """`envbuild build` needs an engine; its `next:` lines are the same function without the build line."""
    from envbuild.resolve.resolver import Request, resolve
    from envbuild.render.running import next_commands

    for repo, first in (("envbuild", "envbuild smoke envbuild:"), ("ghcr.io/acme/envbuild", "envbuild smoke ghcr.io/")):
        lines = next_commands(resolve(matrix, Request(gpu="h20", image_repo=repo)), tmp_path)
        assert 3 <= len(lines) <= 5 and lines[0].startswith(first) and not any("envbuild build" in ln for ln in lines)
        assert any(ln.startswith("docker run --gpus all --ipc=host") for ln in lines)
        assert lines[-1].startswith("apptainer build ")


def test_render_json_is_the_resolution_and_nothing_else_on_stdout(cli, tmp_path):
    out = tmp_path / "o"
    r = cli("render", "--gpu", "b200", "--json", "-o", str(out))
    assert r.returncode == 0, r.stderr
    doc = json.loads(r.stdout)  # the whole of stdout is one JSON document
    manifest = json.loads((out / "manifest.json").read_text())
    for key in ("tag", "image", "stack", "python", "cuda", "torch", "deepspeed", "gpu", "ds_ops", "ds_ops_dropped"):
        assert doc[key] == manifest[key], key
    assert doc["driver"]["min_driver"] == manifest["driver"]["min_driver"] == "580.65.06"
    assert doc["output"] == str(out) and sorted(doc["files"]) == sorted(tree(out))
    assert doc["singularity_from"] == {"image": manifest["image"], "registry": None}
    assert "warning" in r.stderr  # local-only bootstrap: said on stderr, never on stdout


def test_render_json_lists_ops_left_out_with_why(cli, tmp_path):
    r = cli("render", "--gpu", "h20", "--ds-ops", "all", "--json", "-o", str(tmp_path / "o"))
    assert r.returncode == 0, r.stderr
    dropped = json.loads(r.stdout)["ds_ops_dropped"]
    assert dropped and all(d["op"] and d["reason"] for d in dropped)


def test_print_tag_resolves_only_and_writes_nothing(cli, tmp_path):
    r = cli("render", "--gpu", "h20", "--print-tag", cwd=tmp_path)
    assert r.returncode == 0, r.stderr
    assert r.stdout == TAG + "\n" and r.stderr == ""
    assert list(tmp_path.iterdir()) == []


def test_print_tag_refuses_other_output_modes(cli, tmp_path):
    r = cli("render", "--gpu", "h20", "--print-tag", "--json", cwd=tmp_path)
    assert r.returncode == 2 and r.stderr.startswith("envbuild: error: --print-tag prints only the tag")
    assert "Traceback" not in r.stderr and list(tmp_path.iterdir()) == []


def test_explain_shows_every_candidates_driver_floor(cli, matrix, tmp_path):
    r = cli("render", "--gpu", "v100", "--explain", cwd=tmp_path, env={"COLUMNS": "200"})
    assert r.returncode == 0, r.stderr
    assert "min driver" in r.stdout
    rows = {ln.split()[0]: ln for ln in r.stdout.splitlines() if ln.split() and ln.split()[0].startswith("torch")}
    for s in matrix.stacks:
        assert matrix.driver_floor(s.cuda).min_driver in rows[s.id], s.id
    chosen = next(ln for ln in rows.values() if "CHOSEN" in ln).split()[0]
    assert f">= {matrix.driver_floor(matrix.stack(chosen).cuda).min_driver}" in r.stdout  # the resolution block
    assert list(tmp_path.iterdir()) == []


def test_explain_json_and_the_case_where_no_stack_fits(cli, tmp_path):
    ok = json.loads(cli("render", "--gpu", "b200", "--explain", "--json", cwd=tmp_path).stdout)
    assert ok["chosen"]["stack"] == next(c["stack"] for c in ok["candidates"] if c["verdict"] == "CHOSEN")
    rejected = [c for c in ok["candidates"] if c["verdict"] == "rejected"]
    assert rejected and all(c["rejections"] and c["min_driver"] for c in rejected)
    assert {"gpu-floor", "gpu-arch"} <= {x["rule"] for c in rejected for x in c["rejections"]}
    r = cli("render", "--gpu", "b200", "--torch", "2.5", "--explain", "--json", cwd=tmp_path)
    assert r.returncode == 2 and json.loads(r.stdout)["chosen"] is None
    assert r.stderr.startswith("envbuild: error: no stack fits") and list(tmp_path.iterdir()) == []


# --- where Singularity.def bootstraps from ---------------------------------------------------

def test_registry_makes_singularity_def_pull_the_published_image(cli, tmp_path):
    r = cli("render", "--gpu", "h20", "--registry", "ghcr.io/acme", "-o", str(tmp_path / "a"))
    assert r.returncode == 0, r.stderr
    assert "warning" not in r.stderr
    image = f"ghcr.io/acme/envbuild:{TAG}"
    assert json.loads((tmp_path / "a" / "manifest.json").read_text())["image"] == image
    definition = (tmp_path / "a" / "Singularity.def").read_text()
    assert f"\nBootstrap: docker\nFrom: {image}\n" in definition and "no registry host" not in definition
    commands = _next_block(r.stdout)
    assert f"envbuild push {image} --registry ghcr.io/acme" in commands[1]  # where push puts it
    assert commands[-1].startswith(f"apptainer build {TAG}.sif {tmp_path / 'a' / 'Singularity.def'} && apptainer test")
    # The environment variable does the same; --image-repo wins over both.
    env = cli("render", "--gpu", "h20", "--json", "-o", str(tmp_path / "b"), env={"ENVBUILD_REGISTRY": "ghcr.io/acme"})
    assert json.loads(env.stdout)["image"] == image
    repo = cli("render", "--gpu", "h20", "--json", "--image-repo", "registry.example.com:5000/team/eb",
               "-o", str(tmp_path / "c"), env={"ENVBUILD_REGISTRY": "ghcr.io/acme"})
    assert json.loads(repo.stdout)["image"] == f"registry.example.com:5000/team/eb:{TAG}"


def test_registry_takes_the_repository_name_from_publish_yaml(cli, matrix_copy, tmp_path):
    (matrix_copy / "publish.yaml").write_text("registry: \"ghcr.io/$OWNER\"\nimage_repo: gpu-images\n")
    r = cli("render", "--gpu", "h20", "--registry", "ghcr.io/acme", "--matrix-dir", str(matrix_copy), "--json",
            "-o", str(tmp_path / "o"))
    assert r.returncode == 0, r.stderr
    assert json.loads(r.stdout)["image"] == f"ghcr.io/acme/gpu-images:{TAG}"


def test_a_local_only_name_is_warned_about_not_refused(cli, tmp_path):
    for repo in ("envbuild", "acme/envbuild"):
        out = tmp_path / repo.replace("/", "_")
        r = cli("render", "--gpu", "h20", "--image-repo", repo, "-o", str(out))
        assert r.returncode == 0, r.stderr
        warning = " ".join(r.stderr.split())
        assert warning.startswith("envbuild: warning: Singularity.def bootstraps from") and "--registry" in warning
        assert "no registry host" in (out / "Singularity.def").read_text()
        assert "docker-daemon://" in _next_block(r.stdout)[-1]


@pytest.mark.parametrize("args, words", [
    (["--registry", "ghcr.io/$OWNER"], ["--registry 'ghcr.io/$OWNER' holds a shell variable", "ghcr.io/acme"]),
    (["--registry", "acme"], ["--registry 'acme' names no registry host", "ghcr.io/acme"]),
    (["--registry", "ghcr.io/Acme"], ["is not a valid registry", "nearest valid: ghcr.io/acme"]),
    (["--image-repo", "envbuild:latest"], ["carries a tag (:latest)", "Nearest valid choice: --image-repo envbuild."]),
])
def test_bad_image_names_fail_clearly_and_write_nothing(cli, tmp_path, args, words):
    r = cli("render", "--gpu", "h20", *args, "-o", str(tmp_path / "o"))
    assert r.returncode == 2 and "Traceback" not in r.stderr
    msg = " ".join(r.stderr.split())
    assert msg.startswith("envbuild: error:") and all(w in msg for w in words), msg
    assert list(tmp_path.iterdir()) == []


def test_the_template_and_the_cli_agree_on_what_is_local(matrix):
    from envbuild.render.builddir import render_files
    from envbuild.resolve.resolver import Request, resolve
    from envbuild.render.running import local_only

    for repo in ("envbuild", "acme/envbuild", "localhost/envbuild", "localhost:5000/envbuild",
                 "ghcr.io/acme/envbuild", "registry.example.com:5000/a/b", "docker.io/acme/envbuild"):
        definition = render_files(resolve(matrix, Request(gpu="h20", image_repo=repo)))["Singularity.def"].decode()
        assert ("no registry host" in definition) == local_only(repo), repo
        assert f"\nBootstrap: docker\nFrom: {repo}:" in definition


# --- matrix and gpus at 80 columns ----------------------------------------------------------

def _narrow(cli, *args):
    r = cli(*args, env={"COLUMNS": "80"}, production=True)
    assert r.returncode == 0, r.stderr
    too_wide = [ln for ln in r.stdout.splitlines() if len(ln.rstrip()) > 80]
    assert not too_wide, too_wide
    return r.stdout


def test_matrix_fits_80_columns_with_copyable_ids_notes_and_driver(cli, production_matrix):
    text = _narrow(cli, "matrix")
    starts = {ln.split()[0] for ln in text.splitlines() if ln.split()}
    for s in production_matrix.stacks:
        assert s.id in starts, s.id  # whole, at the start of a line: never folded
        assert re.search(rf"^{re.escape(s.id)}\s.*\b{re.escape(production_matrix.driver_floor(s.cuda).min_driver)}\b",
                         text, re.M), s.id
        if s.note:
            assert " ".join(s.note.split()) in " ".join(text.split()), s.id
    assert "runtime base" not in text
    wide = cli("matrix", "--wide", env={"COLUMNS": "250"}, production=True).stdout
    assert "runtime base" in wide and "torchvision" in wide


def test_gpus_fits_80_columns_one_block_per_default(cli, production_matrix):
    from envbuild.render.tables import env_rows, not_baked_rows

    text = _narrow(cli, "gpus")
    flat = " ".join(text.split())
    dense = "".join(text.split())  # a URL longer than the column is folded inside it
    lines = [ln.rstrip() for ln in text.splitlines()]
    for p in production_matrix.gpus:
        assert any(ln.split() and ln.split()[0] == p.name for ln in lines), p.name
    for where, var, reason, cost, source in env_rows(production_matrix):
        assert var in lines  # the variable on a line of its own, above its block
        for words in (where, reason, cost, source):
            assert " ".join(words.split()) in flat or "".join(words.split()) in dense, words
    for gpus, var, why, source in not_baked_rows(production_matrix):
        assert var in lines and " ".join(why.split()) in flat
    assert "[V] = checked in a primary artifact" in flat and 'See docs/matrix.md, "Where the facts come from"' in flat
    assert "\n## Where the facts come from\n" in MATRIX_DOC  # where that note sends the reader


# --- the README and docs/ ------------------------------------------------------------------

RUN_HEADINGS = ("Docker", "Apptainer", "Slurm + Apptainer", "Slurm + pyxis/enroot")


def _running_blocks():
    """The bash examples of docs/running.md, in order: Docker, Apptainer, both Slurm ways."""
    return re.findall(r"```bash\n(.*?)```", RUNNING, re.S)


def _readme_path_blocks():
    """The README's shortest path to a running job: build/smoke/push, the .sif, the Slurm job."""
    return re.findall(r"```bash\n(.*?)```", _section("From a GPU name to a running job"), re.S)


def test_running_doc_has_docker_apptainer_and_both_slurm_ways():
    text = RUNNING
    for heading in RUN_HEADINGS:
        assert f"\n## {heading}\n" in text, heading
    blocks = _running_blocks()
    assert len(blocks) == 4
    assert "docker run --gpus all --ipc=host --ulimit memlock=-1 --ulimit stack=67108864" in blocks[0]
    assert "apptainer test --nv" in blocks[1] and "apptainer exec --nv" in blocks[1]
    assert blocks[2].startswith("#!/bin/bash\n#SBATCH") and 'srun --ntasks="$SLURM_NNODES" --ntasks-per-node=1 apptainer exec --nv' in blocks[2]
    assert "image='ghcr.io#acme/envbuild:" in blocks[3] and ". /opt/envbuild/env.sh" in blocks[3]
    assert 'srun --ntasks="$SLURM_NNODES" --ntasks-per-node=1 --container-image="$image" --container-name=envbuild' in blocks[3]
    from envbuild.render.jobs import Job, job_script  # the Slurm examples are `envbuild job`'s output
    assert blocks[3] == job_script(Job("ghcr.io#acme/envbuild:torch2.15.0-cu132-py3.12-ds0.19.8-h20"))
    for block in blocks[2:]:  # the multi-node smoke test is each job's first step, one rank per GPU
        first_step = re.sub(r"\\\n\s*", "", block).split("\nsrun ")[1]
        assert first_step.startswith("--ntasks-per-node=8 "), first_step
        assert first_step.split("\n")[0].rstrip("'").endswith("python /opt/envbuild/smoke.py --multinode"), first_step
    for words in ("TORCH_EXTENSIONS_DIR", "TRITON_CACHE_DIR", "SLURM_JOB_ID", "envbuild gpus", "driver floor", "NCCL_P2P_DISABLE"):
        assert words in text, words


def test_readme_walks_from_build_to_a_slurm_job_and_links_the_rest():
    """The README keeps the shortest path (build, smoke, push; a .sif; a Slurm job whose first
    step is the smoke test) and sends everything else to docs/running.md."""
    build, sif, job = _readme_path_blocks()
    assert "envbuild build --gpu h20" in build and 'envbuild smoke "$IMAGE" && envbuild push "$IMAGE"' in build
    assert 'apptainer build "/shared/images/$TAG.sif" "build/$TAG/Singularity.def"' in sif
    assert job.startswith("#!/bin/bash\n#SBATCH") and "\nsrun apptainer test --nv" in job
    assert job.index("apptainer test") < job.index("torchrun")  # the smoke test first
    assert "(docs/running.md)" in _section("From a GPU name to a running job")


def test_run_examples_are_valid_shell(tmp_path):
    """bash parses every example (docs/running.md and the README's path); shellcheck (a test
    extra) finds no quoting or other mistake."""
    from test_lint import _tool

    for i, block in enumerate(_running_blocks() + _readme_path_blocks()):
        script = block if block.startswith("#!") else "#!/bin/bash\n" + block
        f = tmp_path / f"example{i}.sh"
        f.write_text(script)
        assert subprocess.run(["bash", "-n", str(f)]).returncode == 0, block
        assert not re.search(r"<[a-z_]+>", block), "a <placeholder> is a shell redirection when pasted"
        # The pyxis example single-quotes on purpose: its variables expand inside the container.
        exclude = ["--exclude=SC2016"] if "--container-image" in block else []
        r = subprocess.run([_tool("shellcheck"), *exclude, str(f)], capture_output=True, text=True)
        assert r.returncode == 0, r.stdout


def test_running_doc_docker_flags_match_the_cli(matrix):
    from envbuild.render.running import DOCKER_RUN

    assert DOCKER_RUN.replace(" --rm -it", "") in _running_blocks()[0]


# A citation users can follow names a file of this repository, a public URL or an upstream file
# of a named release. Citing a Markdown note by section or pitfall number that this repository
# does not hold (research notes kept elsewhere), or a directory above the checkout, is not one.
NOTE_CITATION = re.compile(r"([\w-]+\.md),? (?:section|pitfall)s? \d")
OUTSIDE_PATH = re.compile(r"(?<![\w.$/])\.\./([A-Za-z][\w.-]*)")
# Relative paths that components print themselves, quoted in known_issues.yaml's sample lines:
# torch's c10d errors name their source as torch's build tree saw it ("NCCL error in:
# ../torch/csrc/distributed/c10d/ProcessGroupNCCL.cpp:1970"), not a file this repository cites.
PRINTED_PATHS = {"torch"}


def _unfollowable(text: str) -> list[str]:
    """The citations in `text` a user of this repository cannot open."""
    ours = {p.name for p in ROOT.rglob("*.md") if ".git" not in p.parts}
    return sorted({m for m in NOTE_CITATION.findall(text) if m not in ours} | {f"../{d}" for d in OUTSIDE_PATH.findall(text)
                                                                            if not (ROOT / d).exists() and d not in PRINTED_PATHS})


def test_docs_explain_every_marker_and_reference_users_see():
    facts = _section("Where the facts come from", MATRIX_DOC)
    for words in ("**[V]**", "**[S]**", "**[U]**", '**"field report N"**'):
        assert words in facts, words
    reports = re.findall(r"^  (\d)\. (.*?)(?=^  \d\. |^- |\Z)", facts, re.S | re.M)
    assert [n for n, _ in reports] == ["1", "2", "3", "4", "5"]
    assert all("https://github.com/" in body or "[U]" in body for _, body in reports)
    # No shipped text cites the project's private research notes (users cannot read them), so
    # the docs need not explain such citations, and they never mention the notes themselves.
    shipped = {p: p.read_text() for d in ("matrices", "envbuild", "templates") for p in (ROOT / d).rglob("*")
               if p.is_file() and p.suffix in (".yaml", ".py", ".j2", ".sh")}
    # A catalogue's `text:` is a component's own message, verbatim (c10d's assertions name their
    # build paths, `../torch/csrc/...`): upstream's words, not a citation of ours.
    shipped = {p: re.sub(r'\btext: "(?:[^"\\]|\\.)*"', 'text: ""', text) if "catalogues" in p.parts else text
               for p, text in shipped.items()}
    cites = sorted(f"{p.relative_to(ROOT)}: {w}" for p, text in shipped.items() for w in _unfollowable(text))
    assert cites == []
    for path in [ROOT / "README.md", *sorted((ROOT / "docs").glob("*.md"))]:
        assert _unfollowable(path.read_text()) == [], path.relative_to(ROOT)


def test_readme_fast_test_command_needs_only_the_test_extras():
    """Every third-party module a fast test imports comes with `pip install -e '.[test]'`."""
    tests = _section("Tests", TESTING_DOC)
    assert "pip install -e '.[test]'" in tests and 'python -m pytest -m "not docker"' in tests
    declared = {re.split(r"[<>=!;\[ ]", r, 1)[0].lower().replace("_", "-") for r in _pyproject_requirements()}
    providers = metadata.packages_distributions()
    local = ({p.stem for p in [*(ROOT / "tests").glob("*.py"), *suite_files()]} | {"envbuild", "conftest"}
             | {p.stem for p in (ROOT / "templates" / "files").rglob("*.py")}  # in-image scripts, stdlib only
             | {p.stem for p in (ROOT / "envbuild" / "buildsteps").glob("*.py")}  # build-stage scripts, the same
             | {p.stem for p in (ROOT / "tests" / "tools").glob("*.py")})
    assert len(suite_files()) > 50  # the suite's modules, wherever they lie: not an empty glob
    for path in suite_files():
        for node in ast.walk(ast.parse(path.read_text())):  # code only: not scripts held in strings
            if isinstance(node, ast.Import):
                modules = [a.name.split(".")[0] for a in node.names]
            elif isinstance(node, ast.ImportFrom) and node.level == 0:
                modules = [node.module.split(".")[0]]
            else:
                continue
            for module in modules:
                if module in local or module in _stdlib():
                    continue
                dists = {d.lower().replace("_", "-") for d in providers.get(module, [module])}
                assert dists & declared, f"{path.name} imports {module}, which neither the package nor [test] installs"


def _pyproject_requirements():
    """`dependencies` and the `test` extra of pyproject.toml (read as text: tomllib is 3.11+)."""
    text = (ROOT / "pyproject.toml").read_text()
    # each list ends with a ] of its own line: one inside a string ("securesystemslib[crypto]") does not end it
    blocks = [re.search(r"^dependencies = \[(.*?)^\]", text, re.S | re.M).group(1),
              re.search(r"^test = \[(.*?)^\]", text, re.S | re.M).group(1)]
    return [req for block in blocks for req in re.findall(r'"([^"]+)"', block)]


def _stdlib():
    import sys

    return set(sys.stdlib_module_names) | {"__future__"}


@pytest.mark.skipif(not shutil.which("bash"), reason="bash")
def test_env_sh_gives_the_per_job_caches_the_docs_promise(tmp_path):
    """docs/running.md's claim, run: per job from SLURM_JOB_ID, under ENVBUILD_LOCAL_DIR, a set value wins."""
    env_sh = ROOT / "templates" / "files" / "env.sh"
    show = f'. {shlex.quote(str(env_sh))}; echo "$TORCH_EXTENSIONS_DIR $TRITON_CACHE_DIR"'
    base = {"PATH": "/usr/bin:/bin"}
    r = subprocess.run(["sh", "-c", show], env=base | {"SLURM_JOB_ID": "4242", "TMPDIR": str(tmp_path)},
                       capture_output=True, text=True)
    assert r.stdout.split() == [f"{tmp_path}/torch_extensions-4242", f"{tmp_path}/triton-4242"]
    r = subprocess.run(["sh", "-c", show], env=base | {"SLURM_JOB_ID": "7", "ENVBUILD_LOCAL_DIR": "/scratch",
                                                        "TRITON_CACHE_DIR": "/mine"}, capture_output=True, text=True)
    assert r.stdout.split() == ["/scratch/torch_extensions-7", "/mine"]
    section = _section("What travels with the image", RUNNING)
    assert "`${ENVBUILD_LOCAL_DIR:-${TMPDIR:-/tmp}}/<name>-<job>`" in section
    assert "| `TORCH_EXTENSIONS_DIR` |" in section and "| `TRITON_CACHE_DIR` |" in section


# --- every option the examples and the next: lines use exists -------------------------------

TOOL_OPTIONS = ROOT / "tests" / "fixtures" / "run-tool-options.yaml"


def _words(command: str) -> list[str]:
    """Shell words of one command line; `$( ... )` opened up, `bash -c '...'` scripts included."""
    lexer = shlex.shlex(command.replace("$(", " $( ").replace(")", " ) "), posix=True, punctuation_chars=";&|")
    lexer.commenters = "#"
    words = list(lexer)
    for i, w in enumerate(words[:-1]):
        if w == "-c" and i and words[i - 1] == "bash":
            words += ["&&"] + _words(words[i + 1])
    return words


def _options_used(script: str) -> list[tuple[str, str]]:
    """(tool, option) for every --option in a script, the tool being the last one named before it."""
    used = [("slurm", m) for m in re.findall(r"^#SBATCH --([a-z-]+)", script, re.M)]
    script = re.sub(r"\\\n", " ", script)
    tools = {"docker": "docker_run", "apptainer": "apptainer", "srun": "srun", "torchrun": "torchrun",
             "envbuild": "envbuild", "/opt/envbuild/smoke.py": "smoke"}
    for line in script.splitlines():
        tool = None
        for w in _words(line):
            if w in tools:
                tool = tools[w]
            elif w in (";", "&&", "|", "||", "$(", ")"):
                tool = None
            elif w.startswith("--") and tool:
                used.append((tool, w[2:].split("=", 1)[0]))
    return used


def _inline_commands() -> list[str]:
    """Inline `code` of docs/running.md's prose: commands as they are, bare options as options of
    the tool whose section (## Docker, ## Apptainer, ## Slurm + pyxis/enroot) they are in."""
    parts = re.split(r"^## (.*)$", RUNNING, flags=re.M)
    assert set(RUN_HEADINGS) <= set(parts[1::2]), parts[1::2]
    tool = {"Docker": "docker run", "Apptainer": "apptainer exec", "Slurm + Apptainer": "apptainer exec",
            "Slurm + pyxis/enroot": "srun"}  # the other sections' prose names its commands whole
    out = []
    for heading, body in zip(parts[1::2], parts[2::2]):
        body = re.sub(r"```.*?```", "", body, flags=re.S)
        for span in (s.replace("\n", " ") for s in re.findall(r"`([^`]+)`", body)):
            out.append(f"{tool[heading]} {span}" if span.startswith("--") and heading in tool else span)
    return out


def test_every_option_in_the_run_examples_and_next_lines_exists(cli, tmp_path):
    import yaml

    from envbuild.cli import main

    known = {tool: set(d["options"]) for tool, d in yaml.safe_load(TOOL_OPTIONS.read_text()).items()}
    known["srun"] = known["slurm"] | known["pyxis"]  # pyxis adds its options to srun
    known["envbuild"] = {o[2:] for c in main.commands.values() for p in c.params for o in p.opts if o[:2] == "--"}
    known["smoke"] = {o[2:] for a in image_cli.parser()._actions for o in a.option_strings if o[:2] == "--"}
    scripts = _running_blocks() + _readme_path_blocks() + _inline_commands()
    for args in ([], ["--registry", "ghcr.io/acme"]):
        r = cli("render", "--gpu", "h20", "-o", str(tmp_path / "o"), *args)
        scripts.append("\n".join(_next_block(r.stdout)))
    used = [u for s in scripts for u in _options_used(s)]
    assert {t for t, _ in used} == {"docker_run", "apptainer", "slurm", "srun", "torchrun", "envbuild", "smoke"}
    unknown = sorted({f"{t} --{o}" for t, o in used if o not in known[t]})
    assert not unknown, unknown
