"""`python -m ditserve` = the `ditserve` command."""

import sys

from .cli import main

sys.exit(main())
