"""An extension image (`envbuild extend`): a researcher's own packages as one stage on a stack
image, from the extension lock, every heavy layer the stack image's."""

from __future__ import annotations

from dataclasses import replace

from ..errors import EnvbuildError
from ..extend import Extension
from ..image import paths
from ..registry import CONTENT_TAG_DIGITS, READABLE_TAG_MAX, TAG_MAX, check_readable_tag
from ..resolve import Resolution
from .blocks import Copy, FileCopy, Label, Stage, Step, step_files
from .components.python import PIP_SECRETS
from .model import EXTENSION_LAYOUTS, MANIFEST_NAME, BuildPlan, ExtensionFacts, build_files
from .stack import stack_plan

EXTENSION_STEP_FILES = ("lib.sh", "extend.sh", "import_check.py", "pip_check.py")
EXTEND_LOCK_NAME = "envbuild/extend-lock.txt"  # the extension lock in the build directory


def extension_plan(resolution: Resolution, extension: Extension, base: str) -> BuildPlan:
    """An extension image: one stage on the stack image `base` (by digest where known) that
    installs the extension lock with hash checking, runs pip check and imports each package.
    Every heavy layer is the stack image's; the manifest is the stack's plus what was added."""
    stack = stack_plan(resolution)
    tag = f"{resolution.tag}-ext-{extension.name}"
    room = READABLE_TAG_MAX - len(resolution.tag) - len("-ext-")
    if len(tag) > READABLE_TAG_MAX:  # the one tag rule, said in terms of what the user chose
        fix = (f"nearest valid choice: --name {extension.name[:room].rstrip('-.')}" if room >= 3 else
               "the stack tag leaves no room: drop a non-default option (--env, --cpu-target, --ds-ops, "
               "--keep-toolchain) from the stack image")
        raise EnvbuildError(f"--name '{extension.name}' makes the extension's tag {len(tag)} characters "
                            f"('{tag}'); a readable tag has at most {READABLE_TAG_MAX} (Docker's limit is "
                            f"{TAG_MAX}, and the content tag adds {CONTENT_TAG_DIGITS + 1}); {fix}.")
    check_readable_tag(tag, "the extension's tag")
    image = replace(stack.image, tag=tag)
    step = Step("extend", (paths.EXTEND_LOCK, paths.MANIFEST, *extension.top_level),
                files=(*step_files(*EXTENSION_STEP_FILES), FileCopy(EXTEND_LOCK_NAME, paths.EXTEND_LOCK),
                       FileCopy(MANIFEST_NAME, paths.MANIFEST)),
                secrets=PIP_SECRETS,
                comment=f"{', '.join(extension.requirements)}: from the extension lock (every hash checked), "
                        f"then pip check and an import of each package")
    manifest = {**stack.manifest, "tag": tag, "image": image.image_ref,
                "extend": {"from": base, "stack_tag": resolution.tag, "requirements": list(extension.requirements),
                           "source": extension.source, "top_level": list(extension.top_level),
                           "lock": {"path": paths.EXTEND_LOCK, "sha256": extension.lock.sha256,
                                    "packages": len(extension.lock.sections["venv"]),
                                    "exclude_newer": extension.exclude_newer},
                           "imports": {}}}
    labels = Label((("org.opencontainers.image.title", f"envbuild {tag}"),
                    ("org.opencontainers.image.version", tag),
                    ("org.opencontainers.image.base.name", base),
                    ("io.envbuild.extends", resolution.tag),
                    ("io.envbuild.extend-lock", f"sha256:{extension.lock.sha256}"),
                    ("io.envbuild.extend-requirements", " ".join(extension.requirements))))
    generated = {EXTEND_LOCK_NAME: extension.lock.text}
    return BuildPlan(
        image=image, builder=None, runtime=Stage("extend", base, (step,)), toolchain_home=None,
        kept_toolchain_home=None, image_env=(), image_files=Copy(()), image_package=Copy(()),
        manifest_file=Copy(()), labels=labels, manifest=manifest,
        build_files=build_files([step], Copy(()), generated=generated, package=False), generated_files=generated,
        layouts=EXTENSION_LAYOUTS, lock=stack.lock,
        extension=ExtensionFacts(requirements=extension.requirements, lock_sha256=extension.lock.sha256, base=base,
                                 stack_tag=resolution.tag))
