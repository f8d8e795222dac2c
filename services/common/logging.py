"""structlog JSON logging, configured once per process in `main()`.

Log lines are one JSON object each on stderr with the service name, level and
timestamp (stdlib `logging` records too, rendered by the same JSON renderer);
request-scoped fields (request_id, tenant, worker, decision) are bound
by the caller with `log.bind(...)` or passed as keyword arguments.
"""

from __future__ import annotations

import logging
import sys

import structlog

_LEVELS = {"debug": logging.DEBUG, "info": logging.INFO, "warning": logging.WARNING, "error": logging.ERROR}


def configure_logging(service: str, level: str = "info", json: bool = True) -> structlog.stdlib.BoundLogger:
    """Configure structlog (and stdlib logging under it) and return the service logger."""
    lvl = _LEVELS.get(level.lower())
    if lvl is None:
        raise ValueError(f"log level must be one of {sorted(_LEVELS)}, got {level!r}")
    renderer = structlog.processors.JSONRenderer() if json else structlog.dev.ConsoleRenderer(colors=False)
    structlog.configure(
        processors=[
            structlog.contextvars.merge_contextvars,
            structlog.processors.add_log_level,
            structlog.processors.TimeStamper(fmt="iso", utc=True),
            structlog.processors.format_exc_info,
            renderer,
        ],
        wrapper_class=structlog.make_filtering_bound_logger(lvl),
        logger_factory=structlog.PrintLoggerFactory(file=sys.stderr),
        cache_logger_on_first_use=False,
    )
    # Lines of libraries that use stdlib logging (grpc's Python layer, asyncio, uvicorn)
    # come out as the same JSON objects, with their logger's name.
    handler = logging.StreamHandler(sys.stderr)
    handler.setFormatter(
        structlog.stdlib.ProcessorFormatter(
            processor=renderer,
            foreign_pre_chain=[
                structlog.stdlib.add_logger_name,
                structlog.stdlib.add_log_level,
                structlog.processors.TimeStamper(fmt="iso", utc=True),
            ],
        )
    )
    root = logging.getLogger()
    root.handlers = [handler]
    root.setLevel(max(lvl, logging.WARNING))
    return structlog.get_logger(service=service)


def get_logger(**bound: object) -> structlog.stdlib.BoundLogger:
    return structlog.get_logger(**bound)
