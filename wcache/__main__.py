"""``python -m wcache ...``: the ``wcache`` console script (:mod:`wcache.launcher`), for
checkouts on ``PYTHONPATH`` that have no installed script (the H200 bundle)."""

import sys

from wcache.launcher import main

if __name__ == "__main__":
    sys.exit(main())
