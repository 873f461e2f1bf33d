"""`python -m generator_service`: run the generator (see generator_service.cli)."""

import sys

from .cli import main

sys.exit(main())
