"""The tests' rank pools are commlab's own local launcher (commlab.measure.launch):
ranks spawned once per world size and reused (conftest.py), each function run on every
rank with a hard deadline, a failing rank's traceback or a silent rank's stacks as the
test's error message."""
from commlab.measure.launch import Outcome, RankFailure, RankPool  # noqa: F401


def status_payload(o: Outcome):
    """(status, the value for "ok", else the traceback or stacks): for fault tests."""
    return o.status, (o.result if o.status == "ok" else o.error)
