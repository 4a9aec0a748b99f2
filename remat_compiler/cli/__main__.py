"""``python -m remat_compiler.cli``: the command line (:func:`remat_compiler.cli.main`)."""
import sys

from remat_compiler.cli import main

sys.exit(main())
