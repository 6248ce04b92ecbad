"""Real builds on a real Docker engine and registry (scripts/host-setup.sh starts them).

One h20 image of the PyPI-CUDA-13 stack (cpu_adam + fused_adam for sm_90, and the CUDA
extension causal-conv1d compiled for sm_90: about 8 minutes on 2 cores the first time) is
built once per module, on the debootstrap base, with a throw-away CA and an index URL
holding a credential passed as secrets. Everything below uses that image; only the h100 variant
and the broken build build again (the first from cache). Every build goes through
conftest.run_build; the image repository is this run's own (conftest.unique), in the engine and
in the registry.
"""

from __future__ import annotations

import hashlib
import json
import os
import re
import secrets
import shutil
import socket
import subprocess
import sys
import tarfile
import time
import urllib.request
from pathlib import Path

import pytest

import conftest
from conftest import (BASE_IMAGE, CA_BUNDLE, ROOT, alarm_deadline, docker_socket, run_build, run_cli,
                      run_extend_build, remove_images, unique)
from envbuild.supply.ci import real_build_stack
from envbuild.engine.docker import OWNER_LABEL
from envbuild.knowledge.matrix import load_matrix

CI_MATRIX = load_matrix()
CI_STACK = real_build_stack(CI_MATRIX)
STACK = CI_STACK.id
REPO = unique("envbuild-test")
REGISTRY = "127.0.0.1:5000"
OPS = "cpu_adam,fused_adam"
EXT = "causal-conv1d"  # a small real CUDA extension, compiled for sm_90 only (about 8 minutes on 2 cores)


docker = conftest.docker


@pytest.fixture(scope="module")
def work(tmp_path_factory):
    yield tmp_path_factory.mktemp("e2e")
    remove_images(REPO)


@pytest.fixture(scope="module")
def state(work):
    """A private smoke-record store, so records of other runs cannot vouch for these images."""
    d = work / "state"
    d.mkdir()
    return {"ENVBUILD_STATE_DIR": str(d)}


@pytest.fixture(scope="module")
def test_ca(work):
    """This machine's CA bundle (the TLS proxy's CA is in it) plus a throw-away CA made here,
    whose base64 body is a marker no image may contain."""
    key, crt = work / "ca.key", work / "ca.crt"
    subprocess.run(["openssl", "req", "-x509", "-newkey", "rsa:2048", "-nodes", "-days", "2", "-subj",
                    f"/CN=envbuild-leak-test-{secrets.token_hex(4)}", "-keyout", str(key), "-out", str(crt)],
                   check=True, capture_output=True)
    bundle = work / "bundle.pem"
    bundle.write_bytes(Path(CA_BUNDLE).read_bytes() + crt.read_bytes())
    body = [ln for ln in crt.read_text().splitlines() if ln and not ln.startswith("-----")]
    return {"bundle": bundle, "markers": [body[3], body[-3]]}


@pytest.fixture(scope="module")
def credential():
    """Index and mirror URLs holding credentials (PyPI and Debian's mirror ignore them)."""
    tokens = {k: "tok" + secrets.token_hex(12) for k in ("pip", "torch", "apt")}
    return {"indexes": {"--pip-index-url": f"https://envbuild-ci:{tokens['pip']}@pypi.org/simple",
                        "--torch-index-url": f"https://envbuild-ci:{tokens['torch']}@pypi.org/simple",
                        "--apt-mirror": f"http://envbuild-ci:{tokens['apt']}@deb.debian.org"},
            "tokens": list(tokens.values())}


def _build(work, state, gpu, *extra, name=None, **machine_args):
    out = work / (name or gpu)
    r = run_build("--gpu", gpu, "--stack", STACK, "--ds-ops", OPS, "--ext", EXT, "--image-repo", REPO,
                  "-o", str(out), *extra, env=state, **machine_args)
    assert r.returncode == 0, r.stdout[-3000:] + r.stderr[-3000:]
    return r, out


def _tags(out: Path) -> tuple[str, str]:
    text = (out / "manifest.json").read_text()
    readable = f"{REPO}:{json.loads(text)['tag']}"
    ids = docker("images", "--format", "{{.Repository}}:{{.Tag}}", REPO).stdout.split()
    content = [t for t in ids if t.startswith(readable + "-") and re.fullmatch(r".*-[0-9a-f]{12}", t)]
    return readable, content[0] if content else ""


@pytest.fixture(scope="module")
def compile_cache(work):
    """A real compile cache: Debian's redis-server on a free port of 127.0.0.1, with a password
    (a secret the no-secret scan looks for in every layer)."""
    password = "pw" + secrets.token_hex(12)
    with conftest.redis_server(work, password) as port:
        yield {"url": f"redis://:{password}@127.0.0.1:{port}", "password": password}


@pytest.fixture(scope="module")
def h20(docker_engine, work, state, test_ca, credential, compile_cache):
    r, out = _build(work, state, "h20", "--compile-cache", compile_cache["url"], ca_cert=test_ca["bundle"],
                    indexes=credential["indexes"])
    readable, content = _tags(out)
    return {"out": out, "image": readable, "content_tag": content, "stdout": r.stdout}


