"""Rows for `envbuild matrix`/`envbuild gpus`/`envbuild fabrics`, and the generated tables of
the docs (docs/matrix.md, docs/running.md).

One place turns the matrix into rows; the CLI prints them with rich, the docs embed them as
Markdown between `<!-- generated:NAME -->` and `<!-- /generated -->` markers, and a test checks
the docs are current (`envbuild readme-tables FILE` rewrites a file's blocks).
"""

from __future__ import annotations

import re
from pathlib import Path
from urllib.parse import urlsplit

from envbuild.base.errors import EnvbuildError
from envbuild.base.files import read_text, write_owned
from envbuild.knowledge import rules
from envbuild.knowledge.lock import ext_lock, lock_path, stack_lock
from envbuild.knowledge.matrix import Matrix
from envbuild.knowledge.oslock import os_lock_path
from envbuild.render.jobs import Job, job_script

STACK_HEADERS = ("stack", "python", "cuda", "torch", "torchvision", "deepspeed", "os", "nvcc from",
                 "min driver", "lock", "builder base", "runtime base")
GPU_HEADERS = ("gpu", "aliases", "cc", "memory (GB)", "generation", "interconnect", "torch/CUDA floor",
               "baked env defaults")
# What `envbuild matrix` / `envbuild gpus` show by default: fits 80 columns; --wide shows all.
STACK_NARROW = ("stack", "python", "cuda", "torch", "deepspeed", "min driver")
GPU_NARROW = ("gpu", "cc", "generation", "interconnect", "torch/CUDA floor")
MARKERS = ("[V] = checked in a primary artifact (wheel, sdist, repository file), [S] = a secondary source, "
           "[U] = unverified; \"field report N\" = one of the five public failure write-ups envbuild exists "
           "to prevent. See docs/matrix.md, "
           "\"Where the facts come from\".")


def narrow(headers: tuple[str, ...], wanted: tuple[str, ...], rows: list[tuple]) -> list[tuple]:
    """The `wanted` columns of `rows`, in the order of `wanted`."""
    idx = [headers.index(h) for h in wanted]
    return [tuple(r[i] for i in idx) for r in rows]


def stack_notes(m: Matrix) -> list[tuple[str, str]]:
    """(stack id, note) for every stack that has one."""
    return [(s.id, s.note) for s in m.stacks if s.note]


def gpu_notes(m: Matrix) -> list[tuple[str, str]]:
    """(gpu, note) for every GPU profile note."""
    return [(p.name, n) for p in m.gpus for n in p.notes]


def env_blocks(m: Matrix) -> list[tuple[str, str, list[tuple[str, str]]]]:
    """Every baked default as (VAR=VALUE, where it applies, [(label, text)]): one block per
    default, readable at any width (the wide table is `envbuild gpus --wide`)."""
    return [(var, where, [("why", reason), ("cost", cost), ("source", source)])
            for where, var, reason, cost, source in env_rows(m)]


def not_baked_blocks(m: Matrix) -> list[tuple[str, str, list[tuple[str, str]]]]:
    return [(var, gpus, [("why not", why), ("source", source)]) for gpus, var, why, source in not_baked_rows(m)]


def stack_rows(m: Matrix) -> list[tuple[str, ...]]:
    rows = []
    for s in m.stacks:
        rel = m.torch_release(s.torch)
        install = m.bases.toolchains[s.toolchain].install
        locked = [arch for arch in m.stack_arches(s) if lock_path(m.directory, s.id, arch).is_file()]
        index = m.torch_index(rel, s.cuda)
        lock = (", ".join(locked) if locked else
                f"none (torch from {urlsplit(index).hostname})" if index else "none yet")
        rows.append((s.id, s.python, s.cuda, s.torch, rel.torchvision, s.deepspeed, s.os,
                     f"PyPI {install.package} {s.cuda_toolkit}" if install else "NVIDIA devel image",
                     m.driver_floor(s.cuda).min_driver, lock, s.base_images.builder, s.base_images.runtime))
    return rows


