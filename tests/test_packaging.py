"""Packaging: the path a user with TensorFlow and Horovod already installed takes.

The wheel is built from this checkout as the install docs say (`pip wheel
--no-build-isolation`), installed into a fresh virtualenv that reuses the set-up's
TensorFlow, and the installed package then loads its own Grappler plugin, which Grappler
then calls, all from a directory outside the checkout. One wheel build and one
virtualenv, shared by the tests here: about 20 s on 2 cores, most of it compiling the two
native libraries against TensorFlow's headers.
"""
import json
import os
import shutil
import site
import subprocess
import sys
import sysconfig
import textwrap
import zipfile

import pytest

ROOT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
#: What a build needs from the checkout (the wheel is built from a copy of them, so that
#: the build neither writes into the checkout nor picks up what an editable install built
#: there).
BUILD_INPUTS = ["setup.py", "pyproject.toml", "README.md", "native", "tfoverlap"]
NOT_COPIED = shutil.ignore_patterns("__pycache__", "*.pyc", "*.so", "*.egg-info", "build")
NATIVE = ["_tfoverlap_optimizer", "_tfoverlap_emulated"]
#: Distributions that pip must never be asked to fetch or replace in a user's environment.
NOT_DEPENDENCIES = ("tensorflow", "tensorflow-cpu", "tensorflow-gpu", "tf-nightly",
                    "horovod", "keras")

pytestmark = pytest.mark.slow


def _clean_environment(**extra) -> dict:
    """This process's environment without what would point a child at the checkout or at
    another environment."""
    env = {key: value for key, value in os.environ.items()
           if key not in ("PYTHONPATH", "PYTHONHOME", "VIRTUAL_ENV", "PYTHONSTARTUP")
           and not key.startswith(("TFOVERLAP_", "PIP_"))}
    env.update(TF_CPP_MIN_LOG_LEVEL="2", PIP_DISABLE_PIP_VERSION_CHECK="1", **extra)
    return env


def _run(command, cwd, timeout=600, **kwargs):
    result = subprocess.run(command, cwd=cwd, env=_clean_environment(), capture_output=True,
                            text=True, timeout=timeout, **kwargs)
    assert result.returncode == 0, (
        f"{' '.join(map(str, command))} failed ({result.returncode}):\n"
        f"{result.stdout[-3000:]}\n{result.stderr[-5000:]}")
    return result


def _copy_build_inputs(destination):
    os.makedirs(destination)
    for name in BUILD_INPUTS:
        source = os.path.join(ROOT, name)
        if os.path.isdir(source):
            shutil.copytree(source, os.path.join(destination, name), ignore=NOT_COPIED)
        else:
            shutil.copy2(source, destination)


def _base_site_directories() -> list[str]:
    """The site directories this interpreter imports TensorFlow, Horovod and pip from."""
    directories = list(site.getsitepackages())
    if site.ENABLE_USER_SITE and os.path.isdir(site.getusersitepackages()):
        directories.append(site.getusersitepackages())
    return list(dict.fromkeys(os.path.realpath(d) for d in directories if os.path.isdir(d)))


@pytest.fixture(scope="module")
def installed(tmp_path_factory):
    """The wheel and a fresh virtualenv it is installed into, reusing this interpreter's
    TensorFlow (and everything else in its site-packages) without copying it.

    `python -m venv --system-site-packages` would not do: run from a virtualenv it reuses
    the *base* interpreter's site-packages, not the set-up's. So the new environment gets a
    .pth file naming this one's site directories as plain paths. They come after its own
    site-packages on sys.path, so what is installed into it wins; and as plain paths their
    own .pth files are not run, so the checkout's editable install (a path hook or a path
    in one of them) does not reach into the new environment.
    """
    work = tmp_path_factory.mktemp("packaging")
    source, wheelhouse, venv, elsewhere = (work / "source", work / "wheelhouse",
                                           work / "venv", work / "elsewhere")
    _copy_build_inputs(source)
    _run([sys.executable, "-m", "pip", "wheel", "--no-build-isolation", "--no-deps",
          "--no-index", "--wheel-dir", str(wheelhouse), str(source)], cwd=work)
    (wheel,) = wheelhouse.glob("tfoverlap-*.whl")

    _run([sys.executable, "-m", "venv", "--without-pip", str(venv)], cwd=work)
    python = venv / "bin" / "python"
    site_packages = _run([str(python), "-c", "import sysconfig; "
                          "print(sysconfig.get_path('platlib'))"], cwd=work).stdout.strip()
    base = _base_site_directories()
    assert base, "this interpreter has no site-packages to reuse"
    with open(os.path.join(site_packages, "_tfoverlap_test_base.pth"), "w") as out:
        out.write("".join(directory + "\n" for directory in base))
    # pip comes from the reused site-packages; --ignore-installed: the checkout's own
    # (editable) install is visible there too, and must not make pip skip this wheel.
    _run([str(python), "-m", "pip", "install", "--no-index", "--no-deps", "--ignore-installed",
          str(wheel)], cwd=work)
    elsewhere.mkdir()
    return {"wheel": wheel, "venv": venv, "python": python, "site_packages": site_packages,
            "base": base, "cwd": elsewhere}


def _inside(path, directory) -> bool:
    path, directory = os.path.realpath(path), os.path.realpath(directory)
    return os.path.commonpath([path, directory]) == directory


