"""``python -P -m wcache.template``: the template process (``wcache template start``)."""

import sys

from wcache.template.server import main

if __name__ == "__main__":
    sys.exit(main())
