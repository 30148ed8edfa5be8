"""Build and install tfoverlap.

The compiled parts are in native/: the Grappler shim and the emulated-accelerator kernel.
They are built against the TensorFlow that is installed in the build environment (its
bundled headers and its own compile and link flags), so the package must be built with
--no-build-isolation.
"""
import os
import subprocess
import sys

from setuptools import Extension, find_packages, setup
from setuptools.command.build_ext import build_ext


class BuildAgainstInstalledTensorFlow(build_ext):
    """Compiles the native libraries with tf.sysconfig's flags instead of Python's."""

    def build_extension(self, ext):
        try:
            import tensorflow as tf
        except ImportError as error:
            raise SystemExit(
                "tfoverlap builds its Grappler plugin against an installed TensorFlow; "
                "install tensorflow first and build with --no-build-isolation") from error
        output = self.get_ext_fullpath(ext.name)
        os.makedirs(os.path.dirname(output), exist_ok=True)
        command = ([os.environ.get("CXX", "g++"), "-std=c++17", "-shared", "-fPIC", "-O2"]
                   + tf.sysconfig.get_compile_flags() + ext.sources
                   + ["-o", output] + tf.sysconfig.get_link_flags())
        print(" ".join(command), file=sys.stderr)
        subprocess.check_call(command)


setup(
    name="tfoverlap",
    version="0.1.0",
    description="Overlap communication with computation in data-parallel TensorFlow "
                "training (TicTac and Caramel as Grappler passes)",
    long_description=open(os.path.join(os.path.dirname(__file__), "README.md")).read(),
    long_description_content_type="text/markdown",
    python_requires=">=3.9",
    packages=find_packages(include=["tfoverlap", "tfoverlap.*"]),
    package_data={"tfoverlap.testbed": ["mpi_rsh_agent.sh"],
                  "tfoverlap": ["boot/sitecustomize.py"]},
    ext_modules=[Extension("tfoverlap._tfoverlap_optimizer",
                           sources=["native/tfoverlap_optimizer.cc"]),
                 Extension("tfoverlap._tfoverlap_emulated",
                           sources=["native/emulated_compute.cc"])],
    cmdclass={"build_ext": BuildAgainstInstalledTensorFlow},
    install_requires=["numpy", "absl-py"],
    entry_points={"console_scripts": ["tfoverlap = tfoverlap.cli:main"]},
)
