"""Builds fastlayers._C: CUDA kernels when a CUDA toolkit and a CUDA build of torch are present,
CPU kernels only otherwise (or when FASTLAYERS_CPU_ONLY=1).

TORCH_CUDA_ARCH_LIST picks the GPU architectures (default: "8.0+PTX;9.0a": sm_80 code for
Ampere and Ada, sm_90a for Hopper, compute_80 PTX that newer GPUs compile when they load it);
MAX_JOBS the parallel compile jobs (compile_jobs). The fused Linear + activation
GEMMs for Hopper (sm_90a) need the CUTLASS headers of the nvidia-cutlass package (pip install
--no-deps nvidia-cutlass) at build time, and 9.0a in the list; they are compiled for sm_90a
alone (they hold no code for other GPUs). The sm_80 GEMMs (for 8.x GPUs) are built only when
FASTLAYERS_BUILD_SM80=1: they have not been measured on an 8.x GPU yet, so 8.x GPUs take the
cuBLAS + activation path unless asked.
Without them a GPU uses its cuBLAS + activation path.

The local CUDA toolkit (nvcc) compiles; it must have torch's CUDA major version, and may be
older or newer in the minor. Headers the toolkit lacks (cuBLAS, cuSPARSE, ... that ATen's
headers include) are taken from the nvidia-* wheels that torch installed, one file at a time:
never their CUDA runtime or CCCL headers, which must match the compiler.
"""

from __future__ import annotations

import glob
import importlib.util
import os
import re
import shutil
import subprocess
import sys

import torch
from setuptools import setup
from torch.utils.cpp_extension import CUDA_HOME, BuildExtension, CppExtension, CUDAExtension

HERE = os.path.dirname(os.path.abspath(__file__))
DEFAULT_CUDA_ARCHS = "8.0+PTX;9.0a"
# Wheel headers that belong to the compiler's own CUDA version (CCCL: libcu++, CUB, Thrust; the
# runtime's crt/): taking another version's copy breaks every .cu file ("CUDA compiler and
# CUDA toolkit headers are incompatible").
NEVER_FROM_WHEELS = frozenset({"cccl", "cub", "thrust", "cuda", "nv", "crt"})


def _build_cuda() -> bool:
    if os.environ.get("FASTLAYERS_CPU_ONLY", "0") == "1":
        return False
    if torch.version.cuda is None:
        return False
    if CUDA_HOME is None:
        print(
            f"fastlayers: torch {torch.__version__} is a CUDA build but no CUDA toolkit (nvcc) "
            "was found: building the CPU kernels only. Install a CUDA toolkit of the same major "
            f"version ({torch.version.cuda.split('.')[0]}.x) or set CUDA_HOME to build the "
            "CUDA kernels.",
            file=sys.stderr,
        )
        return False
    return True


def parse_arch_list(arch_list: str) -> list[tuple[str, bool]]:
    """'8.0+PTX;9.0a' (';' or spaces between entries) -> [('8.0', True), ('9.0a', False)]:
    each architecture and whether PTX is embedded for it."""
    entries = [e for e in re.split(r"[;\s]+", arch_list.strip()) if e]
    return [(e.removesuffix("+PTX"), e.endswith("+PTX")) for e in entries]


def arch_numbers(arch_list: str, ptx: bool = False) -> str:
    """'8.0+PTX;9.0a' -> '80,90' (ptx=True: '80', the archs with PTX) for the build-info
    macros (no quotes or semicolons on the compiler command line)."""
    nums = []
    for arch, has_ptx in parse_arch_list(arch_list):
        match = re.match(r"(\d+)\.(\d+)", arch)
        if match and (has_ptx or not ptx):
            nums.append(f"{match.group(1)}{match.group(2)}")
    return ",".join(nums)


def nvcc_version(cuda_home: str) -> tuple[int, int] | None:
    """The release of ``cuda_home``'s nvcc, e.g. (13, 0); None when it cannot be run."""
    nvcc = os.path.join(cuda_home, "bin", "nvcc")
    try:
        out = subprocess.run([nvcc, "--version"], capture_output=True, text=True, check=True)
    except (OSError, subprocess.CalledProcessError):
        return None
    match = re.search(r"release (\d+)\.(\d+)", out.stdout)
    return (int(match.group(1)), int(match.group(2))) if match else None


