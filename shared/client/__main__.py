"""`python -m shared.client ...` is the `pdserve` command."""

from __future__ import annotations

import sys

from shared.client.cli import main

sys.exit(main())
