"""Packaging lives in setup.cfg; this file only adds the import hook's .pth file.

``fairseq_oss.pth`` is copied to the top of site-packages so that ``--optimizer oss_adam``
is registered in every process that imports fairseq, with no ``--user-dir``. It runs
``import fairseq_oss``, which imports nothing heavy (see ``fairseq_oss/__init__.py``).
"""
import os

from setuptools import setup
from setuptools.command.build_py import build_py

PTH = "fairseq_oss.pth"


class BuildPyWithPth(build_py):
    def run(self):
        super().run()
        self.copy_file(PTH, os.path.join(self.build_lib, PTH), preserve_mode=0)

    def get_outputs(self, include_bytecode=1):
        return super().get_outputs(include_bytecode) + [os.path.join(self.build_lib, PTH)]


setup(cmdclass={"build_py": BuildPyWithPth})
