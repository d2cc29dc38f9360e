"""Builds the native coder, ``speckv.coder._native`` (coder/kernels/spk_native.cpp);
all other metadata lives in pyproject.toml.

NOTE: the build is optional so that a machine without a C++17 compiler still
installs speckv (the CLI then says so in one line and codes with numpy), unless
SPECKV_REQUIRE_NATIVE=1 is set, as CI and the Docker images do: then a failed
build fails the install.
"""

import os

from setuptools import Extension, setup
from setuptools.command.build_ext import build_ext

# NOTE: no -ffast-math and no FMA contraction: the model's few float32 operations
# must round exactly as numpy's do (coder/kernels/spk_model.cuh)
HEADERS = ("spk_simd.h", "spk_block.h", "spk_encode.h", "spk_decode.h", "spk_model.cuh", "spk_float.cuh",
           "rans_lane.cuh", "spk_consts.h", "spk_portable.h", "spk_portable_py.h", "spk_py.h",
           "spk_w8a8.h", "spk_w8a8_py.h", "spk_attn.h", "spk_attn_py.h", "spk_wide.h", "spk_iattn.h", "spk_igemm.h",
           "spk_attn_avx2.h", "spk_amx.h", "spk_attn_amx.h", "spk_fp8_amx.h", "spk_fp8_amx_py.h", "spk_pool.h",
           "spk_w8a8_amx.h", "spk_w8a8_amx_py.h", "spk_silu.h", "spk_mlp_amx.h", "spk_rans_step.h",
           "spk_fields.h")
FLAGS = ["-O3", "-std=c++17", "-ffp-contract=off", "-fno-fast-math", "-fvisibility=hidden", "-pthread"]


class OptionalBuildExt(build_ext):
    def build_extension(self, ext: Extension) -> None:
        try:
            super().build_extension(ext)
        except Exception as exc:  # noqa: BLE001 -- any compiler failure: install without it
            if os.environ.get("SPECKV_REQUIRE_NATIVE") == "1":
                raise
            print(f"WARNING: speckv's native coder was not built ({exc}); the numpy coder will be used")


setup(
    ext_modules=[Extension("speckv.coder._native", sources=["coder/kernels/spk_native.cpp"],
                           include_dirs=["coder/kernels"], depends=[f"coder/kernels/{n}" for n in HEADERS],
                           extra_compile_args=FLAGS, extra_link_args=["-pthread"], language="c++")],
    cmdclass={"build_ext": OptionalBuildExt},
)
