"""Packaging hook: ship the catalog (specs/*.yaml) inside the package as specc/catalog/,
so that `extends: NAME` finds catalog specs from an installed wheel too."""
import glob
import os
import shutil

from setuptools import setup
from setuptools.command.build_py import build_py


class BuildPyWithCatalog(build_py):
    def run(self):
        super().run()
        here = os.path.dirname(os.path.abspath(__file__))
        dest = os.path.join(self.build_lib, "specc", "catalog")
        os.makedirs(dest, exist_ok=True)
        for path in sorted(glob.glob(os.path.join(here, "specs", "*.yaml"))):
            shutil.copy2(path, dest)


setup(cmdclass={"build_py": BuildPyWithCatalog})