def version_problem(nvcc: tuple[int, int] | None, torch_cuda: str, cuda_home: str) -> str | None:
    """Why this nvcc cannot build against this torch (one message naming both versions and
    what to do), or None. A different minor version is fine: torch's headers only need the
    same major, and the toolkit's own runtime headers are used."""
    if nvcc is None:
        return (
            f"fastlayers: cannot build the CUDA kernels: {cuda_home}/bin/nvcc does not run or "
            "does not say its version. Fix CUDA_HOME, or build the CPU kernels only with "
            "FASTLAYERS_CPU_ONLY=1."
        )
    torch_major = int(torch_cuda.split(".")[0])
    if nvcc[0] != torch_major:
        return (
            f"fastlayers: cannot build the CUDA kernels: the CUDA toolkit at {cuda_home} is "
            f"CUDA {nvcc[0]}.{nvcc[1]}, but torch {torch.__version__} was built for CUDA "
            f"{torch_cuda}, and an extension must be compiled by torch's CUDA major version. "
            f"Install a torch built for CUDA {nvcc[0]}.x (PyTorch's install selector lists "
            f"them), or set CUDA_HOME to a CUDA {torch_major}.x toolkit, or build the CPU "
            "kernels only with FASTLAYERS_CPU_ONLY=1."
        )
    return None


def nvcc_include_dir(cuda_home: str) -> str:
    """The include folder nvcc itself compiles with (its nvcc.profile's INCLUDES): CUDA_HOME
    may be a prefix such as /usr/local where only a wrapper of nvcc lies."""
    nvcc = os.path.join(cuda_home, "bin", "nvcc")
    try:
        out = subprocess.run(
            [nvcc, "--dryrun", "-x", "cu", "-c", os.devnull, "-o", os.devnull],
            capture_output=True,
            text=True,
            check=True,
        )
        match = re.search(r'^#\$ INCLUDES="-I([^"]+)"', out.stderr + out.stdout, re.MULTILINE)
    except (OSError, subprocess.CalledProcessError):
        match = None
    return os.path.normpath(match.group(1).strip()) if match else os.path.join(cuda_home, "include")


def wheel_include_dirs() -> list[str]:
    """The include folders of the nvidia-* wheels that a CUDA build of torch installs."""
    try:
        import nvidia  # namespace package of the nvidia-* wheels
    except ImportError:
        return []
    found = []
    for base in nvidia.__path__:
        found += glob.glob(os.path.join(base, "*", "include"))
    return sorted(d for d in found if os.path.isdir(d))


def stage_missing_headers(
    toolkit_include: str, wheel_includes: list[str], staging: str
) -> list[str]:
    """Links into ``staging`` each header file or folder of the wheels that ``toolkit_include``
    lacks (a toolkit with only the compiler has no cuBLAS or cuSPARSE headers, which ATen's CUDA
    headers include), except the compiler's own CCCL and runtime parts; returns [staging], or
    [] when nothing is missing. The wheels' folders are never put on the include path whole:
    they also hold their CUDA version's runtime and CCCL headers, which must match nvcc."""
    missing: dict[str, str] = {}
    for include in wheel_includes:
        for entry in sorted(os.listdir(include)):
            if entry in NEVER_FROM_WHEELS or entry in missing:
                continue
            if not os.path.exists(os.path.join(toolkit_include, entry)):
                missing[entry] = os.path.join(include, entry)
    shutil.rmtree(staging, ignore_errors=True)
    if not missing:
        return []
    os.makedirs(staging)
    for entry, source in missing.items():
        os.symlink(source, os.path.join(staging, entry))
    return [staging]


def _cudart_library_dirs() -> list[str]:
    """Where libcudart.so is, when not beside CUDA_HOME (e.g. nvcc installed on the PATH
    outside its toolkit folder)."""
    candidates = [os.path.join(CUDA_HOME, d, "libcudart.so") for d in ("lib64", "lib")]
    if any(os.path.exists(c) for c in candidates):
        return []
    found = glob.glob("/usr/local/cuda*/lib*/libcudart.so") + glob.glob(
        "/usr/local/cuda*/targets/*/lib/libcudart.so"
    )
    return sorted({os.path.dirname(f) for f in found})[:1]


