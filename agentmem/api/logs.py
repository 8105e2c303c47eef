"""Access logs without query strings: a key or a user's words sent in a URL must not land
in the log files."""

from __future__ import annotations

import copy
import logging


class NoQuery(logging.Filter):
    """uvicorn's access record is (client, method, path with query, http version, status)."""

    def filter(self, record: logging.LogRecord) -> bool:
        args = record.args
        if isinstance(args, tuple) and len(args) >= 3 and isinstance(args[2], str):
            record.args = (*args[:2], args[2].split("?", 1)[0], *args[3:])
        return True


def log_config() -> dict:
    """uvicorn's logging config with `NoQuery` on the access log."""
    from uvicorn.config import LOGGING_CONFIG

    cfg = copy.deepcopy(LOGGING_CONFIG)
    cfg.setdefault("filters", {})["no_query"] = {"()": NoQuery}
    cfg["handlers"]["access"]["filters"] = ["no_query"]
    return cfg
