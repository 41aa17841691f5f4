"""Ships ``commdebug_otel.pth`` into site-packages, so OTEL_PYTHON_COMMDEBUG_ENABLED=true alone starts tracing.

(Editable installs do not get the ``.pth``; ``commdebug-otel run`` works with both.)
"""

import os

from setuptools import setup
from setuptools.command.build_py import build_py

PTH = "commdebug_otel.pth"


class BuildPyWithPth(build_py):
    def run(self):
        super().run()
        self.copy_file(PTH, os.path.join(self.build_lib, PTH), preserve_mode=0)

    def get_outputs(self, include_bytecode=True):
        return [*super().get_outputs(include_bytecode), os.path.join(self.build_lib, PTH)]


setup(cmdclass={"build_py": BuildPyWithPth})
