"""``python -m transports.kafka.materializer``: one materializer as a process of its own, until a signal.

It applies a run topic to a store directory until SIGINT or SIGTERM, then stops cleanly with its checkpoint
written. With ``--metrics-port`` it serves ``/metrics`` and ``/healthz`` as ``tokcap materialize`` does
(``readiness``). The process collects garbage less often than Python's default (``collect_less_after_start_up``).
"""

from __future__ import annotations

import argparse
import gc
import logging
import signal
import sys
from collections.abc import Sequence
from contextlib import ExitStack
from pathlib import Path
from types import FrameType

from tokcap.cli.metrics_http import DEFAULT_METRICS_HOST
from tokcap.errors import InvalidInputError
from transports.kafka.errors import MaterializerFailedError
from transports.kafka.materializer import Materializer
from transports.kafka.materializer.readiness import serve_metrics
from transports.kafka.materializer.settings import DEFAULT_SETTINGS

__all__ = ["collect_less_after_start_up", "logger", "main"]

logger = logging.getLogger(__name__)


def _port(text: str) -> int:
    port = int(text)
    if not 0 <= port <= 65535:
        raise argparse.ArgumentTypeError(f"a port is a number from 0 to 65535, not {port}")
    return port


def _parse_args(argv: Sequence[str] | None) -> argparse.Namespace:
    parser = argparse.ArgumentParser(
        prog="python -m transports.kafka.materializer",
        description="Apply a tokcap run topic to a local store directory until SIGINT or SIGTERM.",
    )
    parser.add_argument("--bootstrap", required=True, help="Kafka bootstrap servers, host:port[,host:port]")
    parser.add_argument("--topic", required=True, help="the run topic to read")
    parser.add_argument("--dir", required=True, type=Path, help="the store directory to write")
    parser.add_argument(
        "--partitions", default=None, help="comma-separated subset of partitions (default: all)"
    )
    parser.add_argument(
        "--block-messages",
        type=int,
        default=DEFAULT_SETTINGS.block_messages,
        help="most messages applied per durable block before a checkpoint "
        f"(default: {DEFAULT_SETTINGS.block_messages})",
    )
    parser.add_argument(
        "--metrics-port",
        type=_port,
        default=None,
        help="serve Prometheus /metrics and a /healthz readiness check on this port (0: any free port)",
    )
    parser.add_argument(
        "--metrics-host",
        default=DEFAULT_METRICS_HOST,
        help=f"the address --metrics-port listens on (default: {DEFAULT_METRICS_HOST})",
    )
    return parser.parse_args(argv)


_YOUNG_COLLECTION_THRESHOLD = 20_000
"""Container allocations between the collector's youngest passes in a materializer's own process (Python: 700)."""


def collect_less_after_start_up() -> None:
    """Leave the start-up heap out of every collection and run the youngest pass less often.

    Each pass walks every young container, and an applied put leaves long lists of token ids behind (its
    entry, kept hot by the projection): at Python's default a pass ran every 60-odd events and the passes
    took 15-25% of the apply step's CPU. Garbage cycles are rare here, so fewer passes free them a little later
    and cost nothing else. Only a process that is a materializer and nothing else sets this; a trainer that
    hosts one keeps its own settings, and may call this after its own start-up.
    """
    gc.collect()
    gc.freeze()
    gc.set_threshold(_YOUNG_COLLECTION_THRESHOLD, *gc.get_threshold()[1:])


def main(argv: Sequence[str] | None = None) -> int:
    """Run a materializer process; it stops cleanly, checkpoint written, on SIGINT or SIGTERM."""
    args = _parse_args(argv)
    logging.basicConfig(level=logging.INFO, format="%(asctime)s %(levelname)s %(name)s: %(message)s")
    partitions = None if args.partitions is None else [int(p) for p in args.partitions.split(",") if p]
    try:
        materializer = Materializer(
            args.bootstrap, args.topic, args.dir, partitions, block_messages=args.block_messages
        )
    except InvalidInputError as exc:
        print(f"materializer not started: {exc}", file=sys.stderr)
        return 2

    def _on_signal(signum: int, frame: FrameType | None) -> None:
        materializer.request_stop()

    signal.signal(signal.SIGINT, _on_signal)
    signal.signal(signal.SIGTERM, _on_signal)
    with ExitStack() as serving:
        if args.metrics_port is not None:
            server = serve_metrics(materializer, host=args.metrics_host, port=args.metrics_port)
            serving.callback(server.close)
            logger.info("serving /metrics and /healthz on http://%s:%d", server.host, server.port)
        collect_less_after_start_up()
        try:
            materializer.run_until_stopped()
        except MaterializerFailedError as exc:
            print(f"materializer failed: {exc}", file=sys.stderr)
            return 1
    return 0
