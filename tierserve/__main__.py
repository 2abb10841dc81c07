"""`python -m tierserve ...` is the `tierserve` command."""

import sys

from tierserve.server.cli import main

sys.exit(main())
