"""`python -m kernelhub ...` runs the command line."""

import sys

from kernelhub.cli import main

sys.exit(main())
