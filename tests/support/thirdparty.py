"""The host frameworks' real sources for the tests: MindSpeed-LLM, MindSpeed, Megatron-LM.

The tests that run LAGA inside the real host code ask for the run-wide fixture
``host_sources``: a dict ``{"MINDSPEED_LLM_SRC": path, "MINDSPEED_SRC": path,
"MEGATRON_SRC": path}`` of source roots to put first on ``sys.path``. They come,
in this order of preference, from

1. those three environment variables, when all are set (your own checkouts), or
2. the unmodified upstream source archives named in ``ARCHIVES``, found in
   ``$LAGA_THIRDPARTY`` or else in ``shared/thirdparty`` beside the repository,
   unpacked once into ``${XDG_CACHE_HOME:-~/.cache}/mindspeed-laga/thirdparty/``
   (one folder per archive checksum, so a new archive unpacks afresh and
   concurrent test runs never see a half-unpacked tree).

The host code also imports ``six regex yaml tqdm einops`` (``pip install six
regex pyyaml tqdm einops``). When sources or modules are missing the tests that
need them skip, naming what to provide; with ``CI=true`` they fail instead, so
CI can never pass without running them.

Every tested MindSpeed-LLM release pair has its own archives (``RELEASES``:
release -> MindSpeed-LLM and MindSpeed archive; Megatron core_v0.12.1 is shared
by all). ``find_host_sources(release)`` gives that pair's roots (each archive
unpacked once), ``release_sources(release)`` the same for a test (skip, or
fail under CI), and ``RELEASE_NAMES`` parametrizes a test over them. The three
environment variables override the ``master`` pair only.

A release whose FSDP2 backend (``train_fsdp2.py``, ``examples/fsdp2/``) ships as a second
archive lists it in ``FSDP2_OVERLAYS``; ``fsdp2_sources(release)`` gives the pair's roots with
that archive unpacked over the MindSpeed-LLM one (once per pair of checksums, the same way).

``python tests/support/thirdparty.py [release]`` prints ``export NAME=path`` lines for a shell.
"""
from __future__ import annotations

import hashlib
import importlib.util
import os
import shlex
import shutil
import sys
import tarfile
import tempfile
from pathlib import Path

import pytest

from mindspeed_laga.patches.mindspeed_llm.releases import RELEASES as TESTED_RELEASES

REPO = Path(__file__).resolve().parents[2]
# release -> (MindSpeed-LLM archive, MindSpeed archive): the pairs the adapter is tested with,
# named by the release rows (patches/mindspeed_llm/releases.py: release and commits)
RELEASES = {r.name: r.archives() for r in TESTED_RELEASES}
# environment variable -> (archive, its one top-level folder); the commits the tests pin
ARCHIVES = {
    "MINDSPEED_LLM_SRC": (RELEASES["master"][0], "MindSpeed-LLM"),
    "MINDSPEED_SRC": (RELEASES["master"][1], "MindSpeed"),
    "MEGATRON_SRC": ("megatron-lm-core_v0.12.1.tar.gz", "Megatron-LM"),
}
MEGATRON = ARCHIVES["MEGATRON_SRC"]
# release -> the archive of its FSDP2 backend, unpacked over its MindSpeed-LLM archive
FSDP2_OVERLAYS = {"26.1.0": "mindspeed-llm-26.1.0-ad615b3b-fsdp2.tar.gz"}
RELEASE_NAMES = tuple(RELEASES)
HOST_MODULES = {"six": "six", "regex": "regex", "yaml": "pyyaml", "tqdm": "tqdm",
                "einops": "einops"}  # import name -> pip name


class HostsMissing(Exception):
    """The real host sources or the modules they import are not available."""


def in_ci() -> bool:
    return os.environ.get("CI", "").strip().lower() in ("1", "true", "yes")


def skip_or_fail(message: str):
    """A test that lacks what it needs: skips naming it, or fails under CI=true (CI has it)."""
    if in_ci():
        pytest.fail(f"CI=true and {message}", pytrace=False)
    pytest.skip(message)


def require_peft():
    """For the tests of peft's real LoRA layers: peft as CI's Ascend leg installs it."""
    if importlib.util.find_spec("peft") is None:
        skip_or_fail("peft is not installed (pip install peft==0.7.1, as CI's Ascend leg has)")


def archive_dir() -> Path:
    return Path(os.environ.get("LAGA_THIRDPARTY") or REPO.parent / "shared" / "thirdparty")


def cache_dir() -> Path:
    base = os.environ.get("XDG_CACHE_HOME") or Path.home() / ".cache"
    return Path(base) / "mindspeed-laga" / "thirdparty"


def _sha256(path: Path) -> str:
    digest = hashlib.sha256()
    with open(path, "rb") as f:
        for block in iter(lambda: f.read(1 << 20), b""):
            digest.update(block)
    return digest.hexdigest()


