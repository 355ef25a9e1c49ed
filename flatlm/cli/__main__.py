"""`python -m flatlm.cli ...` runs the command line."""

import sys

from flatlm.cli.main import main

sys.exit(main())