def test_the_ops_were_compiled_through_the_compile_cache_or_taken_from_the_wheel_cache(h20):
    """The DeepSpeed step ran with the compile cache (sccache on the test's Redis) and said what
    it compiled by category, or took DeepSpeed's wheel from the wheel cache and compiled nothing;
    a step the layer cache served ran neither."""
    log = (h20["out"] / "build.log").read_text()
    lines = [json.loads(m) for m in re.findall(r"envbuild: compiles (\{.*\})$", log, re.M)]
    stats = [s for s in lines if s.get("step") == "deepspeed"]  # the extensions step runs beside it
    if "DeepSpeed: cached wheel" in log:
        assert stats and stats[0]["runs"] == {}
    elif "deepspeed.sh" in log and stats:
        assert "compile cache: sccache 0.16.0 under g++ and nvcc (redis)" in log
        assert all(not s["errors"] for s in stats), stats
        ds = stats[0]
        assert ds["runs"].get("nvcc") and (ds["hits"] or ds["misses"])
        assert {"c++ [gcc]", "cubin [ptxas]"} <= set(ds["hits"]) | set(ds["misses"]), ds


def test_build_tags_labels_and_env(h20):
    s = CI_STACK
    assert h20["image"] == (f"{REPO}:torch{s.torch}-cu{s.cuda.replace('.', '')}-py{s.python}-ds{s.deepspeed}"
                            f"-h20-ccv1.7.0-ops-cpu_adam.fused_adam")
    assert h20["content_tag"], "no content tag"
    a = json.loads(docker("image", "inspect", h20["image"]).stdout)[0]
    b = json.loads(docker("image", "inspect", h20["content_tag"]).stdout)[0]
    assert a["Id"] == b["Id"]
    labels = a["Config"]["Labels"]
    assert labels["io.envbuild.gpu"] == "h20" and labels["io.envbuild.ds-ops"] == OPS
    assert labels["io.envbuild.extensions"] == "causal-conv1d==1.7.0"
    assert labels["org.opencontainers.image.version"] == h20["image"].split(":", 1)[1]
    env = dict(e.split("=", 1) for e in a["Config"]["Env"])
    assert env["NCCL_P2P_DISABLE"] == "1" and env["DS_ACCELERATOR"] == "cuda"
    log = (h20["out"] / "build.log").read_text()
    assert "deepspeed.sh /opt/envbuild-setup/lock/deepspeed.txt" in log and "--require-hashes" in log
    lock_text = (ROOT / "matrices" / "locks" / f"{STACK}.x86_64.txt").read_bytes()
    assert labels["io.envbuild.lock"] == "sha256:" + hashlib.sha256(lock_text).hexdigest()


def test_the_image_holds_exactly_its_lock_and_pip_check_passes(h20):
    """Every distribution in the venv is the lock's, at the lock's version, and nothing else
    (ninja, build-only, dropped with DeepSpeed's Requires-Dist of it); pip check agrees."""
    from envbuild.knowledge.lock import parse_lock

    r = docker("run", "--rm", h20["image"], "pip", "check", check=False, timeout=300)
    assert r.returncode == 0 and "No broken requirements found." in r.stdout, r.stdout[-2000:] + r.stderr[-500:]
    probe = ("import json; from importlib import metadata; "
             "print(json.dumps({d.metadata['Name']: d.version for d in metadata.distributions()}))")
    found = json.loads(docker("run", "--rm", h20["image"], "python", "-c", probe, timeout=300).stdout)
    installed = {re.sub(r"[-_.]+", "-", name).lower(): version for name, version in found.items()}
    lock = parse_lock(docker("run", "--rm", h20["image"], "cat", "/opt/envbuild/lock.txt").stdout)
    built = docker("run", "--rm", h20["image"], "cat", "/opt/envbuild/built/extensions-lock.txt").stdout
    assert re.search(r"^causal-conv1d==1\.7\.0 --hash=sha256:[0-9a-f]{64}$", built, re.M), built
    assert installed == {**{name: v for name, v in lock.pins().items() if name not in lock.build_only},
                         "causal-conv1d": "1.7.0"}
    assert "ninja" not in installed and "ninja" in lock.pins()


@pytest.fixture(scope="module")
def smoked(h20, state):
    """The h20 image's smoke run (its passing record is what lets push publish it)."""
    return run_cli("smoke", h20["image"], "--json", env=state, timeout=1200)


def test_smoke_passes_on_cpu(smoked, state):
    r = smoked
    assert r.returncode == 0, r.stdout[-4000:] + r.stderr[-2000:]
    rep = json.loads(r.stdout)
    checks = {c["name"]: c for c in rep["checks"]}
    assert rep["ok"] and rep["mode"] == "cpu"
    for name in ("versions", "nccl", "nccl_copies", "ds_record", "no_jit", "cpu_adam", "extensions", "compilers", "guard",
                 "lock", "env", "fabric", "collectives"):
        assert checks[name]["ok"] and not checks[name].get("skipped"), checks[name]
    # the wheel's libnccl, asked its own version after `import torch`, and the only one in the image
    assert checks["nccl"]["data"]["linked"] == "dynamic" and "/nvidia/nccl/lib/libnccl.so" in checks["nccl"]["data"]["path"]
    assert checks["nccl_copies"]["detail"].startswith("one NCCL in "), checks["nccl_copies"]
    assert "fabric ib (NCCL net IB)" in checks["fabric"]["detail"]
    assert "fused_adam" in checks["no_jit"]["detail"]
    records = list(Path(state["ENVBUILD_STATE_DIR"], "smoke").glob("*.json"))
    assert len(records) == 1 and json.loads(records[0].read_text())["ok"]


