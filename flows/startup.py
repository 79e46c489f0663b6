"""What a flow command's process sets for itself before Prefect, MLflow or torch load.

Every module of flows/ imports this first (tests/test_architecture.py checks it), so `python -m qerl.flows.<name>`, a
Prefect worker loading `flows/train.py` and a test importing any one module all start the same way. A package's
`__init__.py` would do it, but flows/ has none: as a namespace portion it does not shadow PyPI's `flows` in a
checkout whose root is on the path (tests/test_packaging.py).
"""

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
