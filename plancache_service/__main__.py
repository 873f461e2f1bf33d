"""`python -m plancache_service`: run the sidecar (see plancache_service.cli)."""

import sys

from .cli import main

sys.exit(main())
