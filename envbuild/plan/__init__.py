"""The build plan: every fact the renderers need, derived once from a Resolution.

A resolution says *what* to build (a stack, a GPU, ops, defaults); the plan says *how*:
the stages with their base images and steps, which files each step needs, what the runtime
stage takes from the builder, the image's environment, labels and manifest. Each derived
fact is decided here and only here (where the CUDA toolchain lives, whether it is kept, the
image's PATH), and the renderers -- a Jinja layout per output format -- read nothing else.

Every building block renders itself to every format, with the format as an argument (the
hpccm idea): ``Step``, ``Copy``, ``Environment`` and ``Label`` each have one method per
format, and a ``Stage`` puts them in that format's order. A new output format is one method
per building block plus a layout template.

The plan is built from components (components/: one module each for the OS packages, Python
and torch, the CUDA toolchain, the fabric, DeepSpeed's ops, the CUDA extensions, the finish and
the CUDA layers, and the image's record), each giving a ``Part``; stack.py folds them. The
building blocks (blocks.py) render themselves to every format. docs/architecture.md shows the
flow.
"""

from envbuild.plan.blocks import (
                     APPTAINER,
                     APPTAINER_SECTIONS,
                     DOCKER,
                     FORMATS,
                     IMAGE_OWNED,
                     STEPS_SOURCE,
                     SYSTEM_PATH,
                     Copy,
                     Environment,
                     FileCopy,
                     Label,
                     Stage,
                     Step,
                     split_path,
                     step_files,
)
from envbuild.plan.components.extensions import EXTENSION_BUILD_RECIPE
from envbuild.plan.components.finish import GUARD_PACKAGES, guard_packages
from envbuild.plan.components.layers import CUDA_LAYER_PACKAGES, CUDA_LAYERS, LAYERS_DIR, cuda_layer_args
from envbuild.plan.components.ospackages import fabric_packages
from envbuild.plan.components.record import base_pinning, request_record
from envbuild.plan.extend import layer_plan
from envbuild.plan.model import (
                     DOCKERIGNORE,
                     EXTENSION_LAYOUTS,
                     MANIFEST_NAME,
                     STACK_LAYOUTS,
                     BuildPlan,
                     ImageFacts,
                     LayerFacts,
)
from envbuild.plan.stack import stack_plan

__all__ = ["APPTAINER", "APPTAINER_SECTIONS", "CUDA_LAYERS", "CUDA_LAYER_PACKAGES", "DOCKER", "DOCKERIGNORE",
           "EXTENSION_BUILD_RECIPE", "EXTENSION_LAYOUTS", "FORMATS",
           "GUARD_PACKAGES", "IMAGE_OWNED", "LAYERS_DIR", "MANIFEST_NAME", "STACK_LAYOUTS", "STEPS_SOURCE",
           "SYSTEM_PATH", "BuildPlan", "Copy", "Environment", "LayerFacts", "FileCopy", "ImageFacts", "Label",
           "Stage", "Step", "base_pinning", "cuda_layer_args", "layer_plan", "fabric_packages",
           "guard_packages", "request_record", "split_path", "stack_plan", "step_files"]
