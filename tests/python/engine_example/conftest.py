"""Run from the source tree, where the package is not installed: its pytest plugin registered by
hand (an installed package registers it through its `pytest11` entry point)."""
import sys
from pathlib import Path

HERE = Path(__file__).resolve().parent
sys.path.insert(0, str(HERE))
try:
    import kvdiff_capture  # noqa: F401
except ImportError:
    sys.path.insert(0, str(HERE.parents[2] / "scripts"))


def pytest_configure(config):
    if not config.pluginmanager.has_plugin("kvdiff"):
        from kvdiff_capture import pytest_plugin
        config.pluginmanager.register(pytest_plugin, "kvdiff")
