"""`python -m nbbatch` is the `nbbatch` command."""

import sys

from nbbatch.ui.cli import main

sys.exit(main())
