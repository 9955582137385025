"""Build script. fxrt is pure Python plus one optional extension, ``fxrt._speedups._loop``: Cython
in C++ mode compiled against the torch that is installed, since the compiled loop calls torch's
C++ dispatcher. Build it with ``pip install --no-build-isolation -e .`` (the build needs that
torch, so it cannot run in an isolated build environment); ``FXRT_BUILD_EXT=0`` skips it, and
fxrt then runs its pure-Python loop.

The extension records ``torch.__version__`` (macro FXRT_TORCH_VERSION) so that fxrt can refuse
it under another torch, and gets an rpath to torch's lib directory so it imports without
LD_LIBRARY_PATH.
"""

import os
from glob import glob

from setuptools import setup
from setuptools.command.build_ext import build_ext

_FALSE = {"0", "false", "no", "off"}


class BuildExtReplacing(build_ext):
    """build_ext that replaces the in-place extension file instead of rewriting it: a process that
    has the old one loaded keeps a valid mapping (rewriting a loaded .so can crash it, SIGBUS);
    and compiles an extension's sources on as many cores as there are (the runtime has ten)."""

    def build_extension(self, ext):
        compile_one = self.compiler.compile

        def compile_all(sources, *args, **kwargs):
            from concurrent.futures import ThreadPoolExecutor

            with ThreadPoolExecutor(max(1, min(len(sources), os.cpu_count() or 1))) as pool:
                parts = pool.map(lambda src: compile_one([src], *args, **kwargs), sources)
                return [obj for objs in parts for obj in objs]

        self.compiler.compile = compile_all
        try:
            super().build_extension(ext)
        finally:
            self.compiler.compile = compile_one

    def copy_file(self, infile, outfile, *args, **kwargs):
        tmp = f"{outfile}.{os.getpid()}.tmp"
        _, copied = super().copy_file(infile, tmp, *args, **kwargs)
        if os.path.exists(tmp):
            os.replace(tmp, outfile)
        return outfile, copied


def build_requested() -> bool:
    return os.environ.get("FXRT_BUILD_EXT", "1").strip().lower() not in _FALSE


def cpu_stub_macros(cpp_extension) -> list[tuple[str, str]]:
    """The CPU capabilities the installed torch was built with, as ATen's DispatchStub.h expects
    them, and FXRT_CPU_STUBS; none when no known set links (fxrt/_speedups/cpu_stubs.py, loaded by
    its path: importing fxrt here would import torch's Python side for nothing)."""
    import importlib.util

    import torch

    here = os.path.dirname(os.path.abspath(__file__))
    spec = importlib.util.spec_from_file_location(
        "fxrt_cpu_stubs", os.path.join(here, "fxrt", "_speedups", "cpu_stubs.py")
    )
    module = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(module)
    macros = module.stub_macros(
        cpp_extension.include_paths(),
        cpp_extension.library_paths(),
        int(torch._C._GLIBCXX_USE_CXX11_ABI),
    )
    if not macros:
        print(
            "fxrt: no known DispatchStub declaration links with this torch (or no compiler to "
            "try); fxrt's own ops call the ATen ops instead of their CPU kernels"
        )
    return macros


def extensions() -> list:
    if not build_requested():
        print(
            "fxrt: FXRT_BUILD_EXT=0: installing without the C++ extension; compiled graphs run on "
            "the pure-Python loop (set FXRT_BUILD_EXT=0 at run time too to say it was chosen)"
        )
        return []
    try:
        import torch
        from torch.utils import cpp_extension
    except ImportError as e:
        raise RuntimeError(
            "fxrt's C++ extension is compiled against the installed torch, which this build "
            "cannot import. Install with `pip install --no-build-isolation .` in an environment "
            "that has torch, or set FXRT_BUILD_EXT=0 to install the pure-Python runtime."
        ) from e
    try:
        from Cython.Build import cythonize
    except ImportError as e:
        raise RuntimeError(
            "fxrt's C++ extension is built with Cython, which this environment lacks. With "
            "--no-build-isolation pip does not install build requirements: run `pip install "
            "'setuptools>=64' wheel 'cython>=3.0'` first, or set FXRT_BUILD_EXT=0 to install the "
            "pure-Python runtime."
        ) from e
    from setuptools import Extension

    lib_dirs = cpp_extension.library_paths()
    abi = int(torch._C._GLIBCXX_USE_CXX11_ABI)
    common = dict(
        library_dirs=lib_dirs,
        runtime_library_dirs=lib_dirs,
        libraries=["c10", "torch", "torch_cpu", "torch_python"],
        extra_compile_args=[
            "-std=c++20",
            "-O2",
            "-g0",
            "-fvisibility=hidden",
            "-Wno-unused-function",
        ],
        language="c++",
    )
    macros = [
        ("FXRT_TORCH_VERSION", f'"{torch.__version__}"'),
        ("_GLIBCXX_USE_CXX11_ABI", str(abi)),
        *cpu_stub_macros(cpp_extension),
    ]
    loop = Extension(
        "fxrt._speedups._loop",
        sources=["fxrt/_speedups/_loop.pyx"],
        depends=glob("fxrt/_speedups/*.h"),
        include_dirs=["fxrt/_speedups", *cpp_extension.include_paths()],
        define_macros=macros,
        **common,
    )
    # The C++ runtime (csrc/src, the sources the C++ API builds, without Python) and its Python
    # face; fxrt's own ops are registered by _loop, which fxrt imports first.
    runtime = Extension(
        "fxrt._speedups._runtime",
        sources=["fxrt/_speedups/_runtime.pyx", *sorted(glob("csrc/src/*.cpp"))],
        depends=[*glob("fxrt/_speedups/*.h"), *glob("csrc/src/*.h"), *glob("csrc/include/fxrt/*.h")],
        include_dirs=["csrc/include", "fxrt/_speedups", *cpp_extension.include_paths()],
        define_macros=[*macros, ("FXRT_NO_PYTHON", "1"), ("FXRT_OWN_OPS_REGISTERED", "1")],
        **common,
    )
    return cythonize([loop, runtime], compiler_directives={"language_level": 3}, quiet=True)


setup(ext_modules=extensions(), cmdclass={"build_ext": BuildExtReplacing})
