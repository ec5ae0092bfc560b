"""`python -m launch wheels` (launch/wheels.py): the wheels a machine without a package registry lacks. The last two
tests reach the package registry, as `make install` does."""
from __future__ import annotations

import subprocess
import sys
import zipfile

import pytest

from launch.cluster import LaunchError
from launch.wheels import (build_wheel_from_source, is_provided, manylinux_platforms, normalized,
                           packages_the_target_has)
from tests.machine_speed import scaled


def test_a_freeze_is_read_as_names_and_public_versions_and_a_line_it_cannot_read_is_named():
    freeze = """# a comment
torch==2.11.0+cu130
Pillow==12.0.0
typing_extensions==4.15.0
ffcv @ file:///tmp/ffcv-1.0.2.tar.gz
-e git+https://example.org/hardview.git@abc#egg=hardview
--extra-index-url https://example.org/simple
opencv-python-headless==4.12.0.88  # the image's
numba
"""
    assert packages_the_target_has(freeze) == {"torch": "2.11.0", "pillow": "12.0.0", "typing-extensions": "4.15.0",
                                               "ffcv": None, "hardview": None, "opencv-python-headless": "4.12.0.88",
                                               "numba": None}
    with pytest.raises(LaunchError, match="'torch 2.11'"):
        packages_the_target_has("torch 2.11\n")
    have = packages_the_target_has(freeze)
    assert is_provided("opencv-python", have) and is_provided(normalized("Typing.Extensions"), have)
    assert not is_provided("deepspeed", have)


def test_the_platforms_are_every_manylinux_tag_the_targets_glibc_loads():
    tags = manylinux_platforms("2.28")
    assert tags[0] == "manylinux_2_28_x86_64" and "manylinux_2_5_x86_64" in tags and "manylinux_2_29_x86_64" not in tags
    assert tags[-3:] == ["manylinux2014_x86_64", "manylinux2010_x86_64", "manylinux1_x86_64"]
    with pytest.raises(LaunchError, match="--glibc 2.12"):
        manylinux_platforms("2.12")


@pytest.mark.slow
def test_the_wheels_are_what_the_freeze_lacks_and_install_without_a_registry(tmp_path, capsys):
    """A project of two pins, numpy (the target has it, at another version than the pin) and cmaes (it lacks it):
    cmaes alone is fetched, listed in requirements.txt, and installs with --no-index."""
    from launch.__main__ import main

    project = tmp_path / "project"
    project.mkdir()
    (project / "pyproject.toml").write_text('[project]\nname = "two-pins"\nversion = "0"\n'
                                            'dependencies = ["numpy==2.4.6", "cmaes==0.13.1"]\n'
                                            '[project.optional-dependencies]\ntest = []\n')
    (tmp_path / "have.txt").write_text("numpy==2.3.5\n")
    out = tmp_path / "wheels"
    python = f"{sys.version_info.major}.{sys.version_info.minor}"
    assert main(["wheels", "--have", str(tmp_path / "have.txt"), "--python-version", python, "--out", str(out),
                 "--project", str(project)]) == 0
    assert [wheel.name for wheel in out.glob("*.whl")] == ["cmaes-0.13.1-py3-none-any.whl"]
    assert (out / "requirements.txt").read_text() == "cmaes==0.13.1\n"
    assert "1 packages the target lacks" in capsys.readouterr().out
    subprocess.run([sys.executable, "-m", "pip", "--isolated", "install", "--quiet", "--no-index", "--no-deps",
                    "--target", str(tmp_path / "site"), *map(str, out.glob("*.whl"))], check=True,
                   timeout=scaled(120))
    imported = subprocess.run([sys.executable, "-c", "import cmaes; print(cmaes.__file__)"], capture_output=True,
                              text=True, env={"PYTHONPATH": str(tmp_path / "site")}, timeout=scaled(60))
    assert imported.stdout.startswith(str(tmp_path / "site"))
    assert main(["wheels", "--have", str(tmp_path / "none.txt"), "--python-version", python, "--out", str(out)]) == 2
    assert main(["wheels", "--have", str(tmp_path / "have.txt"), "--python-version", "312", "--out", str(out)]) == 2
    assert main(["wheels", "--have", str(tmp_path / "have.txt"), "--python-version", python, "--out", str(out),
                 "--project", str(project)]) == 2
    errors = capsys.readouterr().err.splitlines()
    assert "none.txt: no such file" in errors[0] and "--python-version '312'" in errors[1]
    assert f"--out {out} holds wheels already" in errors[2]


@pytest.mark.slow
def test_a_wheel_of_compiled_code_carries_the_libraries_it_links(tmp_path):
    """A C extension linking libjpeg-turbo (as FFCV's does), built from source: its wheel holds a copy of the
    library, which the extension loads instead of the system's."""
    source = tmp_path / "jpeg_version"
    source.mkdir()
    (source / "jpeg_version.c").write_text("""
#include <Python.h>
#include <turbojpeg.h>
static PyObject *handle_made(PyObject *self, PyObject *args) {
    tjhandle handle = tjInitCompress();
    int made = handle != NULL;
    if (made) tjDestroy(handle);
    return PyBool_FromLong(made);
}
static PyMethodDef methods[] = {{"handle_made", handle_made, METH_NOARGS, ""}, {NULL, NULL, 0, NULL}};
static struct PyModuleDef module = {PyModuleDef_HEAD_INIT, "jpeg_version", NULL, -1, methods};
PyMODINIT_FUNC PyInit_jpeg_version(void) { return PyModule_Create(&module); }
""")
    (source / "pyproject.toml").write_text('[build-system]\nrequires = ["setuptools>=68"]\n'
                                           'build-backend = "setuptools.build_meta"\n'
                                           '[project]\nname = "jpeg-version"\nversion = "1.0"\n')
    (source / "setup.py").write_text("from setuptools import Extension, setup\n"
                                     "setup(ext_modules=[Extension('jpeg_version', ['jpeg_version.c'], "
                                     "libraries=['turbojpeg'])])\n")
    out = tmp_path / "wheels"
    out.mkdir()
    wheel = build_wheel_from_source(source, sys.executable, out)
    assert "manylinux" in wheel.name
    members = zipfile.ZipFile(wheel).namelist()
    assert any(name.startswith("jpeg_version.libs/libturbojpeg") for name in members), members
    site = tmp_path / "site"
    subprocess.run([sys.executable, "-m", "pip", "--isolated", "install", "--quiet", "--no-index", "--no-deps",
                    "--target", str(site), str(wheel)], check=True, timeout=scaled(120))
    loaded = subprocess.run([sys.executable, "-c", "import jpeg_version; print(jpeg_version.handle_made()); "
                             "print(open('/proc/self/maps').read())"], capture_output=True, text=True,
                            env={"PYTHONPATH": str(site)}, timeout=scaled(60))
    assert loaded.stdout.startswith("True\n"), loaded.stderr
    turbojpeg = {line.split()[-1] for line in loaded.stdout.splitlines() if "libturbojpeg" in line}
    assert turbojpeg and all(path.startswith(str(site / "jpeg_version.libs")) for path in turbojpeg), turbojpeg
