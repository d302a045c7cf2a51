"""``python -m transports.kafka.materializer``: run one materializer until it is stopped."""

import sys

from transports.kafka.cli.materializer_process import main

__all__: list[str] = []

if __name__ == "__main__":
    sys.exit(main())
