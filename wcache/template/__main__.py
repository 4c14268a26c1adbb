"""``python -m wcache.template``: the template process (``wcache template start``).

Started without ``-P``: ``sys.flags.safe_path`` would be inherited by every child and
replayed by ``subprocess``/``multiprocessing`` into what they start
(``subprocess._args_from_interpreter_flags``), which a direct start of the command
does not have. The directory ``-m`` puts first on ``sys.path`` (the start's cwd:
``/`` for ``wcache template start``) is dropped here instead, before the template
imports anything from it; each child puts its command's own ``sys.path[0]`` there.
"""

import os
import sys

if not sys.flags.safe_path and sys.path and sys.path[0] == os.getcwd():
    del sys.path[0]

# after the fix above: the server and all it imports are found without the cwd
from wcache.template.server import main

if __name__ == "__main__":
    sys.exit(main())
