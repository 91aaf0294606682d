"""Run a documented command up to its first argument parse: ``python tests/docs_dry_run.py -m module args ...`` or
``python tests/docs_dry_run.py script.py args ...``.

The command's own parser checks every flag and value (unknown flags included); then the run stops with exit code 0
and prints ``DRY_RUN_PARSED``, before any model loads or training starts.
"""

import argparse
import os
import runpy
import sys

_parse_known_args = argparse.ArgumentParser.parse_known_args


def _parse_then_stop(self, args=None, namespace=None):
    namespace, extras = _parse_known_args(self, args, namespace)
    if extras:
        self.error(f"unrecognized arguments: {' '.join(extras)}")
    print("DRY_RUN_PARSED", flush=True)
    raise SystemExit(0)


if __name__ == "__main__":
    argparse.ArgumentParser.parse_known_args = _parse_then_stop
    if sys.argv[1] == "-m":
        sys.argv = sys.argv[2:]
        runpy.run_module(sys.argv[0], run_name="__main__", alter_sys=True)
    else:
        sys.argv = sys.argv[1:]
        sys.path[0] = os.path.dirname(os.path.abspath(sys.argv[0]))  # as `python script.py` would
        runpy.run_path(sys.argv[0], run_name="__main__")