def pinning(m: Matrix) -> str:
    """What is pinned for the matrix's stacks, said once under the stack table: Python packages
    by hash lock, OS packages by OS lock, base images by digest, each counted, never implied."""
    ids = [s.id for s in m.stacks]
    unlocked = [s.id for s in m.stacks if not any(lock_path(m.directory, s.id, a).is_file() for a in m.stack_arches(s))]
    os_locked = [s.id for s in m.stacks if any(os_lock_path(m.directory, s.id, a).is_file() for a in m.stack_arches(s))]
    bases = sorted({b for s in m.stacks for b in (s.base_images.builder, s.base_images.runtime)})
    by_digest = [b for b in bases if "@sha256:" in b or b in m.base_digests]
    python = (f"Python packages by a hash lock for {len(ids) - len(unlocked)} of {len(ids)} stacks"
              + (f" (none yet for {', '.join(unlocked)}: `envbuild lock` makes one where their index answers)"
                 if unlocked else ""))
    osp = (f"OS packages by an OS lock for {len(os_locked)} of {len(ids)} stacks" if os_locked else
           "OS packages: no stack has an OS lock yet, so apt installs the archive's newest (`envbuild lock --os`)")
    base = f"base images by digest: {len(by_digest)} of {len(bases)} (the rest by tag; `envbuild lock --bases`)"
    return f"pinned: {python}; {osp}; {base}."


def gpu_rows(m: Matrix) -> list[tuple[str, ...]]:
    rows = []
    for p in m.gpus:
        floor = ""
        if p.requires:
            floor = ", ".join(f"{k} {v}" for k, v in (("torch", p.requires.torch), ("CUDA", p.requires.cuda)) if v)
        env = ", ".join(f"{e.name}={e.value}" + (f" ({condition(m, e)})" if e.node else "") for e in p.env)
        rows.append((p.name, ", ".join(p.aliases), p.cc + (" (arch)" if p.cc_inferred else ""),
                     " or ".join(map(str, p.memory_gb)), p.generation, p.interconnect, floor, env))
    return rows


ENV_HEADERS = ("gpu", "variable", "reason", "cost", "source")
NOT_BAKED_HEADERS = ("gpus", "variable", "why not", "source")


def condition(m: Matrix, e) -> str:
    """When a default applies: its torch range, and the node conditions checked at start-up,
    each device condition by its label (fabrics.yaml node_conditions).

    >>> from envbuild.knowledge.matrix import load_matrix
    >>> m = load_matrix()
    >>> [condition(m, e) for e in m.gpu("rtx4090").env if e.name == "NCCL_IB_DISABLE"]
    ['on nodes with driver < 550.40.07 and no InfiniBand', 'on nodes with driver < 550.40.07 and InfiniBand']
    """
    parts = []
    if e.when:
        parts.append(f"torch {e.when['torch']}")
    if e.node:
        node = []
        if e.node.driver_below:
            node.append(f"driver < {e.node.driver_below}")
        for name, state in e.node.conditions.items():
            declared = m.fabrics_file.node_conditions.get(name)
            node.append(("no " if state == "absent" else "") + (declared.label if declared else name))
        parts.append("on nodes with " + " and ".join(node))
    return "; ".join(parts)


# Where an image_env entry applies (gpus.yaml `toolchain`), as the tables say it.
TOOLCHAIN_NOTE = {"kept": " (with --keep-toolchain)", "lean": " (without --keep-toolchain)", None: ""}


def env_rows(m: Matrix) -> list[tuple[str, ...]]:
    """Every default with its reason, cost and source: what every image bakes first (values in
    {braces} are filled in per image), then the defaults every GPU gets, then per GPU."""
    rows = []
    for e in m.gpus_file.image_env:
        rows.append(("every image" + TOOLCHAIN_NOTE[e.toolchain], f"{e.name}={e.value}", e.reason, e.cost, e.source))
    for e in m.gpus_file.common_env:
        rows.append(("all" + (f" ({condition(m, e)})" if condition(m, e) else ""), f"{e.name}={e.value}",
                     e.reason, e.cost, e.source))
    for p in m.gpus:
        for e in p.env:
            rows.append((p.name + (f" ({condition(m, e)})" if condition(m, e) else ""), f"{e.name}={e.value}",
                         e.reason, e.cost, e.source))
    return rows


