"""The commands show the library's log records; the library itself prints nothing."""

from __future__ import annotations

import logging

from agilerl.utils.cli import show_logs


def test_show_logs_puts_the_library_records_on_the_chosen_stream_and_restores_the_loggers(capsys):
    library, planner = logging.getLogger("agilerl"), logging.getLogger("planner")
    before = [(logger.level, list(logger.handlers)) for logger in (library, planner)]
    with show_logs("stdout", "agilerl"):
        logging.getLogger("agilerl.train").info("built 1 GRPO agent(s)")
        logging.getLogger("agilerl.train").debug("below the level: not shown")
        logging.getLogger("agilerl.algorithms").warning("[agilerl] a warning")
    with show_logs("stderr", "planner"):
        logging.getLogger("planner.probe").info("to stderr")
    out, err = capsys.readouterr()
    assert out == "built 1 GRPO agent(s)\n[agilerl] a warning\n"  # the message alone, one line each
    assert err == "to stderr\n"
    assert [(logger.level, list(logger.handlers)) for logger in (library, planner)] == before
    logging.getLogger("agilerl.train").info("after the block: not shown")
    assert capsys.readouterr() == ("", "")
