"""setuptools hook: the version from git (agent/version.py), baked into the wheel as
agent/_build_info.py so an installed agent knows it without git. Everything else is in
pyproject.toml."""

from __future__ import annotations

import importlib.util
from pathlib import Path
from types import ModuleType

from setuptools import setup
from setuptools.command.build_py import build_py

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
    INFO = VERSION.from_git(HERE)
except (VERSION.VersionError, OSError):
    # No history (an export, a shallow clone): installable, as NEXT_RELEASE.dev0 of an unknown
    # commit. scripts/build-packages refuses such a checkout.
    INFO = VERSION.BuildInfo(f"{VERSION.NEXT_RELEASE}.dev0", VERSION.UNKNOWN_REVISION)


class BuildPyWithVersion(build_py):
    def run(self) -> None:
        super().run()
        if not self.editable_mode:  # an editable install reads git at run time
            target = Path(self.build_lib) / "agent" / "_build_info.py"
            target.write_text(VERSION.build_info_module(INFO), encoding="utf-8")


setup(version=INFO.version, cmdclass={"build_py": BuildPyWithVersion})
