# SPDX-License-Identifier: Apache-2.0
"""Ships vllm_dflash_startup.pth at the top of site-packages (see
vllm_dflash/cpu/dist_name.py for why a start-up hook is needed)."""

import os

from setuptools import setup
from setuptools.command.build_py import build_py

PTH = "vllm_dflash_startup.pth"


class BuildPyWithPth(build_py):
    def run(self) -> None:
        super().run()
        self.copy_file(PTH, os.path.join(self.build_lib, PTH))


setup(cmdclass={"build_py": BuildPyWithPth})