NO_JIT_PROBE = r"""
import json, os, shutil, time
import torch.utils.cpp_extension as ce
def refuse(*a, **k): raise RuntimeError("JIT compile attempted")
ce.load = ce.load_inline = ce._jit_compile = refuse
found = {c: shutil.which(c) for c in ("ninja", "gcc", "g++", "cc", "c++", "nvcc", "x86_64-linux-gnu-g++")}
import torch
from deepspeed.ops.op_builder import CPUAdamBuilder, FusedAdamBuilder
t = time.time()
CPUAdamBuilder().load(); FusedAdamBuilder().load()
from deepspeed.ops.adam import DeepSpeedCPUAdam
p1 = torch.nn.Parameter(torch.randn(64)); p2 = torch.nn.Parameter(p1.detach().clone())
g = torch.randn(64); p1.grad = g.clone(); p2.grad = g.clone()
DeepSpeedCPUAdam([p1], lr=1e-2, adamw_mode=False).step(); torch.optim.Adam([p2], lr=1e-2).step()
print(json.dumps({"compilers": {k: v for k, v in found.items() if v}, "load_s": time.time() - t,
                  "diff": float((p1 - p2).abs().max()), "ext": sorted(os.listdir("/ext")),
                  "home_writable": os.access(os.environ["HOME"], os.W_OK)}))
"""


def test_the_guard_refuses_another_torch_and_admits_a_compatible_package(h20):
    """vllm#34224: a pip install that needs another torch silently replaced it under the
    pre-built ops. In the image, pip reads the constraints (PIP_CONSTRAINT): asking for another
    torch fails with the resolver's conflict and torch stays; a package that fits installs.
    (PyPI through this machine's TLS proxy: its CA bundle is mounted for pip.)"""
    run = ["run", "--rm", "--network", "host", "-v", f"{CA_BUNDLE}:/host-ca.pem:ro", "-e", "PIP_CERT=/host-ca.pem",
           h20["image"], "bash", "-c"]
    script = ("pip install --dry-run torch==2.14.0 > /tmp/out 2>&1; echo rc=$?; cat /tmp/out; "
              "python -c 'import torch; print(\"torch\", torch.__version__)'")
    r = docker(*run, script, check=False, timeout=600)
    assert "rc=1" in r.stdout and "conflict" in r.stdout.lower(), r.stdout[-2000:] + r.stderr[-1000:]
    assert f"torch {CI_STACK.torch}" in r.stdout
    r = docker(*run, "pip install -q six && python -c 'import six, torch; print(\"ok\", torch.__version__)'",
               check=False, timeout=600)
    assert r.returncode == 0 and f"ok {CI_STACK.torch}" in r.stdout, r.stdout[-2000:] + r.stderr[-1000:]


def test_no_jit_with_stale_lock_readonly_home_no_compilers(h20, work):
    """Field reports 1 and 2: a stale `lock` in the extensions dir hangs a JIT build forever.
    The pre-built image never gets there: read-only root and home, read-only extensions
    dir with stale locks, no network, no ninja and no nvcc."""
    ext = work / "ext"
    for op in ("cpu_adam", "fused_adam"):
        (ext / op).mkdir(parents=True)
        (ext / op / "lock").write_text("")
    r = docker("run", "--rm", "--network", "none", "--read-only", "--tmpfs", "/tmp", "-v", f"{ext}:/ext:ro",
               "-e", "TORCH_EXTENSIONS_DIR=/ext", "-e", "HOME=/root", "-e", "DS_ACCELERATOR=cuda",
               h20["image"], "python", "-c", NO_JIT_PROBE, timeout=180)  # a hang is a timeout: a failure
    res = json.loads(r.stdout.strip().splitlines()[-1])
    # No ninja and no nvcc: nothing can JIT a DeepSpeed op. The C compiler is there on
    # purpose (torch.compile; the smoke test's torch_compile check runs it).
    assert not {"ninja", "nvcc"} & set(res["compilers"]) and "g++" in res["compilers"]
    assert res["diff"] < 1e-6 and not res["home_writable"]
    assert res["ext"] == ["cpu_adam", "fused_adam"]
    assert sorted(p.name for p in ext.rglob("*")) == ["cpu_adam", "fused_adam", "lock", "lock"]


def test_cpu_ops_are_portable(h20, work):
    """cpu_adam was compiled for x86-64-v3 (the wrapper's flag is in the DWARF producer),
    and holds no AVX-512 instruction."""
    cid = docker("create", h20["image"]).stdout.strip()
    try:
        dest = work / "ops"
        find = docker("run", "--rm", "--entrypoint", "sh", h20["image"], "-c",
                      "ls /opt/venv/lib/python3.11/site-packages/deepspeed/ops/adam/cpu_adam_op*.so").stdout.split()
        assert find, "cpu_adam .so not found"
        docker("cp", f"{cid}:{find[0]}", str(dest))
    finally:
        docker("rm", "-f", cid)
    asm = subprocess.run(["objdump", "-d", "--no-show-raw-insn", str(dest)], capture_output=True, text=True).stdout
    assert "%zmm" not in asm and "%ymm" in asm
    dwarf = subprocess.run(["objdump", "--dwarf=info", str(dest)], capture_output=True, text=True).stdout
    producers = set(re.findall(r"DW_AT_producer\s*:.*?(-march=\S+)", dwarf))
    assert producers == {"-march=x86-64-v3"}, producers


def test_the_extension_was_built_for_sm_90_only_hash_pinned_and_guarded(h20):
    """causal-conv1d was compiled here from its sdist (sha256 from extensions.yaml) for the GPU's
    arch only: cuobjdump found sm_90 and nothing else in its library (its setup.py asks for nine
    arches); the wheel's sha256 is in the record and the lock lines; the guard pins it like torch."""
    record = json.loads(docker("run", "--rm", h20["image"], "cat", "/opt/envbuild/built/extensions.json").stdout)
    (entry,) = record
    assert entry["name"] == "causal-conv1d" and entry["version"] == "1.7.0" and entry["arch_list"] == "9.0"
    assert list(entry["sass"].values()) == [["sm_90"]], entry["sass"]
    assert entry["determines"]["sdist_sha256"] == CI_MATRIX.extensions["causal-conv1d"].sdist.sha256
    built = docker("run", "--rm", h20["image"], "cat", "/opt/envbuild/built/extensions-lock.txt").stdout
    assert f"--hash=sha256:{entry['sha256']}" in built
    pins = docker("run", "--rm", h20["image"], "cat", "/etc/pip/constraint.txt").stdout
    assert re.search(r"^causal[-_]conv1d==1\.7\.0$", pins, re.M | re.I), pins


