"""Ships ``commdebug_otel.pth`` into site-packages, so OTEL_PYTHON_COMMDEBUG_ENABLED=true alone starts tracing.

Wheels (``pip install .``) get it from ``build_lib``. Editable installs (``pip install -e .``) build a
wheel too, but only from what setuptools' ``editable_wheel`` writes into its unpacked wheel; it
points ``install``'s ``install_lib`` there (as for data, headers and scripts), so in editable mode the
``.pth`` is copied there. Both kinds of install then start tracing from the environment alone.
"""

import os

from setuptools import setup
from setuptools.command.build_py import build_py

PTH = "commdebug_otel.pth"


class BuildPyWithPth(build_py):
    def run(self):
        super().run()
        target = self._pth_target()
        if target is not None:
            self.mkpath(target)
            self.copy_file(PTH, os.path.join(target, PTH), preserve_mode=0)

    def _pth_target(self):
        """Where the wheel's top level (site-packages once installed) is being built, or None."""
        if not getattr(self, "editable_mode", False):
            return self.build_lib
        # editable_wheel: install_lib is its unpacked wheel, whose files all go into the wheel.
        return self.get_finalized_command("install").install_lib

    def get_outputs(self, include_bytecode=True):
        outputs = super().get_outputs(include_bytecode)
        if getattr(self, "editable_mode", False):
            return outputs  # not in build_lib: a strict editable install would try to link it from there
        return [*outputs, os.path.join(self.build_lib, PTH)]


setup(cmdclass={"build_py": BuildPyWithPth})
