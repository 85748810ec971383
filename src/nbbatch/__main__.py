"""`python -m nbbatch` is the `nbbatch` command."""

import sys

from .cli import main

sys.exit(main())