def test_h100_variant_reuses_every_heavy_layer(h20, work, state):
    r, out = _build(work, state, "h100")
    h100_image, _ = _tags(out)
    a = json.loads(docker("image", "inspect", h20["image"]).stdout)[0]["RootFS"]["Layers"]
    b = json.loads(docker("image", "inspect", h100_image).stdout)[0]["RootFS"]["Layers"]
    assert len(a) == len(b) and a[:-1] == b[:-1] and a[-1] != b[-1]  # only manifest.json differs
    log = (out / "build.log").read_text()
    runs = re.findall(r"^#\d+ \[(?:builder|runtime) [^\]]+\] RUN .*$", log, re.M)
    assert runs and len(re.findall(r"^#\d+ CACHED$", log, re.M)) >= len(runs)


def _registry_tags(name):
    try:
        with urllib.request.urlopen(f"http://{REGISTRY}/v2/{name}/tags/list", timeout=10) as f:
            return json.load(f).get("tags") or []
    except urllib.error.HTTPError:
        return []


def test_push_and_pull_back_by_digest(h20, smoked, state):
    r = run_cli("push", h20["image"], "--registry", REGISTRY, env=state, timeout=1800)
    assert r.returncode == 0, r.stdout + r.stderr
    digest = re.search(r"digest (sha256:[0-9a-f]{64})", r.stdout).group(1)
    tags = _registry_tags(REPO)
    assert h20["image"].split(":", 1)[1] in tags and h20["content_tag"].split(":", 1)[1] in tags
    pulled = docker("pull", f"{REGISTRY}/{REPO}@{digest}")
    assert pulled.returncode == 0


def _scan_bytes(data: bytes, needles: list[bytes], where: str, hits: list):
    for n in needles:
        if n in data:
            hits.append(f"{where}: {n[:12]!r}...")


def _secret_hits(image: str, needles: list[bytes]) -> list[str]:
    """Where any of `needles` occurs in `image`: its layers' files, its config (history, labels,
    env), `docker history` and `docker inspect`."""
    hits: list[str] = []
    scanned = 0
    # `docker save` read as it streams: the image is several GB, which a saved file would need on disk.
    with alarm_deadline(1800, "docker save"), \
            subprocess.Popen([conftest.DOCKER, "save", image], stdout=subprocess.PIPE) as save, \
            tarfile.open(fileobj=save.stdout, mode="r|") as outer:
        for member in outer:
            if not member.isfile():
                continue
            if member.name.endswith("layer.tar"):
                # Stream each layer: a venv layer is several GB.
                with tarfile.open(fileobj=outer.extractfile(member), mode="r|") as layer:
                    for f in layer:
                        if f.isfile():
                            data = layer.extractfile(f).read()
                            scanned += len(data)
                            _scan_bytes(data, needles, f"{member.name}:{f.name}", hits)
            else:  # the image config (history, labels, env) and the manifest
                _scan_bytes(outer.extractfile(member).read(), needles, member.name, hits)
    assert save.returncode == 0 and scanned > 1_000_000_000  # the scan really read the layers
    _scan_bytes(docker("history", "--no-trunc", image).stdout.encode(), needles, "docker history", hits)
    _scan_bytes(docker("image", "inspect", image).stdout.encode(), needles, "docker inspect", hits)
    return hits


def test_no_secret_in_any_layer_history_or_label(h20, test_ca, credential, compile_cache):
    needles = ([m.encode() for m in test_ca["markers"]] + [t.encode() for t in credential["tokens"]]
               + [compile_cache["password"].encode()])
    hits = _secret_hits(h20["image"], needles)
    for p in h20["out"].rglob("*"):
        if p.is_file():
            _scan_bytes(p.read_bytes(), needles, str(p), hits)
    assert hits == []
    # The scan can fail: the marker is really in the bundle the build used.
    assert all(n in test_ca["bundle"].read_bytes() for n in needles[:2])


def test_broken_build_fails_clearly_and_tags_nothing(docker_engine, work, state, matrix_copy_module):
    """An op that cannot compile: cutlass_ops without the closed deepspeed-kernels package
    (its is_compatible() does not check, so the compile itself fails)."""
    import yaml

    ds = matrix_copy_module / "deepspeed.yaml"
    data = yaml.safe_load(ds.read_text())
    assert data["ops"]["cutlass_ops"].pop("needs") == ["dskernels"]  # the rule that would stop it
    ds.write_text(yaml.safe_dump(data, sort_keys=False))
    out = work / "broken"
    r = run_build("--gpu", "h20", "--stack", STACK, "--ds-ops", "cutlass_ops", "--image-repo", REPO,
                  "--matrix-dir", str(matrix_copy_module), "-o", str(out), env=state)
    assert r.returncode == 1, r.stdout[-2000:] + r.stderr[-2000:]
    msg = r.stderr
    assert "image build failed at step" in msg and "deepspeed.sh /opt/envbuild-setup/lock/deepspeed.txt" in msg
    assert f"Full log: {out / 'build.log'}" in " ".join(msg.split()) and "No tag was applied" in msg
    assert "Traceback" not in msg
    tag = json.loads((out / "manifest.json").read_text())["tag"]
    assert docker("image", "inspect", f"{REPO}:{tag}", check=False).returncode != 0
    assert not [t for t in docker("images", "--format", "{{.Tag}}", REPO).stdout.split() if t.startswith(tag)]


