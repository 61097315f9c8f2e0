"""Build hook: a wheel carries the run-time folders (web/, signaling/, configs/) inside the package.

Everything else is declared in pyproject.toml.
"""

import shutil
from pathlib import Path

from setuptools import setup
from setuptools.command.build_py import build_py

SHARED_FOLDERS = ("web", "signaling", "configs")


class BuildWithSharedFolders(build_py):
    def run(self) -> None:
        super().run()
        if self.editable_mode:  # an editable install reads them from the checkout
            return
        root = Path(__file__).resolve().parent
        target = Path(self.build_lib) / "lychee_rtc" / "_share"
        for folder in SHARED_FOLDERS:
            dest = target / folder
            if dest.exists():
                shutil.rmtree(dest)
            shutil.copytree(root / folder, dest, ignore=shutil.ignore_patterns("__pycache__", "*.pyc"))


setup(cmdclass={"build_py": BuildWithSharedFolders})