PROBE = textwrap.dedent("""
    import json, sys
    from importlib import metadata
    from packaging.requirements import Requirement

    import tfoverlap  # first: imported after TensorFlow, it loads the plugin itself
    from tfoverlap.integrations import emulated_kernel, grappler

    grappler.load()
    emulated_kernel.load_emulated_ops()
    import tensorflow as tf
    graph = tf.Graph()
    with graph.as_default():
        x = tf.compat.v1.placeholder(tf.float32, [None, 4], name="x")
        w = tf.compat.v1.get_variable("w", [4, 3], initializer=tf.ones_initializer())
        loss = tf.reduce_sum(tf.nn.relu(tf.matmul(x, w) + 1.0))
        init = tf.compat.v1.global_variables_initializer()
    with tf.compat.v1.Session(graph=graph, config=tfoverlap.session_config()) as session:
        session.run(init)
        value = session.run(loss, {x: [[1.0, 2.0, 3.0, 4.0]]})
    mapped = sorted({line.split()[-1] for line in open("/proc/self/maps")
                     if "_tfoverlap_" in line})
    def met(requirement):
        try:
            version = metadata.version(requirement.name)
        except metadata.PackageNotFoundError:
            return False
        return requirement.specifier.contains(version, prereleases=True)
    unmet = [text for text in metadata.requires("tfoverlap") or []
             if (r := Requirement(text)).marker is None and not met(r)]
    print(json.dumps({
        "package": tfoverlap.__file__, "plugin": grappler.library_path(),
        "kernel": emulated_kernel.emulated_library_path(), "mapped": mapped,
        "tensorflow": tf.__file__, "reports": len(tfoverlap.recent_reports()),
        "loss": float(value), "requires": metadata.requires("tfoverlap") or [],
        "unmet": unmet, "distribution": str(metadata.distribution("tfoverlap").locate_file("")),
        "path": sys.path}))
""")


def test_installed_wheel_loads_its_own_plugin(installed):
    result = _run([str(installed["python"]), "-c", PROBE], cwd=installed["cwd"], timeout=300)
    probe = json.loads(result.stdout.strip().splitlines()[-1])
    site_packages = installed["site_packages"]
    # The package, its two native libraries and what the process really mapped are the
    # installed wheel's, not the checkout's.
    for key in ("package", "plugin", "kernel", "distribution"):
        assert _inside(probe[key], site_packages), (key, probe[key], probe["path"])
        assert not _inside(probe[key], ROOT), (key, probe[key])
    assert len(probe["mapped"]) == len(NATIVE), probe["mapped"]
    for name, path in zip(sorted(NATIVE), probe["mapped"]):
        assert os.path.basename(path).startswith(name + "."), probe["mapped"]
        assert _inside(path, site_packages), probe["mapped"]
    # TensorFlow is the set-up's, reused rather than installed again.
    assert any(_inside(probe["tensorflow"], base) for base in installed["base"]), probe
    assert not _inside(probe["tensorflow"], installed["venv"]), probe
    # Grappler called the plugin: the session's graph went through the pipeline.
    assert probe["reports"] >= 1, probe
    assert probe["loss"] == pytest.approx(3 * (1 + 2 + 3 + 4 + 1)), probe
    # The wheel asks pip for nothing the environment lacks, and never for TensorFlow,
    # Horovod or Keras (a user's TensorFlow may be tensorflow-cpu or a vendor build).
    assert probe["unmet"] == [], probe["requires"]
    named = [text.split(";")[0].strip().lower() for text in probe["requires"]]
    assert not [n for n in named if n.startswith(NOT_DEPENDENCIES)], probe["requires"]


def test_installed_wheel_has_console_script_and_start_up_file(installed):
    script = installed["venv"] / "bin" / "tfoverlap"
    with open(script) as text:
        assert text.readline().strip() == f"#!{installed['python']}"
    result = _run([str(script), "--help"], cwd=installed["cwd"], timeout=120)
    assert "usage: tfoverlap" in result.stdout
    # `tfoverlap run` on a host without the boot directory relies on this file.
    start_up = os.path.join(installed["site_packages"], "tfoverlap-run.pth")
    with open(start_up) as text:
        assert "activate_from_install()" in text.read()
    with zipfile.ZipFile(installed["wheel"]) as wheel:
        names = set(wheel.namelist())
    assert "tfoverlap/boot/sitecustomize.py" in names
    assert "tfoverlap/testbed/mpi_rsh_agent.sh" in names
    suffix = sysconfig.get_config_var("EXT_SUFFIX")
    assert {f"tfoverlap/{name}{suffix}" for name in NATIVE} <= names


def test_build_without_tensorflow_says_how_to_build(tmp_path):
    """What pip's default (isolated) build shows: TensorFlow is missing where the plugin
    is compiled, and the message says to build with --no-build-isolation."""
    for name in ("setup.py", "pyproject.toml", "README.md"):
        shutil.copy2(os.path.join(ROOT, name), tmp_path)
    hide_tensorflow = ("import sys; sys.modules['tensorflow'] = None; "
                       "sys.argv = ['setup.py', 'build_ext']; "
                       "exec(compile(open('setup.py').read(), 'setup.py', 'exec'))")
    result = subprocess.run([sys.executable, "-c", hide_tensorflow], cwd=tmp_path,
                            env=_clean_environment(), capture_output=True, text=True,
                            timeout=120)
    assert result.returncode != 0
    assert "TensorFlow does not import" in result.stderr, result.stderr[-3000:]
    assert "pip install --no-build-isolation ." in result.stderr, result.stderr[-3000:]
    assert not list(tmp_path.rglob("*.so"))