def test_extend_adds_one_layer_on_the_stack_image_and_passes_its_smoke_test(h20, smoked, work, state, test_ca):
    """envbuild extend of the CI image with a small real set that depends on torch: every layer
    of the stack image is shared, torch is still the stack's, pip check ran in the build, the
    import check is in manifest.json, and the smoke test (lock check included) passes."""
    requirements = work / "lab-requirements.txt"
    requirements.write_text("accelerate\nsafetensors\neinops\n")
    out = work / "extended"
    r = run_extend_build("-r", str(requirements), "--gpu", "h20", "--stack", STACK, "--ds-ops", OPS, "--ext", EXT,
                         "--image-repo", REPO, "--name", "lab", "-o", str(out), ca_cert=test_ca["bundle"], env=state)
    assert r.returncode == 0, r.stdout[-3000:] + r.stderr[-3000:]
    image = f"{REPO}:{json.loads((out / 'manifest.json').read_text())['tag']}"
    stack_info = json.loads(docker("image", "inspect", h20["image"]).stdout)[0]
    info = json.loads(docker("image", "inspect", image).stdout)[0]
    stack_layers, layers = stack_info["RootFS"]["Layers"], info["RootFS"]["Layers"]
    assert layers[:len(stack_layers)] == stack_layers and len(layers) > len(stack_layers)
    log = (out / "build.log").read_text()
    assert "No broken requirements found." in log and "envbuild: imported accelerate (accelerate)" in log
    probe = ("import json, torch, accelerate, safetensors, einops; "
             "print(json.dumps([torch.__version__, json.load(open('/opt/envbuild/manifest.json'))['extend']['imports']]))")
    version, imports = json.loads(docker("run", "--rm", image, "python", "-c", probe, timeout=300).stdout)
    assert version.split("+")[0] == CI_STACK.torch and imports["accelerate"] == ["accelerate"]
    smoke = run_cli("smoke", image, "--json", env=state, timeout=1200)
    assert smoke.returncode == 0, smoke.stdout[-3000:] + smoke.stderr[-1000:]
    checks = {c["name"]: c for c in json.loads(smoke.stdout)["checks"]}
    assert checks["lock"]["ok"] and "and the extension's" in checks["lock"]["detail"], checks["lock"]


def test_a_tampered_hash_in_the_lock_fails_the_build_and_tags_nothing(h20, work, state, test_ca):
    """One changed sha256 (DeepSpeed's sdist) in a copy of the lock: pip refuses the file,
    names it and both hashes, envbuild says what that means, and no tag is applied. The
    torch layer is the h20 build's (its lock part is unchanged), so this fails in seconds."""
    matrix_dir = work / "matrices-tampered"
    shutil.copytree(ROOT / "matrices", matrix_dir)
    path = matrix_dir / "locks" / f"{STACK}.x86_64.txt"
    text = path.read_text()
    good = re.search(r"^deepspeed==\S+ \\\n    --hash=sha256:([0-9a-f]{64})", text, re.M).group(1)
    path.write_text(text.replace(good, "0" * 64))
    out = work / "tampered"
    r = run_build("--gpu", "h20", "--stack", STACK, "--ds-ops", OPS, "--ext", EXT, "--image-repo", REPO,
                  "--matrix-dir", str(matrix_dir), "-o", str(out), ca_cert=test_ca["bundle"], env=state)
    assert r.returncode == 1, r.stdout[-2000:] + r.stderr[-2000:]
    log = (out / "build.log").read_text()
    assert "THESE PACKAGES DO NOT MATCH THE HASHES" in log and "deepspeed" in log and good in log
    assert "the install from the stack's lock failed" in log
    assert "No tag was applied" in r.stderr and "Traceback" not in r.stderr
    from envbuild.builds.build import content_tag

    readable = json.loads((out / "manifest.json").read_text())["tag"]
    assert docker("image", "inspect", f"{REPO}:{content_tag(readable, out)}", check=False).returncode != 0
    # The readable tag is the h20 build's (same GPU and ops): still that image, not moved.
    assert docker("image", "inspect", "--format", "{{.Id}}", f"{REPO}:{readable}").stdout == \
        docker("image", "inspect", "--format", "{{.Id}}", h20["image"]).stdout


@pytest.fixture(scope="module")
def matrix_copy_module(work):
    d = work / "matrices"
    shutil.copytree(ROOT / "matrices", d)
    return d


NCCL_SONAMES = r"""
import json, re, sys, ctypes, glob
nccl = glob.glob("/opt/venv/lib/python*/site-packages/nvidia/nccl/lib/libnccl.so.2")[0]
named = sorted(set(m.decode() for m in re.findall(rb"lib(?:ibverbs|mlx5|rdmacm)\.so\.[0-9]+", open(nccl, "rb").read())))
loads = {}
for soname in named:
    try:
        ctypes.CDLL(soname); loads[soname] = True
    except OSError as e:
        loads[soname] = str(e)
print(json.dumps({"named": named, "loads": loads}))
"""


def test_the_image_has_the_verbs_user_space_nccl_dlopens(h20):
    """Issue: PyPI's NCCL names libibverbs.so.1 / libmlx5.so.1 and dlopens them at run time; the
    image had neither, so jobs fell back to sockets. Every verbs soname NCCL's own bytes name loads
    in the image, and the tools users reach for are there."""
    r = docker("run", "--rm", h20["image"], "python", "-c", NCCL_SONAMES, timeout=300)
    res = json.loads(r.stdout.strip().splitlines()[-1])
    assert "libibverbs.so.1" in res["named"] and "libmlx5.so.1" in res["named"], res
    assert all(ok is True for ok in res["loads"].values()), res
    r = docker("run", "--rm", h20["image"], "sh", "-c", "for t in ibv_devinfo ibv_devices; do command -v $t; done", timeout=120)
    assert r.stdout.split() == ["/usr/bin/ibv_devinfo", "/usr/bin/ibv_devices"]
    labels = json.loads(docker("image", "inspect", h20["image"]).stdout)[0]["Config"]["Labels"]
    assert labels["io.envbuild.fabric"] == "ib"


