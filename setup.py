"""Build tfoverlap's native libraries; the package's metadata is in pyproject.toml.

The compiled parts are in native/: the Grappler shim and the emulated-accelerator kernel.
They are built against the TensorFlow that is installed in the build environment (its
bundled headers and its own compile and link flags), so the package must be built with
--no-build-isolation:

    pip install --no-build-isolation .       # or -e . for an editable install
"""
import base64
import hashlib
import os
import subprocess
import sys
import zipfile

from setuptools import Extension, setup
from setuptools.command.build_ext import build_ext
from setuptools.command.build_py import build_py
from setuptools.command.develop import develop
from setuptools.command.editable_wheel import editable_wheel

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


def import_build_tensorflow():
    """The TensorFlow to compile against: the one this build's Python imports."""
    try:
        import tensorflow as tf
    except ImportError as error:
        isolated = any("pip-build-env-" in str(entry) for entry in sys.path)
        raise SystemExit(
            "\ntfoverlap: cannot build its Grappler plugin: TensorFlow does not import in "
            f"the build environment ({sys.executable}: {error}).\n"
            "The plugin is compiled against the TensorFlow installed where it will run. "
            "Install TensorFlow first, then build in that environment with pip's build "
            "isolation off:\n"
            "    pip install --no-build-isolation .      (or: -e .)\n"
            + ("This build ran in pip's isolated build environment, which hides the "
               "installed TensorFlow.\n" if isolated else "")) from error
    return tf


class BuildAgainstInstalledTensorFlow(build_ext):
    """Compiles the native libraries with tf.sysconfig's flags instead of Python's, both
    at once (each takes tens of seconds: TensorFlow's headers are large)."""

    def finalize_options(self):
        super().finalize_options()
        if self.parallel is None:
            self.parallel = True

    def run(self):
        self._tensorflow = import_build_tensorflow()
        super().run()

    def copy_file(self, infile, outfile, *args, **kwargs):
        """An in-place build (-e) replaces a library rather than writing over it, so that a
        process that has the old one loaded (a test run, a training job) keeps it intact."""
        if self.dry_run or os.path.isdir(outfile):
            return super().copy_file(infile, outfile, *args, **kwargs)
        partial = f"{outfile}.partial-{os.getpid()}"
        _, copied = super().copy_file(infile, partial, *args, **kwargs)
        os.replace(partial, outfile)
        return outfile, copied

    def build_extension(self, ext):
        tf = self._tensorflow
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


def add_to_wheel(wheel: str, name: str, text: str) -> None:
    """Adds file ``name`` (at the wheel's root, i.e. site-packages) to ``wheel``, with its
    line in the wheel's RECORD."""
    data = text.encode()
    with zipfile.ZipFile(wheel) as old:
        entries = [(info, old.read(info)) for info in old.infolist()]
    if any(info.filename == name for info, _ in entries):
        return
    digest = base64.urlsafe_b64encode(hashlib.sha256(data).digest()).rstrip(b"=").decode()
    line = f"{name},sha256={digest},{len(data)}\n".encode()
    added = zipfile.ZipInfo(name, date_time=entries[0][0].date_time)
    added.external_attr = 0o644 << 16
    added.compress_type = zipfile.ZIP_DEFLATED
    partial = wheel + ".partial"
    with zipfile.ZipFile(partial, "w", zipfile.ZIP_DEFLATED) as new:
        new.writestr(added, data)
        for info, content in entries:
            if info.filename.endswith(".dist-info/RECORD"):
                content = content.rstrip(b"\n") + b"\n" + line
            new.writestr(info, content)
    os.replace(partial, wheel)


class EditableWithStartUpFile(editable_wheel):
    """An editable install (`pip install -e .`, PEP 660) gets the start-up file too: the
    editable wheel setuptools makes holds only a path hook, so it is added to that wheel.
    (The native libraries are built in place, in tfoverlap/, where the package loads them.)"""

    def run(self):
        before = self._wheels()
        super().run()
        for wheel, stamp in self._wheels().items():
            if before.get(wheel) != stamp:
                add_to_wheel(wheel, START_UP_FILE, START_UP_LINE)

    def _wheels(self) -> dict:
        directory = str(self.dist_dir)
        return {os.path.join(directory, name): os.stat(os.path.join(directory, name)).st_mtime_ns
                for name in os.listdir(directory) if name.endswith(".whl")}


class DevelopWithStartUpFile(develop):
    """`setup.py develop` (what an old pip or setuptools runs for -e) writes it too."""

    def run(self):
        super().run()
        write_start_up_file(self.install_dir)


setup(
    ext_modules=[Extension("tfoverlap._tfoverlap_optimizer",
                           sources=["native/tfoverlap_optimizer.cc"]),
                 Extension("tfoverlap._tfoverlap_emulated",
                           sources=["native/emulated_compute.cc"])],
    cmdclass={"build_ext": BuildAgainstInstalledTensorFlow, "build_py": BuildWithStartUpFile,
              "editable_wheel": EditableWithStartUpFile, "develop": DevelopWithStartUpFile},
)
