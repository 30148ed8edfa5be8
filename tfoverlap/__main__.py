"""``python -m tfoverlap``: the same as the ``tfoverlap`` command."""
import sys

from tfoverlap.cli import main

sys.exit(main())