def _derived_image(h20, work, tag: str, run: str) -> str:
    """The h20 image with one more RUN line, tagged REPO:tag (what a broken image looks like)."""
    image = f"{REPO}:{tag}"
    ctx = work / f"{tag}-ctx"
    ctx.mkdir()
    (ctx / "Dockerfile").write_text(f"FROM {h20['image']}\nRUN {run}\n")
    docker("build", "--network", "host", "-t", image, str(ctx), env={**os.environ, "DOCKER_BUILDKIT": "1"})
    return image


def test_an_image_without_its_verbs_libraries_fails_smoke_and_is_not_pushed(h20, state, work):
    """The same image with rdma-core's libraries deleted: the smoke test's fabric check fails,
    naming the library, and push refuses the image; the registry gains nothing."""
    bad = _derived_image(h20, work, "no-verbs", "rm -f /usr/lib/*/libibverbs.so.1* /usr/lib/*/libmlx5.so.1*")
    before = _registry_tags(REPO)
    r = run_cli("smoke", bad, "--json", env=state, timeout=1200)
    assert r.returncode == 1, r.stdout[-3000:] + r.stderr[-2000:]
    checks = {c["name"]: c for c in json.loads(r.stdout)["checks"]}
    assert checks["fabric"]["ok"] is False and "libibverbs.so.1" in checks["fabric"]["detail"], checks["fabric"]
    assert checks["versions"]["ok"] and checks["no_jit"]["ok"]  # only what the fabric promises is missing
    r = run_cli("push", bad, "--registry", REGISTRY, env=state)
    assert r.returncode == 1 and "smoke test failed (fabric" in " ".join(r.stderr.split()), r.stderr
    assert _registry_tags(REPO) == before and "no-verbs" not in before
    docker("rmi", bad, check=False)


def test_an_image_with_a_second_nccl_fails_smoke_naming_both(h20, state, work):
    """A copy of the wheel's libnccl.so.2 planted where the loader looks (as an OS package or a
    second wheel would put one): the smoke test's nccl_copies check fails naming both files, and
    push refuses the image."""
    bad = _derived_image(h20, work, "two-nccl",
                         "cp /opt/venv/lib/python3.11/site-packages/nvidia/nccl/lib/libnccl.so.2 /usr/local/lib/")
    r = run_cli("smoke", bad, "--json", env=state, timeout=1200)
    assert r.returncode == 1, r.stdout[-3000:] + r.stderr[-2000:]
    checks = {c["name"]: c for c in json.loads(r.stdout)["checks"]}
    detail = checks["nccl_copies"]["detail"]
    assert not checks["nccl_copies"]["ok"] and "/usr/local/lib/libnccl.so.2 (" in detail, detail
    assert "/site-packages/nvidia/nccl/lib/libnccl.so.2" in detail
    assert checks["nccl"]["ok"], checks["nccl"]  # torch still loads the wheel's, by its RPATH
    r = run_cli("push", bad, "--registry", REGISTRY, env=state)
    assert r.returncode == 1 and "nccl_copies" in r.stderr, r.stderr
    assert "Traceback" not in r.stderr
    docker("rmi", bad, check=False)


def test_failing_smoke_test_blocks_push(h20, state, work):
    """An image whose pre-built cpu_adam went missing fails its smoke test (the op would
    JIT-compile, which the smoke test refuses), and push refuses it; an image never
    smoke-tested is refused too. The registry gains nothing."""
    bad = _derived_image(h20, work, "broken-smoke", "rm /opt/venv/lib/python3.11/site-packages/deepspeed/ops/adam/cpu_adam_op*.so")
    before = _registry_tags(REPO)
    r = run_cli("push", bad, "--registry", REGISTRY, env=state)
    assert r.returncode == 1 and "no smoke test has been recorded" in r.stderr, r.stderr
    r = run_cli("smoke", bad, env={**state, "COLUMNS": "250"}, timeout=1200)
    assert r.returncode == 1 and "FAILED" in r.stdout and "cpu_adam FAILED" in r.stdout, r.stdout[-3000:]
    r = run_cli("push", bad, "--registry", REGISTRY, env=state)
    assert r.returncode == 1 and "smoke test failed (no_jit" in " ".join(r.stderr.split()), r.stderr
    assert "Traceback" not in r.stderr
    assert _registry_tags(REPO) == before and "broken-smoke" not in before


def _free_port():
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


def test_unreachable_registry_is_a_clear_error(h20, smoked, state):
    port = _free_port()
    r = run_cli("push", h20["image"], "--registry", f"127.0.0.1:{port}", env=state)
    assert r.returncode == 1 and f"registry 127.0.0.1:{port} cannot be reached" in r.stderr, r.stderr