def not_baked_rows(m: Matrix) -> list[tuple[str, ...]]:
    return [(", ".join(d.gpus), f"{d.name}={d.value}", d.why, d.source) for d in m.gpus_file.not_baked]


def gpu_json(m: Matrix) -> list[dict]:
    out = []
    for p in m.gpus:
        d = p.model_dump(exclude_none=True)
        d["sm"] = p.sm
        # Everything an image for this GPU bakes, in the image's order: what every image bakes
        # (values with {placeholders} filled in per image), the defaults every GPU gets, the
        # default fabric's (its node-decided ones apply at start-up), then the GPU's own `env`.
        d["image_env"] = [e.model_dump(exclude_none=True) for e in m.gpus_file.image_env]
        d["common_env"] = [e.model_dump(exclude_none=True) for e in m.gpus_file.common_env]
        d["fabric_env"] = [e.model_dump(exclude_none=True) for e in m.fabric(None).env]
        d["not_baked"] = [n.model_dump() for n in m.gpus_file.not_baked if p.name in n.gpus or "all" in n.gpus]
        out.append(d)
    return out


FABRIC_HEADERS = ("fabric", "tag suffix", "provided by", "NCCL net", "what it adds", "size")


def fabric_rows(m: Matrix) -> list[tuple[str, ...]]:
    """One row per fabric: what it puts in the image (per OS release) and what it costs."""
    rows = []
    for f in m.fabrics:
        by_os = {fam: [p for n in f.needs for p in family.capabilities.get(n, {}).get("runtime", [])]
                 for fam, family in m.bases.families.items()}
        adds = "; ".join(f"{fam}: {', '.join(pkgs)}" for fam, pkgs in by_os.items() if pkgs)
        if f.build:
            adds += ("; " if adds else "") + "built: " + ", ".join(f"{x.name} {x.version}" for x in f.build.sources)
        if f.host_paths:
            adds += ("; " if adds else "") + "from the host: " + ", ".join(f.host_paths)
        rows.append((f.name + (" (default)" if f.name == m.fabrics_file.default else ""), f.tag or "-",
                     f.provided_by, f.transport, adds or "nothing", f.size))
    return rows


def fabric_env_rows(m: Matrix) -> list[tuple[str, ...]]:
    """Every environment default a fabric sets, with its condition, reason, cost and source."""
    return [(f.name + (f" ({condition(m, e)})" if condition(m, e) else ""), f"{e.name}={e.value}", e.reason, e.cost,
             e.source) for f in m.fabrics for e in f.env]


def node_condition_rows(m: Matrix) -> list[tuple[str, ...]]:
    """Each node condition fabrics.yaml declares: its name, label, which devices count, meaning, source."""
    rows = []
    for name, c in m.fabrics_file.node_conditions.items():
        devices = ("every RDMA device" if c.devices == "any" else "the devices with " + " and ".join(
            f"{what} {' or '.join(words)}" for what, words in (("kernel driver", c.devices.drivers),
                                                              ("a link layer", c.devices.link_layers)) if words))
        rows.append((name, c.label, devices, c.means, c.source))
    return rows


def fabric_json(m: Matrix) -> list[dict]:
    return [{**f.model_dump(exclude_none=True), "default": f.name == m.fabrics_file.default} for f in m.fabrics]


def extension_fits(m: Matrix, ext) -> tuple[list[str], list[str], dict[str, str]]:
    """(GPUs it can be built for, stacks it builds on, each with the CPU architectures, why each
    other stack cannot): the ext-* rules, for `envbuild extensions` and the docs."""
    gpus = rules.extension_gpus(m, ext)
    stacks, refused = [], {}
    for s in m.stacks:
        fits, why = [], []
        for arch in m.stack_arches(s):
            try:
                lock = stack_lock(m, s, arch)
            except EnvbuildError:
                lock = None
            # the stack's lock and the extension's own (matrices/locks/ext), as a render reads them
            own = ext_lock(m, ext, s, arch, lock)
            locked = {*lock.pins(), *(own.pins() if own else ())} if lock else None
            rejections = rules.extension_rejections(m, s, ext, arch, locked)
            if rejections:
                why += [f"[{r.rule}] {r.message}" for r in rejections if f"[{r.rule}] {r.message}" not in why]
            else:
                fits.append(arch)
        if fits:
            stacks.append(f"{s.id} ({', '.join(fits)})")
        else:
            refused[s.id] = "; ".join(why)
    return gpus, stacks, refused


