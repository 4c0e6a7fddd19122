"""Build the C++ planner (`lightning_rotor._planner`); metadata lives in pyproject.toml."""

from pybind11.setup_helpers import Pybind11Extension, build_ext
from setuptools import setup

setup(
    ext_modules=[
        Pybind11Extension(
            "lightning_rotor._planner",
            ["cpp/planner.cpp", "cpp/bindings.cpp"],
            include_dirs=["cpp"],
            cxx_std=17,
            extra_compile_args=["-O3", "-pthread"],
            extra_link_args=["-pthread"],
            depends=["cpp/planner.hpp"],
        )
    ],
    cmdclass={"build_ext": build_ext},
)
