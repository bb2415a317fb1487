"""``python -m flowrl`` is the ``flowrl`` command."""

import sys

from flowrl.cli.main import main

sys.exit(main())