def _cutlass_include_dirs() -> list[str]:
    """The CUTLASS C++ headers shipped in the nvidia-cutlass wheel (package cutlass_library),
    found without importing it (its Python side needs packages the build does not)."""
    spec = importlib.util.find_spec("cutlass_library")
    if spec is None or not spec.submodule_search_locations:
        return []
    source = os.path.join(next(iter(spec.submodule_search_locations)), "source")
    dirs = [os.path.join(source, "include"), os.path.join(source, "tools", "util", "include")]
    if not os.path.exists(os.path.join(dirs[0], "cutlass", "cutlass.h")):
        return []
    return dirs


def _instantiation_files() -> dict[str, list[str]]:
    """The Linear + activation GEMMs' instantiation files, written into the build folder by
    csrc/linear_act/instantiate.py: family ('sm90', 'sm80') -> paths."""
    spec = importlib.util.spec_from_file_location(
        "fastlayers_instantiate", os.path.join(HERE, "csrc", "linear_act", "instantiate.py")
    )
    module = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(module)
    return module.write(os.path.join(HERE, "build", "generated"))


def _sources(pattern: str, folder: str = "csrc") -> list[str]:
    return sorted(glob.glob(os.path.join(folder, "**", pattern), recursive=True))


# Peak resident memory of compiling one CUTLASS sm90 instantiation file (4 kernels; /usr/bin/time
# -v on the 2-core machine, 2026-11-29: 6.35 GB); the other sources take a fraction of it.
CUTLASS_COMPILE_GB = 6.5
OTHER_COMPILE_GB = 1.5


def _physical_memory_gb() -> float | None:
    try:
        return os.sysconf("SC_PAGE_SIZE") * os.sysconf("SC_PHYS_PAGES") / 2**30
    except (AttributeError, ValueError, OSError):  # no sysconf (Windows) or no such name
        return None


def compile_jobs(
    max_jobs: str | None, cpus: int, memory_gb: float | None, per_job_gb: float
) -> int:
    """Compile jobs of one ninja run: MAX_JOBS (else the CPU count), and no more than three
    quarters of memory holds at per_job_gb each. The runs (each CUTLASS object group, then the
    other sources) go one after another, each with every job: runs at once with a share each
    left a core idle once the shorter run ended (and ran four compiles on two cores before the
    shares: 1,331 s against 953 s, 2026-11-29)."""
    total = int(max_jobs) if max_jobs is not None and max_jobs.isdigit() else cpus
    if memory_gb is not None:
        total = min(total, int(0.75 * memory_gb / per_job_gb))
    return max(1, total)


def heaviest_first(sources: list[str]) -> list[int]:
    """The order to compile sources in (indices): .cu files before .cpp files, larger first, so
    that the last job of a run is a short one (ninja starts jobs in its file's order)."""
    return sorted(
        range(len(sources)),
        key=lambda i: (not sources[i].endswith(".cu"), -os.path.getsize(sources[i])),
    )


class ObjectGroup:
    """Sources compiled with architectures of their own (nvcc -gencode flags) and a macro of
    their own, then linked into the extension: torch's build gives every .cu file of an
    extension the same flags. The macro is the group's alone, so that building a group or not
    (FASTLAYERS_BUILD_SM80, nvidia-cutlass installed or not) recompiles that group only."""

    def __init__(self, name: str, sources: list[str], gencode: list[str], macro: str) -> None:
        self.name, self.sources, self.gencode, self.macro = name, sources, gencode, macro


def gencode_flags(archs: list[tuple[str, bool]]) -> list[str]:
    """-gencode flags for (arch, with PTX) entries, as torch writes them: '9.0a' ->
    arch=compute_90a,code=sm_90a, plus code=compute_XX for PTX."""
    flags = []
    for arch, ptx in archs:
        num = arch.replace(".", "")
        flags.append(f"-gencode=arch=compute_{num},code=sm_{num}")
        if ptx:
            flags.append(f"-gencode=arch=compute_{num},code=compute_{num}")
    return flags


