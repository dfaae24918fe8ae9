"""`git bisect run` over an engine's commits: each commit's capture command writes a dump, and
kvdiff holds it to its reference.

    git bisect start BAD GOOD
    git bisect run python -m kvdiff_capture.bisect [kvdiff diff flags] -- CAPTURE_COMMAND...

CAPTURE_COMMAND runs with $KVDIFF_DUMP set to a fresh folder and must write the dump there
(`kvdiff_capture.capture(..., os.environ["KVDIFF_DUMP"])`). Exit codes, as git bisect reads
them: 0 equivalent (good), 1 diverged (bad), 125 this commit cannot be tested (the command
failed or wrote no dump, or kvdiff could not read it): git bisect skips it; 128 for a wrong
command line, which stops the bisect.
"""

from __future__ import annotations

import os
import subprocess
import sys
import tempfile
from typing import List, Optional

from .check import KvdiffError, kvdiff_binary

CANNOT_TEST = 125
STOP = 128  # above 127: git bisect run stops (a wrong command line is wrong at every commit)


def main(argv: Optional[List[str]] = None) -> int:
    args = list(sys.argv[1:] if argv is None else argv)
    if "--" not in args or args.index("--") == len(args) - 1:
        print(__doc__.strip(), file=sys.stderr)
        return STOP
    cut = args.index("--")
    diff_flags, command = args[:cut], args[cut + 1:]
    try:
        kvdiff = kvdiff_binary()
    except KvdiffError as e:
        print(f"kvdiff bisect: {e}", file=sys.stderr)
        return CANNOT_TEST
    with tempfile.TemporaryDirectory(prefix="kvdiff-bisect-") as tmp:
        dump = os.path.join(tmp, "dump")
        env = dict(os.environ, KVDIFF_DUMP=dump)
        try:
            ran = subprocess.run(command, env=env)
        except OSError as e:
            print(f"kvdiff bisect: cannot run {command[0]}: {e}: this commit cannot be tested "
                  f"(exit {CANNOT_TEST}, skipped)", file=sys.stderr)
            return CANNOT_TEST
        if ran.returncode != 0:
            print(f"kvdiff bisect: {' '.join(command)} exited {ran.returncode}: this commit cannot "
                  f"be tested (exit {CANNOT_TEST}, skipped)", file=sys.stderr)
            return CANNOT_TEST
        if not os.path.isfile(os.path.join(dump, "meta.json")):
            print(f"kvdiff bisect: {' '.join(command)} wrote no dump to $KVDIFF_DUMP: this commit "
                  f"cannot be tested (exit {CANNOT_TEST}, skipped)", file=sys.stderr)
            return CANNOT_TEST
        return subprocess.run([kvdiff, "diff", "--bisect", *diff_flags, dump]).returncode


if __name__ == "__main__":
    sys.exit(main())
