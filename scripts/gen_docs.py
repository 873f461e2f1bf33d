"""Write docs/flags.md and docs/errors.md from the code (ditserve.docs); `--check` exits 1 with a diff when the
committed files are stale.

    .venv/bin/python scripts/gen_docs.py            # after adding or changing a flag or an error class
    .venv/bin/python scripts/gen_docs.py --check    # what the default test suite checks
"""

import sys
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))  # run from a checkout without installing

from ditserve.docs import main

if __name__ == "__main__":
    sys.exit(main())
