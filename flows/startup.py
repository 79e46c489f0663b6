"""What a flow command's process sets for itself before Prefect, MLflow or torch load.

Every module of flows/ imports this first (tests/test_architecture.py checks it), so `python -m qerl.flows.<name>`, a
Prefect worker loading `flows/train.py` and a test importing any one module all start the same way. A package's
`__init__.py` would do it, but flows/ has none: as a namespace portion it does not shadow PyPI's `flows` in a
checkout whose root is on the path (tests/test_packaging.py).
"""

import logging as _logging
import os as _os

from qerl.cli import prepare_process
from qerl.debug import variable

prepare_process()

# Without PREFECT_API_URL, Prefect runs each flow on a temporary local server. Its telemetry heartbeat is of no use
# there and, racing the flow's writes to the server's SQLite file, printed a ~120-line "database is locked"
# traceback on runs that succeeded. Off unless the user says otherwise; a server you run yourself keeps its own
# setting. Set here, before Prefect is imported, so the temporary server (a child process) inherits it.
_os.environ.setdefault("PREFECT_SERVER_ANALYTICS_ENABLED", "false")

# MLflow prints "View run / View experiment" links when a run on a tracking server ends; its experiment link opens
# MLflow 3.17's UI on the GenAI overview in a fresh browser. The flows print their own links to the runs table
# instead (qerl.flows.tracking.experiment_url), unless the user turned MLflow's links off.
PRINT_MLFLOW_LINKS = (variable("MLFLOW_SUPPRESS_PRINTING_URL_TO_STDOUT") or "").lower() not in ("true", "1")
_os.environ["MLFLOW_SUPPRESS_PRINTING_URL_TO_STDOUT"] = "true"


class _ChosenFailure(_logging.Filter):
    """Drops Prefect's traceback of a flow run that ended Failed because its flow *returned* a Failed state (the
    retrain flow's refusal without a champion): the engine re-raises that state as `FailedRun` and logs it with a
    traceback ("Engine execution exited with unexpected exception") in every run a worker starts, right after its
    own "Finished in state Failed('<the message>')" line, which already says it all. Exceptions a flow raises are
    logged as before: they are not FailedRun."""

    def filter(self, record: _logging.LogRecord) -> bool:
        exc = record.exc_info[1] if record.exc_info else None
        return not (type(exc).__name__ == "FailedRun" and type(exc).__module__ == "prefect.exceptions")


# The loggers of Prefect's engine that log the re-raise (prefect.flow_engine.run_flow's error logger, a flow run's;
# prefect.engine's top level). Filters on a logger are kept by Prefect's logging set-up (dictConfig adds, never
# removes, a logger's filters).
for _name in ("prefect.flow_runs", "prefect.engine"):
    _logging.getLogger(_name).addFilter(_ChosenFailure())
