"""Which failures are worth a retry: I/O and network hiccups (a slow shared filesystem, a flaky tracking server),
not bugs or bad input, which fail the same way every time."""

from __future__ import annotations

_PERMANENT_OS_ERRORS = (FileNotFoundError, PermissionError, IsADirectoryError, NotADirectoryError)


def is_transient(exc: BaseException) -> bool:
    return isinstance(exc, (OSError, TimeoutError)) and not isinstance(exc, _PERMANENT_OS_ERRORS)


def retry_transient(task, task_run, state) -> bool:
    """Prefect `retry_condition_fn`: retry only transient faults."""
    try:
        state.result()
    except BaseException as exc:  # noqa: BLE001 - the failed state re-raises the task's exception here
        return is_transient(exc)
    return False
