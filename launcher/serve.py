"""`zserve serve`: the supervisor process's own set-up, the launch plan, the supervisor."""

from __future__ import annotations

import argparse
import logging

from launcher.logs import setup_logging
from launcher.plan import LaunchRefused, plan_launch
from launcher.supervisor import Supervisor
from protocol.process_life import name_process

log = logging.getLogger("zserve.supervisor")


def serve(args: argparse.Namespace) -> int:
    """Run the server the flags describe; the exit code: 0 after a signal, 1 after a
    failure, 2 for a command line zserve refuses."""
    setup_logging("supervisor", args.log_level)
    name_process("zserve-super")
    try:
        plan = plan_launch(args)
    except LaunchRefused as e:
        log.error("%s", e)
        return 2
    return Supervisor(plan).run()
