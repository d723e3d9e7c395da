"""Run one benchmark configuration in its own process and stream the ``RESULT <json>`` rows it prints.

Each engine gets a fresh process (vLLM's global state, GPU memory). Rows are yielded as they arrive, so a run cut
short still leaves every finished row with the caller; the child's stderr goes to a file (a pipe read only at the
end could fill and stall the child) and its tail is printed if the child fails (and appended to ``failures`` when
given, for benches that record a failed row and go on).
"""

from __future__ import annotations

import json
import subprocess
import tempfile
from collections.abc import Iterator


def result_rows(
    cmd: list[str], label: str, env: dict[str, str] | None = None, failures: list[str] | None = None
) -> Iterator[dict]:
    with tempfile.TemporaryFile(mode="w+") as err:
        with subprocess.Popen(cmd, stdout=subprocess.PIPE, stderr=err, text=True, env=env) as proc:
            for line in proc.stdout:
                if line.startswith("RESULT "):
                    yield json.loads(line[len("RESULT ") :])
        if proc.returncode:
            err.seek(0)
            message = f"{label} failed (rc {proc.returncode}):\n{err.read()[-3000:]}"
            print(message, flush=True)
            if failures is not None:
                failures.append(message)
