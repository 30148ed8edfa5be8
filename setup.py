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
from setuptools.command.build_py import build_py
from setuptools.command.develop import develop

#: In site-packages: switches TfOverlap on in a process that `tfoverlap run` started whose
#: PYTHONPATH names a boot directory this host lacks (tfoverlap.launcher.activate_from_install).
START_UP_FILE = "tfoverlap-run.pth"
START_UP_LINE = ('import os; os.environ.get("TFOVERLAP_RUN") and __import__('
                 '"tfoverlap.launcher", fromlist=["launcher"]).activate_from_install()\n')


def write_start_up_file(directory: str) -> str:
    path = os.path.join(directory, START_UP_FILE)
    os.makedirs(directory, exist_ok=True)
    with open(path, "w") as out:
        out.write(START_UP_LINE)
    return path


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


class BuildWithStartUpFile(build_py):
    """Puts the start-up file beside the package, so that an install takes it to
    site-packages."""

    def run(self):
        super().run()
        write_start_up_file(self.build_lib)

    def get_outputs(self, include_bytecode=1):
        return super().get_outputs(include_bytecode) + [
            os.path.join(self.build_lib, START_UP_FILE)]


class DevelopWithStartUpFile(develop):
    """An editable install (`pip install -e .`) writes the start-up file too."""

    def run(self):
        super().run()
        write_start_up_file(self.install_dir)


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
    cmdclass={"build_ext": BuildAgainstInstalledTensorFlow, "build_py": BuildWithStartUpFile,
              "develop": DevelopWithStartUpFile},
    install_requires=["numpy", "absl-py"],
    entry_points={"console_scripts": ["tfoverlap = tfoverlap.cli:main"]},
)