def test_registry_refusing_authentication_is_a_clear_error(h20, smoked, state, work):
    """A second real registry, with htpasswd auth, and no `docker login`."""
    port = _free_port()
    d = work / "authreg"
    d.mkdir()
    subprocess.run(["htpasswd", "-Bbc", str(d / "htpasswd"), "someone", "pw"], check=True, capture_output=True)
    (d / "config.yml").write_text(
        "version: 0.1\nstorage:\n  filesystem:\n    rootdirectory: " + str(d / "data") +
        f"\nhttp:\n  addr: 127.0.0.1:{port}\nauth:\n  htpasswd:\n    realm: test\n    path: {d / 'htpasswd'}\n")
    reg = subprocess.Popen(["docker-registry", "serve", str(d / "config.yml")], stdout=subprocess.DEVNULL,
                           stderr=subprocess.DEVNULL)
    try:
        for _ in range(50):
            try:
                urllib.request.urlopen(f"http://127.0.0.1:{port}/v2/", timeout=1)
            except urllib.error.HTTPError:
                break
            except OSError:
                time.sleep(0.2)
        r = run_cli("push", h20["image"], "--registry", f"127.0.0.1:{port}", env=state, timeout=600)
        assert r.returncode == 1, r.stdout + r.stderr
        assert "refused authentication" in r.stderr and f"docker login 127.0.0.1:{port}" in r.stderr, r.stderr
    finally:
        reg.terminate()
        reg.wait(timeout=10)
        shutil.rmtree(d / "data", ignore_errors=True)


def _own_registry(work, name):
    """A second real registry (docker-registry from Debian) on a free port, empty."""
    port = _free_port()
    d = work / name
    d.mkdir()
    (d / "config.yml").write_text("version: 0.1\nstorage:\n  filesystem:\n    rootdirectory: " + str(d / "data") +
                                  f"\nhttp:\n  addr: 127.0.0.1:{port}\n")
    reg = subprocess.Popen(["docker-registry", "serve", str(d / "config.yml")], stdout=subprocess.DEVNULL,
                           stderr=subprocess.DEVNULL)
    for _ in range(50):
        try:
            urllib.request.urlopen(f"http://127.0.0.1:{port}/v2/", timeout=1).close()
            break
        except OSError:
            time.sleep(0.2)
    return reg, port


def _tags_in(port) -> list[str]:
    try:
        with urllib.request.urlopen(f"http://127.0.0.1:{port}/v2/{REPO}/tags/list", timeout=10) as f:
            return json.load(f).get("tags") or []
    except urllib.error.HTTPError as e:
        assert e.code == 404
        return []


def test_a_registry_failing_or_dropping_the_connection_mid_push_publishes_nothing_then_a_rerun_succeeds(
        h20, smoked, state, work):
    """A TCP proxy in front of a real registry: every manifest upload answered 500 -> push fails
    after its retries with the registry's words, exit 1, no tag in the registry or left locally;
    then the connection dropped on the first blob upload and the first two manifest uploads ->
    the same command succeeds (Docker's and envbuild's retries), and the digest pulls back."""
    sys.path.insert(0, str(ROOT / "tests" / "tools"))
    from faulty_proxy import FaultyProxy

    reg, port = _own_registry(work, "faultreg")
    try:
        with FaultyProxy(("127.0.0.1", port), r"^PUT /v2/.*/manifests/", "500") as proxy:
            r = run_cli("push", h20["image"], "--registry", f"127.0.0.1:{proxy.port}", env=state, timeout=900)
            assert r.returncode == 1, r.stdout + r.stderr
            assert "failed after 4 attempt(s)" in r.stderr and "500" in r.stderr, r.stderr
            assert "Traceback" not in r.stderr and len(proxy.failed) >= 4
            local = docker("images", "--format", "{{.Repository}}:{{.Tag}}", check=False).stdout.split()
            assert not [t for t in local if t.startswith(f"127.0.0.1:{proxy.port}/")], local
        assert _tags_in(port) == []
        reg.terminate()  # a registry the failed push left blobs in would need no blob upload: a new one
        reg.wait(timeout=10)
        reg, port = _own_registry(work, "faultreg2")
        with FaultyProxy(("127.0.0.1", port), r"^(PATCH|PUT) /v2/.*/blobs/uploads/", "drop", times=1) as blobs, \
                FaultyProxy(("127.0.0.1", blobs.port), r"^PUT /v2/.*/manifests/", "drop", times=2) as proxy:
            r = run_cli("push", h20["image"], "--registry", f"127.0.0.1:{proxy.port}", env=state, timeout=900)
            assert r.returncode == 0, r.stdout + r.stderr
            assert len(proxy.failed) == 2 and len(blobs.failed) == 1, (proxy.failed, blobs.failed)
            digest = re.search(r"digest (sha256:[0-9a-f]{64})", r.stdout).group(1)
        assert sorted(_tags_in(port)) == sorted(t.split(":", 1)[1] for t in
                                                       [h20["image"], h20["content_tag"]] if t), _tags_in(port)
        assert docker("pull", f"127.0.0.1:{port}/{REPO}@{digest}").returncode == 0
    finally:
        reg.terminate()
        reg.wait(timeout=10)
        remove_images(REPO, registry=f"127.0.0.1:{port}")  # the tags the push left, the pull by digest
        for name in ("faultreg", "faultreg2"):  # gigabytes of blobs each, held until the run ended
            shutil.rmtree(work / name / "data", ignore_errors=True)


def _owned_containers(pid=None) -> list[str]:
    """Containers envbuild runs: those of process `pid` of this host, else everyone's (the engine
    is shared: another run's smoke container is not this test's)."""
    label = OWNER_LABEL + (f"={socket.gethostname()}:{pid}" if pid else "")
    return docker("ps", "-aq", "--filter", f"label={label}", check=False).stdout.split()


def _orphans() -> list[str]:
    """Containers of envbuild processes of this host that are gone: what a smoke run removes."""
    rows = docker("ps", "-a", "--filter", f"label={OWNER_LABEL}", "--format",
                  f'{{{{.ID}}}} {{{{.Label "{OWNER_LABEL}"}}}}', check=False).stdout.splitlines()
    owners = [row.split(" ", 1) for row in rows if " " in row]
    return [cid for cid, owner in owners
            if owner.rpartition(":")[0] == socket.gethostname() and not Path(f"/proc/{owner.rpartition(':')[2]}").exists()]


