"""Where the Python tests find the kvdiff binary: $KVDIFF_BIN, else the installed package's (CI
installs the wheel), else a cargo build in target/."""
import os
import sys
from pathlib import Path

ROOT = Path(__file__).resolve().parents[2]
try:
    import kvdiff_capture
except ImportError:  # not installed: the source tree
    sys.path.insert(0, str(ROOT / "scripts"))
    import kvdiff_capture

try:
    kvdiff_capture.check.kvdiff_binary()
except kvdiff_capture.KvdiffError:
    for built in ("release", "debug"):
        exe = ROOT / "target" / built / "kvdiff"
        if exe.is_file():
            os.environ["KVDIFF_BIN"] = str(exe)
            break

# The example engine's suite runs in its own pytest process (tests/python/test_engine_ci.py), with
# the environment each case plants; collected here it would only run twice.
collect_ignore = [] if os.environ.get("KVDIFF_ENGINE_EXAMPLE") else ["engine_example"]
# The torch engines' suite runs on the GPU machine (scripts/gpu_tests.sh engine-ci).
if not os.environ.get("KVDIFF_GPU_ENGINES"):
    collect_ignore.append("gpu")
