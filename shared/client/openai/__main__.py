"""`python -m shared.client.openai ...` runs the OpenAI-compatible front (see `server.main`)."""

from __future__ import annotations

import sys

from shared.client.openai.server import main

sys.exit(main())
