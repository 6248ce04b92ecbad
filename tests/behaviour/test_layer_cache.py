"""A publish job's layer cache in its registry (envbuild/builds/build.py LayerCache): the builder stage
built on its own and pushed as a cache image, both references imported, and a failed cache push
costing the next run its compiles, never this run its image. The real round trip on an empty
engine is tests/builds/test_layer_cache_build.py."""

from __future__ import annotations

from pathlib import Path

import pytest

from conftest import ROOT, run_here
from envbuild.supply import jobplan
from envbuild.builds.build import LayerCache, build_image
from envbuild.base.errors import EnvbuildError
from envbuild.engine import BuildFailed, BuildOutcome, BuildSecrets, RegistryError
from envbuild.knowledge.matrix import load_matrix

CACHE = LayerCache(builder="127.0.0.1:5000/envbuild-cache:t-amd64-builder", final="127.0.0.1:5000/envbuild:t-amd64")


class Engine:
    """Records what a build asked of the engine."""

    def __init__(self, push_error=None):
        self.calls, self.push_error = [], push_error

    def build(self, context, tags, secrets, log_path, on_step=None, extra_args=()):
        self.calls.append(("build", list(tags), list(extra_args)))
        Path(log_path).write_text("log\n")
        return BuildOutcome("sha256:" + "a" * 64, [])

    def push(self, ref):
        self.calls.append(("push", ref))
        if self.push_error:
            raise self.push_error
        return "sha256:" + "b" * 64

    def untag(self, ref):
        self.calls.append(("untag", ref))


@pytest.fixture(scope="module")
def build_dir(tmp_path_factory):
    out = tmp_path_factory.mktemp("render") / "out"
    r = run_here("render", "--gpu", "h20", "-o", str(out))
    assert r.returncode == 0, r.stderr
    return out


def test_the_builder_stage_is_built_pushed_and_both_references_imported(build_dir):
    engine, said = Engine(), []
    build_image(build_dir, "t", "envbuild", BuildSecrets(), engine=engine, cache=CACHE, say=said.append)
    imports = ["--build-arg", "BUILDKIT_INLINE_CACHE=1", "--cache-from", CACHE.builder, "--cache-from", CACHE.final]
    assert engine.calls[0] == ("build", [CACHE.builder], ["--target", "builder", *imports])
    assert engine.calls[1] == ("push", CACHE.builder)
    assert engine.calls[2][0] == "build" and engine.calls[2][2] == imports
    # The stage's tag holds its layers until the image is built: the engine's build-cache
    # collector cannot free what the runtime stage's COPY --from=builder reads in between.
    assert engine.calls[3:] == [("untag", CACHE.builder)]
    assert said == [f"layer cache: the builder stage is {CACHE.builder}"]


def test_the_builder_stage_tag_goes_when_the_image_build_fails_too(build_dir):
    class Failing(Engine):
        def build(self, context, tags, secrets, log_path, on_step=None, extra_args=()):
            out = super().build(context, tags, secrets, log_path, on_step, extra_args)
            if "--target" not in extra_args:
                raise BuildFailed("[runtime  8/12] COPY --from=builder /opt/venv /opt/venv", ["ERROR: no space"])
            return out

    engine = Failing()
    with pytest.raises(EnvbuildError, match="COPY --from=builder"):
        build_image(build_dir, "t", "envbuild", BuildSecrets(), engine=engine, cache=CACHE)
    assert engine.calls[-1] == ("untag", CACHE.builder)


def test_a_cache_that_cannot_be_pushed_is_said_and_the_image_still_built(build_dir):
    engine, said = Engine(push_error=RegistryError("denied: requested access to the resource is denied", "r")), []
    result = build_image(build_dir, "t", "envbuild", BuildSecrets(), engine=engine, cache=CACHE, say=said.append)
    assert result.image_id.startswith("sha256:") and [c[0] for c in engine.calls] == ["build", "push", "build", "untag"]
    assert said and said[0].startswith("warning: layer cache:") and "denied" in said[0]


def test_without_a_cache_the_build_is_one_build_as_before(build_dir):
    engine = Engine()
    build_image(build_dir, "t", "envbuild", BuildSecrets(), engine=engine)
    assert [c[0] for c in engine.calls] == ["build"] and engine.calls[0][2] == []


def test_each_variant_has_its_own_references_under_the_job_s_registry():
    m = load_matrix(ROOT / "matrices")
    _, variants, _ = jobplan.find_job(m, "torch2.15-cu132-py3.12-arm64")
    v = variants[0]
    cache = jobplan.layer_cache("ghcr.io/acme/envbuild-cache", "ghcr.io/acme/envbuild", v)
    assert cache.builder == f"ghcr.io/acme/envbuild-cache:{v['tag']}-arm64-builder"
    assert cache.final == f"ghcr.io/acme/envbuild:{v['tag']}-arm64"  # the per-platform tag publish pushes
    assert jobplan.layer_cache(None, "ghcr.io/acme/envbuild", v) is None


@pytest.mark.parametrize("value", ["a\nb", "ghcr.io/acme/cache'", "$(id)", "ghcr.io/acme/Cache", "x:tag"])
def test_a_layer_cache_that_is_not_a_repository_is_refused_before_anything(tmp_path, value):
    r = run_here("publish", "--job", "torch2.5-cu124-py3.10-amd64", "--registry", "127.0.0.1:9/acme",
                 "--signing-key", "key.pem", "--out", "out", "--layer-cache", value, cwd=tmp_path,
                 env={"ENVBUILD_MATRIX_DIR": str(ROOT / "matrices")})
    assert r.returncode == 2 and "--layer-cache" in r.stderr and "Traceback" not in r.stderr, r.stderr
    assert not list(tmp_path.iterdir())