def _extension():
    torch_major, torch_minor = torch.__version__.split(".")[:2]
    macros = [("FASTLAYERS_TORCH_MAJOR", torch_major), ("FASTLAYERS_TORCH_MINOR", torch_minor)]
    sources = _sources("*.cpp")
    # -g0: Python's CFLAGS ask for debug info, which nearly doubled each .cpp file's compile
    # (rms_norm.cpp 79 s against 43 s on the 2-core machine) for an .so no one debugs in lines.
    cxx_flags = ["-O3", "-g0"]
    csrc = os.path.join(HERE, "csrc")
    if not _build_cuda():
        return CppExtension(
            "fastlayers._C",
            sources,
            define_macros=macros,
            include_dirs=[csrc],
            extra_compile_args={"cxx": cxx_flags},
        )
    problem = version_problem(nvcc_version(CUDA_HOME), torch.version.cuda, CUDA_HOME)
    if problem is not None:
        sys.exit(problem)  # before compiling: one message, not a wall of compiler errors
    arch_list = os.environ.setdefault("TORCH_CUDA_ARCH_LIST", DEFAULT_CUDA_ARCHS)
    macros += [("FASTLAYERS_WITH_CUDA", "1")]
    # cxx only: nvcc would split the comma-separated values into several -D options.
    cxx_flags += [
        f"-DFASTLAYERS_CUDA_ARCHS={arch_numbers(arch_list)}",
        f"-DFASTLAYERS_CUDA_PTX_ARCHS={arch_numbers(arch_list, ptx=True)}",
    ]
    # NDEBUG: device-side asserts compile to calls, which serialize CUTLASS's wgmma pipeline.
    nvcc_flags = ["-O3", "--expt-relaxed-constexpr", "-lineinfo", "-DNDEBUG"]
    include_dirs = [
        csrc,
        *stage_missing_headers(
            nvcc_include_dir(CUDA_HOME),
            wheel_include_dirs(),
            os.path.join(HERE, "build", "fastlayers_missing_cuda_headers"),
        ),
    ]
    cutlass_dirs = _cutlass_include_dirs()
    archs = parse_arch_list(arch_list)
    generated = _instantiation_files()
    cuda_sources = _sources("*.cu")
    groups: list[ObjectGroup] = []
    # The fused Linear + activation GEMMs: sm_90a for Hopper, compiled for it alone; sm_80
    # (mma.sync) for 8.x GPUs, only when asked, compiled for the list's 8.x and 9.0a entries
    # (the sm_90a code lets tests and benchmarks force them on Hopper).
    build_sm80 = os.environ.get("FASTLAYERS_BUILD_SM80", "0") == "1"
    has_8x = any(a.startswith("8.") for a, _ in archs)
    families = {  # family: (what, its architectures, why it is not built, its macro)
        "sm90": (
            "the sm_90a fused Linear + activation kernels",
            [a for a in archs if a[0] == "9.0a"],
            "TORCH_CUDA_ARCH_LIST has no 9.0a",
            "FASTLAYERS_WITH_CUTLASS_SM90",
        ),
        "sm80": (
            "the sm_80 fused Linear + activation kernels",
            [a for a in archs if a[0].startswith("8.") or a[0] == "9.0a"]
            if build_sm80 and has_8x
            else [],
            "TORCH_CUDA_ARCH_LIST has no 8.x"
            if build_sm80
            else "FASTLAYERS_BUILD_SM80=1 builds them",
            "FASTLAYERS_WITH_CUTLASS_SM80",
        ),
    }
    if cutlass_dirs:
        include_dirs += cutlass_dirs
        nvcc_flags += ["-diag-suppress=2908"]  # a CUTLASS header's lambda capture warning
    missing = []
    for family, (what, family_archs, why_not, macro) in families.items():
        family_sources = [*_sources("*.cu", os.path.join("csrc", "linear_act", family))]
        family_sources += generated[family]
        cuda_sources = [s for s in cuda_sources if s not in family_sources]
        if cutlass_dirs and family_archs:
            groups.append(ObjectGroup(family, family_sources, gencode_flags(family_archs), macro))
        else:
            # compiled with the rest: without the macro they hold no kernels, only launchers
            # that say so
            cuda_sources += family_sources
            missing.append(f"{what} ({why_not if cutlass_dirs else 'no nvidia-cutlass'})")
    if missing:
        print(
            "fastlayers: building without "
            + " and ".join(missing)
            + "; FusedLinearGELU/ReLU use their cuBLAS paths on those GPUs",
            file=sys.stderr,
        )
    extension = CUDAExtension(
        "fastlayers._C",
        sources + cuda_sources,
        define_macros=macros,
        include_dirs=include_dirs,
        library_dirs=_cudart_library_dirs(),
        extra_compile_args={"cxx": cxx_flags, "nvcc": nvcc_flags},
    )
    extension.fastlayers_object_groups = groups
    return extension


