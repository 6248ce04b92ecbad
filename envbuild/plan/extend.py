"""A layer image (`envbuild extend`): a researcher's own packages as one stage on a stack
image, from the layer lock, every heavy layer the stack image's."""

from __future__ import annotations

from dataclasses import replace

from envbuild.base.errors import EnvbuildError
from envbuild.image import paths
from envbuild.oci.registry import CONTENT_TAG_DIGITS, READABLE_TAG_MAX, TAG_MAX, check_readable_tag
from envbuild.plan.blocks import Copy, FileCopy, Label, Stage, Step, step_files
from envbuild.plan.components.python import PIP_SECRETS
from envbuild.plan.model import EXTENSION_LAYOUTS, MANIFEST_NAME, BuildPlan, LayerFacts, build_files
from envbuild.plan.stack import stack_plan
from envbuild.resolve.extend import Layer
from envbuild.resolve.resolver import Resolution

LAYER_STEP_FILES = ("lib.sh", "extend.sh", "import_check.py", "pip_check.py")
EXTEND_LOCK_NAME = "envbuild/extend-lock.txt"  # the layer lock in the build directory


def layer_plan(resolution: Resolution, layer: Layer, base: str) -> BuildPlan:
    """A layer image: one stage on the stack image `base` (by digest where known) that
    installs the layer lock with hash checking, runs pip check and imports each package.
    Every heavy layer is the stack image's; the manifest is the stack's plus what was added."""
    stack = stack_plan(resolution)
    tag = f"{resolution.tag}-ext-{layer.name}"
    room = READABLE_TAG_MAX - len(resolution.tag) - len("-ext-")
    if len(tag) > READABLE_TAG_MAX:  # the one tag rule, said in terms of what the user chose
        fix = (f"nearest valid choice: --name {layer.name[:room].rstrip('-.')}" if room >= 3 else
               "the stack tag leaves no room: drop a non-default option (--env, --cpu-target, --ds-ops, "
               "--keep-toolchain) from the stack image")
        raise EnvbuildError(f"--name '{layer.name}' makes the layer's tag {len(tag)} characters "
                            f"('{tag}'); a readable tag has at most {READABLE_TAG_MAX} (Docker's limit is "
                            f"{TAG_MAX}, and the content tag adds {CONTENT_TAG_DIGITS + 1}); {fix}.")
    check_readable_tag(tag, "the layer's tag")
    image = replace(stack.image, tag=tag)
    step = Step("extend", (paths.EXTEND_LOCK, paths.MANIFEST, *layer.top_level),
                files=(*step_files(*LAYER_STEP_FILES), FileCopy(EXTEND_LOCK_NAME, paths.EXTEND_LOCK),
                       FileCopy(MANIFEST_NAME, paths.MANIFEST)),
                secrets=PIP_SECRETS,
                comment=f"{', '.join(layer.requirements)}: from the layer lock (every hash checked), "
                        f"then pip check and an import of each package")
    manifest = {**stack.manifest, "tag": tag, "image": image.image_ref,
                "extend": {"from": base, "stack_tag": resolution.tag, "requirements": list(layer.requirements),
                           "source": layer.source, "top_level": list(layer.top_level),
                           "lock": {"path": paths.EXTEND_LOCK, "sha256": layer.lock.sha256,
                                    "packages": len(layer.lock.sections["venv"]),
                                    "exclude_newer": layer.exclude_newer},
                           "imports": {}}}
    labels = Label((("org.opencontainers.image.title", f"envbuild {tag}"),
                    ("org.opencontainers.image.version", tag),
                    ("org.opencontainers.image.base.name", base),
                    ("io.envbuild.extends", resolution.tag),
                    ("io.envbuild.extend-lock", f"sha256:{layer.lock.sha256}"),
                    ("io.envbuild.extend-requirements", " ".join(layer.requirements))))
    generated = {EXTEND_LOCK_NAME: layer.lock.text}
    return BuildPlan(
        image=image, builder=None, runtime=Stage("extend", base, (step,)), toolchain_home=None,
        kept_toolchain_home=None, image_env=(), image_files=Copy(()), image_package=Copy(()),
        manifest_file=Copy(()), labels=labels, manifest=manifest,
        build_files=build_files([step], Copy(()), generated=generated, package=False), generated_files=generated,
        layouts=EXTENSION_LAYOUTS, lock=stack.lock,
        layer=LayerFacts(requirements=layer.requirements, lock_sha256=layer.lock.sha256, base=base,
                                 stack_tag=resolution.tag))
