"""setuptools hook: the version of this source tree (agent/version.py: GPU_AGENT_VERSION, git at the
repository's top level, or the archival file `git archive` filled), baked into the wheel as
agent/_build_info.py so an installed agent knows it without git. A tree that names no version is
refused, never built as a guess. Everything else is in pyproject.toml."""

from __future__ import annotations

import atexit
import importlib.util
import shutil
import tempfile
from pathlib import Path
from types import ModuleType

from setuptools import setup
from setuptools.command.build import build
from setuptools.command.build_py import build_py
from setuptools.command.sdist import sdist

HERE = Path(__file__).resolve().parent


def _version_module() -> ModuleType:
    # By path: importing the agent package here would need its dependencies in the build environment.
    spec = importlib.util.spec_from_file_location("gpu_agent_version", HERE / "agent" / "version.py")
    assert spec is not None and spec.loader is not None
    module = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(module)
    return module


VERSION = _version_module()
try:
    INFO = VERSION.from_tree(HERE)
except VERSION.VersionError as exc:
    # A wheel named 0.2.0.dev0 of an unknown commit would sort below every real build: apt, dnf
    # and pip would never replace it.
    raise SystemExit(f"gpu-agent: {exc}") from None


class BuildApart(build):
    def initialize_options(self) -> None:
        super().initialize_options()
        # Each build in a directory of its own, not the tree's build/: two builds of the checkout at
        # once (a package build beside a test's wheel) shared build/lib and build/bdist.* and broke each
        # other, and a module an earlier build of another commit left there shipped again.
        self.build_base = tempfile.mkdtemp(prefix="gpu-agent-build-")
        atexit.register(shutil.rmtree, self.build_base, True)


class BuildPyWithVersion(build_py):
    def run(self) -> None:
        super().run()
        if not self.editable_mode:  # an editable install reads git at run time
            target = Path(self.build_lib) / "agent" / "_build_info.py"
            target.write_text(VERSION.build_info_module(INFO), encoding="utf-8")


class SdistWithVersion(sdist):
    def make_release_tree(self, base_dir: str, files: list[str]) -> None:
        # An sdist is no git checkout: its archival file names the version it was made with, so
        # the wheel built from it (`python -m build` makes the sdist first) has the same one.
        super().make_release_tree(base_dir, files)
        target = Path(base_dir) / VERSION.ARCHIVAL_FILE
        target.unlink(missing_ok=True)  # a hard link to the checkout's copy, maybe
        target.write_text(VERSION.archival_text(INFO, VERSION.commit_time(HERE)), encoding="utf-8")


setup(version=INFO.version, cmdclass={"build": BuildApart, "build_py": BuildPyWithVersion, "sdist": SdistWithVersion})
