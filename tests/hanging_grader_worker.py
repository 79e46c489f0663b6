"""A math-verify worker that says it is ready, then never answers and uses no CPU (blocked, so its CPU budget never
runs out): only qerl.grading's wall-clock backstop ends it. Run as `python -m tests.hanging_grader_worker` by
tests/test_grading.py."""

import json
import sys
import time

sys.stdout.write(json.dumps({"ready": "hanging"}) + "\n")
sys.stdout.flush()
for _line in sys.stdin:
    time.sleep(3600)