def extension_json(m: Matrix) -> list[dict]:
    out = []
    for ext in m.extensions.values():
        gpus, stacks, refused = extension_fits(m, ext)
        out.append({**ext.model_dump(exclude_none=True), "gpus": gpus, "stacks": stacks, "refused": refused})
    return out


def extension_fields(e: dict) -> list[tuple[str, str]]:
    """`envbuild extensions`' rows for one entry of extension_json: label, text."""
    return [("import", ", ".join(e["packages"] + e["modules"])),
            *((("op libraries", f"{', '.join(e['op_libraries'])} (torch.ops.load_library)"),)
              if e.get("op_libraries") else ()),
            ("GPUs", f"compute capability >= {e['min_cc']}, hosts {', '.join(e['cpu_arch'])}: {', '.join(e['gpus'])}"),
            ("stacks", ", ".join(e["stacks"]) or "none"),
            *((f"not {sid}", why) for sid, why in e["refused"].items()),
            *((("sdist", f"{e['sdist']['url']} (sha256 {e['sdist']['sha256']})"),) if e.get("sdist") else ()),
            *((f"wheel {w['cpu_arch']}", f"{w['url']} (sha256 {w['sha256']})") for w in e.get("wheels", [])),
            *(("source" + (f" {a['path']}" if a["path"] != "." else ""),
               f"{a['url']} ({a['version']}; tar stream sha256 {a.get('tar_sha256') or 'not recorded'})")
              for a in e.get("archives", [])),
            *((("not buildable", e["unbuildable"]),) if e.get("unbuildable") else ()),
            *((("needs", ", ".join(e["needs"])),) if e.get("needs") else ()),
            *((("stable ABI", f"torch {e['stable_abi']}: cached by CUDA major and arches only"),)
              if e.get("stable_abi") else ()),
            *((("run-time compile", f"{e['run_time_compile']['image']} ({e['run_time_compile']['source']})"),)
              if e.get("run_time_compile") else ()),
            ("build", (f"{e['memory_per_job_gib']:g} GiB per compile job; " if e.get("memory_per_job_gib") else "")
             + e["build_time"]),
            *((f"patch {p['file']}", f"for torch {p['torch']}: {' '.join(p['old'].split())} -> "
                                     f"{' '.join(p['new'].split())} ({p['source']})") for p in e.get("patches", [])),
            *((f"source {k}", v) for k, v in e["sources"].items())]


def markdown(headers, rows) -> str:
    esc = lambda c: str(c).replace("|", "\\|")  # noqa: E731
    lines = ["| " + " | ".join(headers) + " |", "|" + "---|" * len(headers)]
    lines += ["| " + " | ".join(esc(c) for c in r) + " |" for r in rows]
    return "\n".join(lines)


_BLOCK = re.compile(r"(<!-- generated:(\w+) -->\n)(.*?)(<!-- /generated -->)", re.S)


