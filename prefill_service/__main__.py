"""`python -m prefill_service`: run the prefill service until SIGTERM (see server.py)."""

from __future__ import annotations

import asyncio
import logging
import sys

from prefill_service.config import parse_args
from prefill_service.server import serve


def main() -> int:
    logging.basicConfig(level=logging.INFO, format="%(asctime)s %(levelname)s %(name)s: %(message)s")
    return asyncio.run(serve(parse_args()))


if __name__ == "__main__":
    sys.exit(main())
