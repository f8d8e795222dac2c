"""`python -m pdmesh ...` is the `pdmesh` command."""

import sys

from pdmesh.cli import main

sys.exit(main())