def unpack(archive: Path, top: str, *overlays: Path) -> Path:
    """The archive's top folder, unpacked under the cache (once per checksum); ``overlays``:
    archives of the same top folder unpacked over it in order (the folder is then named by
    every archive and keyed by all their checksums)."""
    layers = (archive, *overlays)
    names = "+".join(a.name[:-len(".tar.gz")] for a in layers)
    key = hashlib.sha256("".join(_sha256(a) for a in layers).encode()).hexdigest() \
        if overlays else _sha256(archive)
    target = cache_dir() / f"{names}-{key[:16]}"
    if not (target / top).is_dir():
        target.parent.mkdir(parents=True, exist_ok=True)
        staging = Path(tempfile.mkdtemp(prefix=".unpacking-", dir=target.parent))
        try:
            for layer in layers:
                with tarfile.open(layer) as tar:
                    # the "data" filter refuses links and paths that leave the folder
                    kwargs = {"filter": "data"} if hasattr(tarfile, "data_filter") else {}
                    tar.extractall(staging, **kwargs)
            if not (staging / top).is_dir():
                raise HostsMissing(f"{archive} does not unpack into {top}/")
            try:
                staging.rename(target)  # atomic: another process may have won the race
            except OSError:
                if not (target / top).is_dir():
                    raise
        finally:
            shutil.rmtree(staging, ignore_errors=True)
    return target / top


def release_archives(release: str) -> dict:
    """{env var: (archive, top folder)} of a release pair (KeyError names the releases)."""
    if release not in RELEASES:
        raise KeyError(f"unknown release {release!r}; tested: {', '.join(RELEASES)}")
    llm, mindspeed = RELEASES[release]
    return {"MINDSPEED_LLM_SRC": (llm, "MindSpeed-LLM"), "MINDSPEED_SRC": (mindspeed, "MindSpeed"),
            "MEGATRON_SRC": MEGATRON}


def find_host_sources(release: str = "master") -> dict:
    """{env var: source root} of a release pair; raises HostsMissing naming what to provide."""
    archives = release_archives(release)
    if release == "master" and all(os.environ.get(key) for key in archives):
        sources = {key: Path(os.environ[key]) for key in archives}
    else:
        folder = archive_dir()
        missing = [name for name, _ in archives.values() if not (folder / name).is_file()]
        if missing:
            raise HostsMissing(
                f"the real MindSpeed-LLM {release}, MindSpeed and Megatron-LM sources are "
                f"needed: put {', '.join(name for name, _ in archives.values())} in {folder} (or "
                f"point LAGA_THIRDPARTY at their folder)"
                + (f", or set {', '.join(archives)} to checkouts of those commits"
                   if release == "master" else "") + f"; missing: {', '.join(missing)}")
        sources = {key: unpack(folder / name, top) for key, (name, top) in archives.items()}
    absent = [f"{key}={path}" for key, path in sources.items() if not path.is_dir()]
    if absent:
        raise HostsMissing(f"not a folder: {', '.join(absent)}")
    modules = [pip for name, pip in HOST_MODULES.items() if importlib.util.find_spec(name) is None]
    if modules:
        raise HostsMissing(f"the host frameworks import modules that are missing: "
                           f"pip install {' '.join(modules)}")
    return {key: str(path) for key, path in sources.items()}


def find_fsdp2_sources(release: str = "26.1.0") -> dict:
    """{env var: source root} of a release pair with its FSDP2 archive unpacked over its
    MindSpeed-LLM one; raises HostsMissing naming what to provide."""
    if release not in FSDP2_OVERLAYS:
        raise KeyError(f"no FSDP2 archive for release {release!r}; "
                       f"known: {', '.join(FSDP2_OVERLAYS)}")
    sources = find_host_sources(release)
    folder, overlay = archive_dir(), FSDP2_OVERLAYS[release]
    if not (folder / overlay).is_file():
        raise HostsMissing(f"MindSpeed-LLM {release}'s FSDP2 backend is needed: put {overlay} "
                           f"in {folder} (or point LAGA_THIRDPARTY at its folder)")
    llm = RELEASES[release][0]
    sources["MINDSPEED_LLM_SRC"] = str(unpack(folder / llm, "MindSpeed-LLM", folder / overlay))
    return sources


def fsdp2_sources(release: str = "26.1.0") -> dict:
    """For a test: :func:`find_fsdp2_sources`; skips when absent, fails under CI=true."""
    try:
        return find_fsdp2_sources(release)
    except HostsMissing as missing:
        skip_or_fail(str(missing))


def release_sources(release: str) -> dict:
    """For a test: the release pair's roots; skips when absent, fails under CI=true."""
    try:
        return find_host_sources(release)
    except HostsMissing as missing:
        skip_or_fail(str(missing))


# master runs in every leg; the other release pairs are the Ascend leg's matrix (``hosts``)
@pytest.fixture(scope="session", params=[
    pytest.param(r, marks=() if r == "master" else pytest.mark.hosts) for r in RELEASE_NAMES])
def release_host_sources(request):
    """(release, its source roots), once per tested release pair."""
    return request.param, release_sources(request.param)


@pytest.fixture(scope="session")
def host_sources():
    """Source roots of the real hosts (the master pair); skips when absent, fails under CI=true."""
    return release_sources("master")


if __name__ == "__main__":
    try:
        found = find_host_sources(*sys.argv[1:2])
    except HostsMissing as missing:
        sys.exit(f"thirdparty: {missing}")
    for key, path in found.items():
        print(f"export {key}={shlex.quote(path)}")
