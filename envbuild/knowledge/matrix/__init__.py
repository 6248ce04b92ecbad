"""The compatibility matrix (``matrices/*.yaml``), loaded and validated.

The matrix is data, not code: four YAML files validated by pydantic models, so a
malformed file fails with the file, the path of the bad field and what was expected.
Cross-file checks (a stack naming an unknown torch release, a stack that breaks a rule)
run once here, at load time, so the resolver can trust what it gets.

The package in layers (import-linter holds them): ``fields`` (the grammar of each kind of
value and the strict base model), ``files/`` (one module of models per YAML file), ``core``
(the ``Matrix`` and its lookups), ``loader`` (reading, validating, the checks across files).

Examples
--------
>>> m = load_matrix()
>>> m.gpu("H20").cc
'9.0'
"""

from envbuild.knowledge.matrix.core import ALLOWLIST, BASE_DIGESTS, Matrix
from envbuild.knowledge.matrix.files.bases_yaml import (
    AptArchive,
    AptPorts,
    AptSource,
    BasesFile,
    CompileCacheTool,
    Family,
    Installer,
    Toolchain,
    ToolchainInstall,
)
from envbuild.knowledge.matrix.files.cuda_yaml import CudaFile, DriverFloor, GenerationDriverFloor
from envbuild.knowledge.matrix.files.deepspeed_yaml import Aarch64Facts, DeepspeedFile, DsRelease, Op, TritonRule
from envbuild.knowledge.matrix.files.extensions_yaml import (
    CudaExtension,
    ExtensionSdist,
    ExtensionsFile,
    ExtensionWheel,
    NotPrebuilt,
    RunTimeCompile,
    SourcePatch,
)
from envbuild.knowledge.matrix.files.fabrics_yaml import (
    Fabric,
    FabricBuild,
    FabricFile,
    FabricRequires,
    FabricsFile,
    FabricSource,
)
from envbuild.knowledge.matrix.files.gpus_yaml import (
    IMAGE_ENV_FIELDS,
    CpuTarget,
    EnvDefault,
    GpuProfile,
    GpuRequires,
    GpusFile,
    ImageEnv,
    NodeCondition,
    NotBaked,
    OutOfScope,
    VariableGrammar,
)
from envbuild.knowledge.matrix.files.nccl_yaml import NcclFile, NcclPackage, NcclRelease, NcclWheel
from envbuild.knowledge.matrix.files.stacks_yaml import EXTENSIONS, PUBLISH, BaseImages, PublishFile, Stack, StacksFile
from envbuild.knowledge.matrix.files.torch_yaml import TorchFile, TorchRelease
from envbuild.knowledge.matrix.loader import FILES, NCCL, load_matrix, load_publish

__all__ = ["ALLOWLIST", "Aarch64Facts", "AptArchive", "AptPorts", "AptSource", "BASE_DIGESTS", "BaseImages", "BasesFile", "CompileCacheTool", "CpuTarget", "CudaExtension", "CudaFile", "DeepspeedFile", "DriverFloor", "DsRelease", "EXTENSIONS", "EnvDefault", "ExtensionSdist", "ExtensionWheel", "ExtensionsFile", "FILES", "NCCL", "Fabric", "FabricBuild", "FabricFile", "FabricRequires", "FabricSource", "FabricsFile", "Family", "GenerationDriverFloor", "GpuProfile", "GpuRequires", "GpusFile", "IMAGE_ENV_FIELDS", "ImageEnv", "Installer", "Matrix", "NcclFile", "NcclPackage", "NcclRelease", "NcclWheel", "NodeCondition", "NotBaked", "NotPrebuilt", "Op", "OutOfScope", "PUBLISH", "PublishFile", "RunTimeCompile", "SourcePatch", "Stack", "StacksFile", "Toolchain", "ToolchainInstall", "TorchFile", "TorchRelease", "TritonRule", "VariableGrammar", "load_matrix", "load_publish"]
