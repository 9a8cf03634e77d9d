"""``python -m pnmix_patch`` is the ``pnmix`` command."""

import sys

from .cli import main

sys.exit(main())
