"""``python -m fair_frontend.shell``: one shell process (the core starts them)."""

import sys

from fair_frontend.shell.process import main

sys.exit(main())