class _BuildExt(BuildExtension):
    """Compiles in build/temp, not in pip's temporary folder, so that installing the same tree
    again (the README's test command after its main job, or after an edit) recompiles only
    what changed: ninja keeps its dependency records there. An extension's object groups
    (ObjectGroup: sources with architectures of their own) compile in folders of their own
    (with ninja: one ninja run each, then one for the other sources, each with every job
    compile_jobs allows), and their objects are linked into it."""

    def finalize_options(self) -> None:
        super().finalize_options()
        self.build_temp = os.path.join(HERE, "build", "temp")

    def _compile_group(self, compile, ext, group: ObjectGroup) -> list[str]:
        args = {key: list(flags) for key, flags in ext.extra_compile_args.items()}
        args["nvcc"] += group.gencode  # an -arch flag: torch adds none of its own
        return compile(
            group.sources,
            output_dir=os.path.join(self.build_temp, group.name),
            macros=[*ext.define_macros, (group.macro, "1")],
            include_dirs=ext.include_dirs,
            debug=self.debug,
            extra_postargs=args,
            depends=ext.depends,
        )

    def build_extension(self, ext) -> None:
        groups = getattr(ext, "fastlayers_object_groups", [])
        if not groups:
            super().build_extension(ext)
            return
        if not self.use_ninja:  # the compiler without ninja swaps its executable per call
            for group in groups:
                objects = self._compile_group(self.compiler.compile, ext, group)
                ext.extra_objects = [*ext.extra_objects, *objects]
            super().build_extension(ext)
            return
        compile_rest = self.compiler.compile

        def compile_all(sources: list[str], *args, **kwargs) -> list[str]:
            # Every ninja run reads MAX_JOBS when it starts: set it to each run's jobs, then put
            # it back.
            given = os.environ.get("MAX_JOBS")
            cpus, memory = os.cpu_count() or 1, _physical_memory_gb()
            order = heaviest_first(sources)
            try:
                os.environ["MAX_JOBS"] = str(compile_jobs(given, cpus, memory, CUTLASS_COMPILE_GB))
                for group in groups:  # setuptools links ext.extra_objects, read after this
                    objects = self._compile_group(compile_rest, ext, group)
                    ext.extra_objects = [*ext.extra_objects, *objects]
                os.environ["MAX_JOBS"] = str(compile_jobs(given, cpus, memory, OTHER_COMPILE_GB))
                compiled = compile_rest([sources[i] for i in order], *args, **kwargs)
            finally:
                if given is None:
                    os.environ.pop("MAX_JOBS", None)
                else:
                    os.environ["MAX_JOBS"] = given
            objects = [""] * len(sources)  # back in the sources' order: the link's stays as it was
            for position, index in enumerate(order):
                objects[index] = compiled[position]
            return objects

        self.compiler.compile = compile_all
        try:
            super().build_extension(ext)
        finally:
            self.compiler.compile = compile_rest


if __name__ == "__main__":  # setuptools runs this file as __main__; tests import its helpers
    setup(
        packages=[
            "fastlayers",
            "fastlayers.ops",
            "fastlayers.layers",
            "fastlayers.patching",
            "fastlayers.patching.checking",
            "fastlayers.patching.rules",
            "fastlayers.patching.runtime",
        ],
        package_dir={"fastlayers.patching": "patching"},
        ext_modules=[_extension()],
        cmdclass={"build_ext": _BuildExt},
    )