def _wait_for_container(proc, seconds=120) -> str:
    for _ in range(seconds * 5):
        ids = _owned_containers(proc.pid)
        if ids:
            return ids[0]
        assert proc.poll() is None, proc.communicate()
        time.sleep(0.2)
    raise AssertionError("the smoke container never started")


def _smoke_proc(image, state_env):
    env = {**os.environ, "PYTHONPATH": str(ROOT), **state_env}
    return subprocess.Popen([sys.executable, "-m", "envbuild", "smoke", image], env=env, stdout=subprocess.PIPE,
                            stderr=subprocess.PIPE, text=True)


def test_a_smoke_test_killed_mid_run_records_no_pass_and_a_killed_envbuild_leaves_no_container(h20, work):
    """The smoke container killed mid-run: exit 1 naming it, no record, push refuses. envbuild itself
    killed mid-run (its container orphaned): the next smoke run removes the orphan and passes."""
    state = {"ENVBUILD_STATE_DIR": str(work / "state-killed")}
    proc = _smoke_proc(h20["image"], state)
    docker("kill", _wait_for_container(proc))
    out, err = proc.communicate(timeout=300)
    assert proc.returncode == 1 and "printed no result (exit 137)" in err and "Traceback" not in err, err
    assert not list((work / "state-killed").rglob("*.json"))
    r = run_cli("push", h20["image"], "--registry", REGISTRY, env=state)
    assert r.returncode == 1 and "no smoke test has been recorded" in r.stderr, r.stderr
    proc = _smoke_proc(h20["image"], state)
    orphan = _wait_for_container(proc)
    proc.kill()
    proc.wait()
    assert orphan in _owned_containers(proc.pid) and orphan in _orphans()  # left running by the killed process
    r = run_cli("smoke", h20["image"], env=state, timeout=1200)
    assert r.returncode == 0, r.stdout[-2000:] + r.stderr[-2000:]
    assert orphan not in _owned_containers() and _orphans() == []


def test_the_engine_going_away_mid_build_fails_clearly_tags_nothing_and_a_rerun_succeeds(h20, work, state, test_ca,
                                                                                          credential):
    """The Docker socket cut while the engine holds the build (a proxy in front of it: the real
    daemon keeps serving the other tests; the proxy cuts once the /build request is through and
    holds the session the engine reads the Dockerfile from, so a fast, fully cached build cannot
    end first): exit 1, no traceback, nothing tagged; the same build on the real socket then
    succeeds."""
    sys.path.insert(0, str(ROOT / "tests" / "tools"))
    from faulty_proxy import SocketCutter

    fault = ("--env", f"ENVBUILD_FAULT_TEST={secrets.token_hex(4)}")
    as_h20 = {"ca_cert": test_ca["bundle"], "indexes": credential["indexes"]}  # its cache serves
    out = work / "cut-build"
    with SocketCutter(docker_socket(), work / "cut.sock", at_build=True) as cutter:
        cut = run_build("--gpu", "h20", "--stack", STACK, "--ds-ops", OPS, "--ext", EXT, "--image-repo", REPO,
                        "-o", str(out), *fault, env={**state, "DOCKER_HOST": f"unix://{work / 'cut.sock'}"},
                        timeout=600, **as_h20)
    stderr = cut.stderr
    assert cutter.build_requests and cutter.wait_cut(0), ("no build was cut", stderr[-3000:])
    assert cut.returncode == 1, (cut.returncode, cut.stdout[-2000:], stderr[-3000:])
    assert "Traceback" not in stderr and "internal error" not in stderr and stderr.startswith("envbuild:"), stderr
    tag = json.loads((out / "manifest.json").read_text())["tag"]
    assert docker("image", "inspect", f"{REPO}:{tag}", check=False).returncode != 0
    _build(work, state, "h20", *fault, name="cut-build", **as_h20)
    assert docker("image", "inspect", f"{REPO}:{tag}", check=False).returncode == 0


@pytest.mark.parametrize("how", ["SIGTERM", "SIGKILL"])
def test_a_killed_envbuild_leaves_no_build_running_in_the_daemon(tmp_path, how):
    """The real docker CLI and BuildKit: envbuild killed while a RUN step runs (a compile of
    hours) -> the step is gone from the machine within a minute, not running on unowned."""
    import signal

    from test_engine import BUILD_RUNNER

    nonce = f"envbuild-kill-{secrets.token_hex(4)}"
    (tmp_path / "Dockerfile").write_text(f"FROM {BASE_IMAGE}\nRUN echo {nonce} && sleep 600\n")
    env = {**os.environ, "PYTHONPATH": str(ROOT), "TMPDIR": str(tmp_path)}  # what a SIGKILL leaves stays here
    proc = subprocess.Popen([sys.executable, "-c", BUILD_RUNNER, conftest.DOCKER, str(tmp_path)], env=env)

    def step_running():
        return subprocess.run(["pgrep", "-f", f"echo {nonce}"], capture_output=True).returncode == 0
    deadline = time.monotonic() + 120
    while not step_running():
        assert time.monotonic() < deadline and proc.poll() is None, (tmp_path / "build.log").read_text()[-2000:]
        time.sleep(0.2)
    proc.send_signal(getattr(signal, how))
    proc.wait(timeout=60)
    deadline = time.monotonic() + 60
    while step_running():
        assert time.monotonic() < deadline, f"the RUN step outlived envbuild ({how})"
        time.sleep(0.5)