def generated_blocks(m: Matrix) -> dict[str, str]:
    """The Markdown of every generated block, by the NAME of its `<!-- generated:NAME -->` marker."""
    structural = "\n".join(f"- `{e.name}={e.value}`{TOOLCHAIN_NOTE[e.toolchain]}: {e.reason}."
                           + (f" Cost: {e.cost}." if e.cost else "") + f" Source: {e.source}."
                           for e in m.gpus_file.image_env)
    common = "\n".join(f"- `{e.name}={e.value}`" + (f" ({condition(m, e)})" if condition(m, e) else "")
                       + f": {e.reason}. Cost: {e.cost}. Source: {e.source}."
                       for e in m.gpus_file.common_env)
    per_gpu = "\n".join(f"- {p.name}: `{e.name}={e.value}`" + (f" ({condition(m, e)})" if condition(m, e) else "")
                        + f": {e.reason}. Cost: {e.cost}. Source: {e.source}."
                        for p in m.gpus for e in p.env)
    floors = markdown(("CUDA", "min driver (Linux)", "branch", "source"),
                      [(f"{f.cuda}.x", f.min_driver, f.branch, f.source) for f in m.cuda_file.driver_floors]
                      + [(f"any, on {gen} GPUs", f.min_driver, f.branch, f.source)
                         for gen, f in m.cuda_file.generation_driver_floors.items()]
                      + [(f"any, on {gpu}", f.min_driver, f.branch, f.source)
                         for gpu, f in m.cuda_file.gpu_driver_floors.items()])
    notes = "\n".join(f"- `{sid}`: {note}" for sid, note in stack_notes(m))
    example = "torch2.15.0-cu132-py3.12-ds0.19.8-h20"
    jobs = {"job_apptainer": job_script(Job(f"/shared/images/{example}.sif", "apptainer")),
            "job_pyxis": job_script(Job(f"ghcr.io#acme/envbuild:{example}", "pyxis"))}
    return {
        **{name: f"```bash\n{text}```" for name, text in jobs.items()},
        "stacks": markdown(STACK_HEADERS, stack_rows(m)) + (f"\n\nNotes:\n\n{notes}" if notes else "")
                  + "\n\nDriver floors (`matrices/cuda.yaml`): "
                  + m.cuda_file.forward_compat + "\n\n" + floors,
        "fabrics": markdown(FABRIC_HEADERS, fabric_rows(m)) + "\n\n" + "\n".join(
            f"- {where}: `{var}`: {why}. Cost: {cost}. Source: {src}." for where, var, why, cost, src in fabric_env_rows(m))
                   + "\n\nThe node conditions a default's `node:` may name (`node_conditions`; beside the built-in "
                     "`driver_below`), decided at start-up from the definition the manifest carries:\n\n" + "\n".join(
            f"- `{name}` ({label}; counts {devices}): {means}. Source: {src}." for name, label, devices, means, src
            in node_condition_rows(m)),
        "gpus": markdown(GPU_HEADERS, gpu_rows(m))
                + "\n\nWhat every image bakes (`image_env`; a value in {braces} is filled in per image):\n\n"
                + structural + "\n\nEvery image also gets:\n\n" + common
                + "\n\nPer GPU:\n\n" + per_gpu
                + "\n\nConsidered and not baked:\n\n" + markdown(NOT_BAKED_HEADERS, not_baked_rows(m)),
    }


def update_generated(text: str, m: Matrix) -> str:
    """`text` with every generated block replaced by the matrix's current Markdown; the rest of
    the text, and a file without markers, is returned unchanged. An unknown block name is an
    error (a typo would otherwise leave a block that is never refreshed).

    >>> from envbuild.knowledge.matrix import load_matrix
    >>> update_generated("prose\\n", load_matrix())
    'prose\\n'
    """
    blocks = generated_blocks(m)

    def sub(match):
        if match.group(2) not in blocks:
            raise EnvbuildError(f"unknown generated block <!-- generated:{match.group(2)} -->; the known blocks are "
                                f"{', '.join(sorted(blocks))}.")
        return match.group(1) + blocks[match.group(2)] + "\n" + match.group(4)

    return _BLOCK.sub(sub, text)


def refresh_generated(path: Path, m: Matrix, check: bool) -> bool:
    """Rewrite the generated blocks in the Markdown file `path`; with check, only report whether
    they are current (True: nothing to change)."""
    text = read_text(path, "Markdown file", "markdown")
    new = update_generated(text, m)
    if new == text:
        return True
    if not check:  # atomically, and only over the text just read (not over an edit made meanwhile)
        write_owned(path, new.encode(), lambda old: old.decode("utf-8", "replace").removeprefix("\ufeff") == text,
                    "It changed while the tables were being generated; run the command again.")
    return False


# The names `envbuild readme-tables` and older callers use: the tables lived in the README.
readme_blocks = generated_blocks
update_readme = update_generated
refresh_readme = refresh_generated
