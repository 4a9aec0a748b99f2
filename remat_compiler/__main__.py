"""``python -m remat_compiler``: the ``remat-compiler`` command line (see :mod:`remat_compiler.cli`)."""
import sys

from remat_compiler.cli import main

if __name__ == "__main__":
    sys.exit(main(prog_name="remat-compiler"))
